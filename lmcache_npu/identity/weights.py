"""Model identity from content (DESIGN §7, issue 21): a digest of what a model's KV bytes depend on.

A chunk's namespace must change when the weights change, even if the new weights were saved at the same path
under the same name. `fingerprint_weights` digests a checkpoint directory without reading all of it:

* Weight files (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf`, `*.ckpt`, `*.npz`, `*.msgpack`, `*.h5`):
  relative name, size and sampled content. A safetensors shard also gives its complete header (8-byte length and
  JSON, validated), and at least one sample inside every tensor's data range, so a fine-tune that touched one
  tensor is seen; tensors no larger than a sample (KV scales, norms) are read whole. Other weight files give
  their first and last page and, under 1 MiB, are read whole.
* Spread samples: pages evenly spaced over every weight file's data, in proportion to its size, for edits that
  touch only part of a tensor. They get an eighth of the read budget (`max_read_bytes // 8`), or what the
  per-tensor samples left if that is less.
* Definition files, read whole: every `*.json` but tokenizer files and `generation_config.json` (sampling defaults
  and token ids do not change the KV bytes of a given token sequence; vLLM's block hash has the token ids), and
  every `*.py` (trust_remote_code modelling code).
* Full content digests where they are free: a weight file of a Hugging Face cache snapshot
  (`<repo>/snapshots/<revision>/<file>`, a symlink to `<repo>/blobs/<name>`) whose blob name is 64 hex digits
  also gives that name, which huggingface_hub sets to the sha256 of the whole file (the Git LFS oid; non-LFS blobs
  are named by their 40-hex git sha1 and get nothing extra). No byte is read for it, and the samples are kept: they
  still see an in-place edit of a blob that keeps its name. Such an entry is digested under its own kind string,
  so a snapshot's fingerprint differs from a plain copy's; plain directories' fingerprints are as they were.
* Nothing else: not the directory's path or name, mtimes, READMEs, tokenizers, or hidden files and folders
  (`.cache/`, `.git/`: tool metadata). Moving or renaming a checkpoint keeps its fingerprint.

What sampling misses: positions depend only on the file's name, size and header, so anyone can compute them, and
an edit of part of a tensor (a few rows of an embedding, some bytes of one projection) that touches no sampled
page is not seen. Whole-tensor fine-tunes, merged LoRA and re-quantisation change every sampled page and are.

Samples are page-sized (4 KiB) and page-aligned where the tensor allows. Their positions are a deterministic
function of the file's relative name, size and header (and the budget), never random, so every process on every
host that reads the same files with the same budget gets the same digest; `threads` does not change it. Reads
use `os.pread` after `posix_fadvise(POSIX_FADV_RANDOM)`, so kernel readahead does not turn a 4 KiB sample into
128 KiB of I/O. Batches whose pages are all in the page cache are read on the calling thread first (`preadv` with
`RWF_NOWAIT`); only the rest go to a thread pool, so a device sees queue depth while a warm cache is not slowed by
threads fighting over the GIL (H100 host, 16 cores, 700 GB DeepSeek-like layout: 0.7 s warm on one thread, 1.8 s
with 32 before this split).

Budget: headers and definition files are read first and are mandatory; if they alone exceed `max_read_bytes` the
call fails. When every weight file together is no larger than the spread share (and the budget), the files are
read whole instead of sampled. Otherwise, when there are more tensors than the budget allows one 4 KiB sample
each, every tensor still gets one sample, all of the same smaller size `s`: the largest `s` for which
`sum(min(tensor_bytes, s))` fits (tensors smaller than `s` stay whole). A sub-page sample still costs the device
one page, so this bounds the bytes read and hashed, not the device pages touched. If even one byte per tensor does
not fit, the call fails naming the budget. A DeepSeek-V3-like checkpoint (700 GB, 163 shards, ~91,000 tensors,
half of them 3.5 KiB fp8 block scales read whole) reads ~406 MiB in ~107,000 ranges with the 512 MiB default
(lmcache_npu/tools/bench/studies/fingerprint_bench.py): headers, one sample per tensor and 16,300 spread pages.

`adapter_digest` digests a LoRA adapter directory by the same rules under a distinct domain string (an adapter
digest never equals a weights digest of the same files) and reads adapters whole whenever they fit the budget.
`AdapterDigests` caches adapter digests by path and the (size, mtime_ns, inode) of every file under it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import re
import reprlib
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Optional, Sequence, Union

import xxhash

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

FORMAT_VERSION = 1
PAGE_BYTES = 4096
DEFAULT_MAX_READ_BYTES = 512 << 20
DEFAULT_THREADS = 32
SAFETENSORS_PATTERNS = ("*.safetensors",)
OTHER_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.npz", "*.msgpack", "*.h5")
WEIGHT_PATTERNS = SAFETENSORS_PATTERNS + OTHER_WEIGHT_PATTERNS
DEFINITION_PATTERNS = ("*.json", "*.py")
# Tokenizer and sampling files: token ids are in vLLM's block hash already, sampling defaults never reach the KV.
IGNORED_DEFINITIONS = ("tokenizer*.json", "special_tokens_map.json", "vocab.json", "added_tokens.json",
                       "generation_config.json", "chat_template.json")
# safetensors' own refusal limit for a header; a larger length is a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000
# Other weight files below this are read whole: sampling them would save little.
WHOLE_FILE_BELOW = 1 << 20

# a Hugging Face cache blob named by the sha256 of its content (huggingface_hub's REGEX_SHA256 for LFS ETags)
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
_WEIGHTS_DOMAIN = b"lmcache-npu model weights v%d" % FORMAT_VERSION
_ADAPTER_DOMAIN = b"lmcache-npu lora adapter v%d" % FORMAT_VERSION
_READ_PIECE = 1 << 20  # merged reads are cut to this so a worker never holds more than one piece in memory
_BATCH = 64  # reads per pool task: a constant of the format, so the digest does not depend on `threads`
_SPREAD_SHARE = 8  # spread samples (and whole-read checkpoints) get 1/8 of the budget
_PHASE_BITS = 16
# Bytes per element of the safetensors dtypes with whole-byte elements; sub-byte dtypes (F4, F6) are not checked.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class NoWeightsFound(ValueError):
    """A directory holds no file that matches the weight patterns."""


@dataclass(frozen=True)
class WeightsFingerprint:
    """What `fingerprint_weights` found: the digest and what it was made of."""

    digest: bytes  # 32 bytes, SHA-256
    files: int  # weight files
    weight_bytes: int  # total size of the weight files
    bytes_read: int  # headers, definition files and samples together
    samples: int  # sampled ranges read after merging neighbours (a whole small file counts once per MiB)
    seconds: float
    tensors: int = 0  # safetensors tensors, each covered by at least one sample
    tensor_sample_bytes: int = 0  # per-tensor sample size used (PAGE_BYTES unless the budget made it smaller)
    spread_samples: int = 0
    read_whole: bool = False  # the weights were small enough to read whole
    definition_files: tuple[str, ...] = ()
    max_read_bytes: int = DEFAULT_MAX_READ_BYTES
    # weight files whose whole content is named by the sha256 a Hugging Face cache gives their blob (free: no read)
    hub_sha256_files: int = 0

    @property
    def sampled_files(self) -> int:
        """Weight files identified by samples alone: neither read whole nor named by a hub blob's sha256. An edit
        of such a file that misses every sampled page is not seen."""
        return 0 if self.read_whole else self.files - self.hub_sha256_files

    def describe(self) -> dict[str, Any]:
        """A JSON-able account of the fingerprint, for `doctor` and `inspect`."""
        return {
            "digest": self.digest.hex(),
            "format": FORMAT_VERSION,
            "weight_files": self.files,
            "weight_bytes": self.weight_bytes,
            "tensors": self.tensors,
            "definition_files": list(self.definition_files),
            "read_whole": self.read_whole,
            "hub_sha256_files": self.hub_sha256_files,
            "sampled_files": self.sampled_files,
            "tensor_sample_bytes": self.tensor_sample_bytes,
            "spread_samples": self.spread_samples,
            "samples": self.samples,
            "bytes_read": self.bytes_read,
            "max_read_bytes": self.max_read_bytes,
            "seconds": round(self.seconds, 6),
        }


@dataclass(frozen=True)
class _Entry:
    name: str  # relative to the root, "/"-separated: the name that enters the digest
    path: str  # the path opened (symlinks followed)
    size: int
    kind: str  # "safetensors", "weights" or "definition"
    hub_sha256: Optional[bytes] = None  # a weight file in a Hugging Face cache snapshot: its blob's name, 32 bytes


@dataclass
class _FilePlan:
    entry: _Entry
    fd: int
    header: bytes = b""  # safetensors: the 8-byte length and the JSON, as read
    region: tuple[int, int] = (0, 0)  # the byte range holding tensor data
    tensors: Sequence[tuple[int, int]] = ()  # absolute (begin, end) of each non-empty tensor, header order
    seed: int = 0
    samples: Optional[list[tuple[int, int]]] = None  # (offset, length) planned


def _matches(name: str, patterns: Sequence[str]) -> bool:
    lowered = name.lower()
    return any(fnmatchcase(lowered, p) for p in patterns)


def _kind_of(name: str) -> Optional[str]:
    if _matches(name, SAFETENSORS_PATTERNS):
        return "safetensors"
    if _matches(name, OTHER_WEIGHT_PATTERNS):
        return "weights"
    if _matches(name, DEFINITION_PATTERNS) and not _matches(name, IGNORED_DEFINITIONS):
        return "definition"
    return None


def _walk(root: str) -> list[tuple[str, str]]:
    """(relative name, path) of every non-hidden file under root, following symlinked files and folders once."""
    found: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()

    def visit(folder: str, prefix: str) -> None:
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop or a folder linked twice
            return
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as it:
            items = sorted(it, key=lambda e: e.name)
        for item in items:
            if item.name.startswith("."):
                continue
            if item.is_dir(follow_symlinks=True):
                visit(item.path, f"{prefix}{item.name}/")
            else:
                found.append((f"{prefix}{item.name}", item.path))

    visit(root, "")
    return found


def _hub_blob_sha256(path: str) -> Optional[bytes]:
    """The sha256 of a weight file's whole content when `path` is (or links, through more links, to) a file of a
    Hugging Face cache snapshot, `<repo>/snapshots/<revision>/<file>`, linking to `<repo>/blobs/<name>` with a
    64-hex name: huggingface_hub names a blob by its ETag, the sha256 of the content for Git LFS files (every
    safetensors or .bin weight file) and the 40-hex git blob sha1 otherwise. None for anything else (a plain file,
    a sha1 blob, a link that does not follow that layout); costs a few readlink/stat calls, no read."""
    current = path
    for _ in range(40):  # the kernel's own bound on a chain of links
        try:
            target = os.readlink(current)
        except OSError:  # not a link (EINVAL) or gone: no hub blob on this path
            return None
        blob = os.path.join(os.path.dirname(current), target)  # an absolute target replaces the join
        blobs = os.path.realpath(os.path.dirname(blob))
        repo = os.path.dirname(blobs)
        link_dir = os.path.realpath(os.path.dirname(current))
        if (os.path.basename(blobs) == "blobs" and link_dir.startswith(os.path.join(repo, "snapshots") + os.sep)
                and os.path.isdir(os.path.join(repo, "snapshots"))):
            name = os.path.basename(blob)
            return bytes.fromhex(name) if _SHA256_NAME.fullmatch(name) else None
        current = blob
    return None


def _list_entries(root: str) -> list[_Entry]:
    entries = []
    for name, path in _walk(root):
        kind = _kind_of(os.path.basename(name))
        if kind is None:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ValueError(f"{name} in {root} is a broken symlink; a checkpoint file it names must exist") from None
        if stat.S_ISREG(st.st_mode):
            hub = _hub_blob_sha256(path) if kind != "definition" else None  # definition files are read whole
            entries.append(_Entry(name, path, st.st_size, kind, hub))
    return sorted(entries, key=lambda e: e.name)


def _pread_exact(fd: int, length: int, offset: int, name: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            raise ValueError(f"{name}: ends at byte {offset + got} while {length} bytes from {offset} were expected; "
                             f"the file is truncated or changed while it was fingerprinted")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass and never a valid size


def _product(shape: list) -> Any:
    """The element count of a shape, or None when a dimension is not a plain int."""
    if not set(map(type, shape)) <= {int}:  # map/set run in C: no Python frame per dimension
        return None
    return math.prod(shape)


# header values in error messages: depth- and length-bounded, since they come from the file
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxlevel = 200, 200, 16, 4


def _shown(value: Any) -> str:
    return _REPR.repr(value)


def _parse_header(name: str, size: int, raw: bytes) -> list[tuple[int, int]]:
    """Validates a safetensors JSON header; returns the data ranges (relative to the data start) in header order."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: the safetensors header is not valid JSON ({exc})") from None
    except ValueError as exc:  # an integer past Python's digit limit: no offset or dimension is that long
        raise ValueError(f"{name}: the safetensors header is not a tensor index ({exc})") from None
    except RecursionError:  # a tensor index is two levels deep; this file nests past the interpreter's stack
        raise ValueError(f"{name}: the safetensors header nests too deeply to be a tensor index; the file is "
                         "corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the safetensors header must be a JSON object, not {type(header).__name__}")
    data_bytes = size - 8 - len(raw)
    ranges = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(f"{name}: __metadata__ must be a JSON object of strings")
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{name}: tensor {_shown(tensor)} must map to an object with dtype, shape and "
                             "data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if type(dtype) is not str:
            raise ValueError(f"{name}: tensor {_shown(tensor)} has no string dtype")
        # C-level checks (prod, min) keep 90,000-tensor headers cheap; True/False as a dimension is caught by type().
        if type(shape) is not list or type(elements := _product(shape)) is not int or min(shape, default=0) < 0:
            raise ValueError(f"{name}: tensor {_shown(tensor)} shape must be a list of non-negative integers, got "
                             f"{_shown(shape)}")
        if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
                or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{name}: tensor {_shown(tensor)} data_offsets must be [begin, end] with 0 <= begin <= "
                             f"end, got {_shown(offsets)}")
        begin, end = offsets
        if end > data_bytes:
            raise ValueError(f"{name}: tensor {_shown(tensor)} ends at data byte {end} but the file holds only "
                             f"{data_bytes} data bytes: the shard is truncated")
        itemsize = _DTYPE_BYTES.get(dtype)
        if itemsize is not None and elements * itemsize != end - begin:
            raise ValueError(f"{name}: tensor {_shown(tensor)} is {dtype} {_shown(shape)} ({elements * itemsize} "
                             f"bytes) but its data_offsets span {end - begin} bytes")
        ranges.append((begin, end))
    return ranges


def _read_safetensors_header(plan: _FilePlan, budget_left: int, max_read_bytes: int) -> int:
    """Reads and validates a shard's header into `plan`; returns the bytes read."""
    entry = plan.entry
    if entry.size < 8:
        raise ValueError(f"{entry.name}: {entry.size} bytes is too short for a safetensors file (it starts with an "
                         f"8-byte little-endian header length)")
    if budget_left < 8:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the safetensors headers alone exceed it")
    prefix = _pread_exact(plan.fd, 8, 0, entry.name)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or length > entry.size - 8:
        raise ValueError(f"{entry.name}: safetensors header length {length} is absurd for a {entry.size}-byte file "
                         f"(it must be at most {MAX_HEADER_BYTES} and fit in the file); the file is corrupt, truncated "
                         f"or not safetensors")
    if 8 + length > budget_left:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the safetensors headers alone exceed it")
    raw = _pread_exact(plan.fd, length, 8, entry.name)
    start = 8 + length
    plan.header = prefix + raw
    plan.region = (start, entry.size)
    plan.tensors = [(start + b, start + e) for b, e in _parse_header(entry.name, entry.size, raw) if e > b]
    return 8 + length


def _file_seed(entry: _Entry, header: bytes) -> int:
    h = hashlib.sha256(entry.name.encode())
    h.update(struct.pack("<Q", entry.size))
    h.update(header)
    return int.from_bytes(h.digest()[:8], "little")


def _sample_in(begin: int, end: int, length: int, pick: int) -> tuple[int, int]:
    """A `length`-byte range inside [begin, end) chosen by `pick`: page-aligned when a page boundary allows it."""
    if end - begin <= length:
        return begin, end - begin
    first = -(-begin // PAGE_BYTES) * PAGE_BYTES
    last = (end - length) // PAGE_BYTES * PAGE_BYTES
    if first <= last:
        return first + (pick % ((last - first) // PAGE_BYTES + 1)) * PAGE_BYTES, length
    return begin + pick % (end - length - begin + 1), length


def _tensor_sample_bytes(lengths: list[int], budget: int, max_read_bytes: int) -> int:
    """The largest sample size <= PAGE_BYTES with sum(min(length, s)) <= budget (lengths sorted, all > 0)."""
    prefix = [0]
    for n in lengths:
        prefix.append(prefix[-1] + n)

    def cost(s: int) -> int:
        k = bisect.bisect_left(lengths, s)  # lengths[:k] < s are read whole
        return prefix[k] + (len(lengths) - k) * s

    if cost(PAGE_BYTES) <= budget:
        return PAGE_BYTES
    if cost(1) > budget:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: {len(lengths)} tensors need at least one "
                         f"byte each after headers and definition files, and only {max(budget, 0)} bytes are left")
    low, high = 1, PAGE_BYTES  # cost(low) fits, cost(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= budget else (low, mid)
    return low


def _spread(plan: _FilePlan, count: int) -> list[tuple[int, int]]:
    """`count` pages evenly spaced over the plan's data region, with a phase drawn from its seed."""
    lo, hi = plan.region
    span = hi - lo
    if count <= 0 or span <= 0:
        return []
    phase = plan.seed >> (64 - _PHASE_BITS)
    samples = []
    for k in range(count):
        pos = lo + ((k << _PHASE_BITS) + phase) * span // (count << _PHASE_BITS)
        pos = max(lo, min(pos - pos % PAGE_BYTES, hi - PAGE_BYTES))
        samples.append((pos, min(PAGE_BYTES, hi - pos)))
    return samples


def _merge(samples: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping and touching ranges joined, then cut into pieces of at most _READ_PIECE bytes."""
    merged: list[list[int]] = []
    for off, length in sorted(samples):
        if merged and off <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], off + length)
        else:
            merged.append([off, off + length])
    pieces = []
    for begin, end in merged:
        for off in range(begin, end, _READ_PIECE):
            pieces.append((off, min(_READ_PIECE, end - off)))
    return pieces


def _plan_samples(plans: list[_FilePlan], budget: int, whole_read_bytes: int,
                  max_read_bytes: int) -> tuple[bool, int, int]:
    """Fills every weight plan's samples within `budget`; returns (read whole, per-tensor sample size, spread
    samples)."""
    data_bytes = sum(p.region[1] - p.region[0] for p in plans)
    if data_bytes <= min(whole_read_bytes, budget):
        for p in plans:
            p.samples = [(p.region[0], p.region[1] - p.region[0])] if p.region[1] > p.region[0] else []
        return True, 0, 0
    used = 0
    for p in plans:
        if p.entry.kind == "weights":
            lo, hi = p.region
            p.samples = [(lo, hi - lo)] if hi - lo < WHOLE_FILE_BELOW else [(lo, PAGE_BYTES), (hi - PAGE_BYTES,
                                                                                             PAGE_BYTES)]
            used += sum(n for _, n in p.samples)
        else:
            p.samples = []
    if used > budget:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the non-safetensors weight files need {used} "
                         f"bytes of mandatory reads and only {budget} are left after headers and definition files")
    lengths = sorted(e - b for p in plans for b, e in p.tensors)
    sample_bytes = _tensor_sample_bytes(lengths, budget - used, max_read_bytes) if lengths else 0
    for p in plans:
        for index, (begin, end) in enumerate(p.tensors):
            pick = xxhash.xxh3_64_intdigest(struct.pack("<Q", index), seed=p.seed)
            sample = _sample_in(begin, end, sample_bytes, pick)
            p.samples.append(sample)  # type: ignore[union-attr]
            used += sample[1]
    pages = min(budget - used, max_read_bytes // _SPREAD_SHARE) // PAGE_BYTES
    spread = 0
    for p in plans:
        count = pages * (p.region[1] - p.region[0]) // data_bytes
        extra = _spread(p, count)
        p.samples.extend(extra)  # type: ignore[union-attr]
        spread += len(extra)
    return False, sample_bytes, spread


def _batch_digest(data: bytes, ranges: Sequence[tuple[int, int]]) -> tuple[bytes, int]:
    """One digest over a batch's samples and where they came from. xxh3-128 here (the file and model digests above
    it are SHA-256): it notices changed weights at memory speed, and whoever can write the weights needs no
    collision to change what the model computes."""
    where = struct.pack(f"<{2 * len(ranges)}Q", *(v for r in ranges for v in r))
    return xxhash.xxh3_128_digest(data + where), len(data)


def _hash_batch(fd: int, name: str, ranges: Sequence[tuple[int, int]]) -> tuple[bytes, int]:
    return _batch_digest(b"".join([_pread_exact(fd, length, off, name) for off, length in ranges]), ranges)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def _hash_cached_batch(fd: int, ranges: Sequence[tuple[int, int]]) -> Optional[tuple[bytes, int]]:
    """The batch's digest when every sample is in the page cache (preadv with RWF_NOWAIT), else None: cached
    batches are read on the calling thread, where a thread pool would only fight over the GIL."""
    if _NOWAIT is None:
        return None
    parts = []
    for off, length in ranges:
        buffer = bytearray(length)
        try:
            if os.preadv(fd, [buffer], off, _NOWAIT) != length:
                return None
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a filesystem without RWF_NOWAIT
            return None
        parts.append(buffer)
    return _batch_digest(b"".join(parts), ranges)


def _field(h: "hashlib._Hash", value: bytes) -> None:
    h.update(struct.pack("<Q", len(value)))  # length-prefixed, so no two field sequences feed the same bytes
    h.update(value)


def _fingerprint(model_dir: PathLike, domain: bytes, max_read_bytes: int, whole_read_bytes: int,
                 threads: int) -> WeightsFingerprint:
    started = time.perf_counter()
    if not _is_int(max_read_bytes) or max_read_bytes <= 0:
        raise ValueError(f"max_read_bytes must be a positive integer, got {max_read_bytes!r}")
    if not _is_int(threads) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    root = os.fspath(model_dir)
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a directory; a model or adapter fingerprint needs a checkpoint directory")
    entries = _list_entries(root)
    weights = [e for e in entries if e.kind != "definition"]
    if not weights:
        raise NoWeightsFound(f"{root} holds no weight files (looked for {', '.join(WEIGHT_PATTERNS)})")
    definitions = [e for e in entries if e.kind == "definition"]
    needed = sum(e.size for e in definitions)
    if needed > max_read_bytes:
        raise ValueError(f"max_read_bytes {max_read_bytes} is too small: the definition files "
                         f"({', '.join(e.name for e in definitions)}) alone are {needed} bytes")
    with ExitStack() as stack:
        contents: dict[str, bytes] = {}
        read = 0
        for e in definitions:
            fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            stack.callback(os.close, fd)
            contents[e.name] = _pread_exact(fd, e.size, 0, e.name)
            read += e.size
        plans = []
        for e in weights:
            fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            stack.callback(os.close, fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: a 4 KiB sample stays 4 KiB of I/O
            plan = _FilePlan(e, fd, region=(0, e.size))
            if e.kind == "safetensors":
                read += _read_safetensors_header(plan, max_read_bytes - read, max_read_bytes)
            plan.seed = _file_seed(e, plan.header)
            plans.append(plan)
        whole, sample_bytes, spread = _plan_samples(plans, max_read_bytes - read, whole_read_bytes, max_read_bytes)
        batches = []
        for p in plans:
            p.samples = _merge(p.samples or [])
            batches.extend((p.entry.name, p.fd, p.entry.name, p.samples[i:i + _BATCH])
                           for i in range(0, len(p.samples), _BATCH))
        results: list[Optional[tuple[bytes, int]]] = [_hash_cached_batch(b[1], b[3]) for b in batches]
        uncached = [i for i, r in enumerate(results) if r is None]
        workers = min(threads, len(uncached))  # only reads that wait on the device gain from a pool
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fingerprint") as pool:
                read_now = list(pool.map(lambda i: _hash_batch(batches[i][1], batches[i][2], batches[i][3]),
                                         uncached))
        else:
            read_now = [_hash_batch(batches[i][1], batches[i][2], batches[i][3]) for i in uncached]
        for i, result in zip(uncached, read_now):
            results[i] = result
    per_file: dict[str, "hashlib._Hash"] = {p.entry.name: hashlib.sha256() for p in plans}
    for batch, result in zip(batches, results):
        assert result is not None
        digest, n = result
        per_file[batch[0]].update(digest)
        read += n
    total = hashlib.sha256()
    _field(total, domain)
    _field(total, struct.pack("<Q", len(entries)))
    header_of = {p.entry.name: p.header for p in plans}
    for e in entries:
        # a hub blob's entry has its own kind string and one more field, so no plain entry's fields read the same;
        # plain entries keep the fields they always had: their namespaces (and the chunks under them) stay valid
        _field(total, e.kind.encode() if e.hub_sha256 is None else f"{e.kind}+hub-sha256".encode())
        _field(total, e.name.encode())
        _field(total, struct.pack("<Q", e.size))
        if e.hub_sha256 is not None:
            _field(total, e.hub_sha256)
        if e.kind == "definition":
            _field(total, contents[e.name])
        else:
            _field(total, header_of[e.name])
            _field(total, per_file[e.name].digest())
    result = WeightsFingerprint(
        digest=total.digest(), files=len(weights), weight_bytes=sum(e.size for e in weights), bytes_read=read,
        samples=sum(len(p.samples or []) for p in plans), seconds=time.perf_counter() - started,
        tensors=sum(len(p.tensors) for p in plans), tensor_sample_bytes=sample_bytes, spread_samples=spread,
        read_whole=whole, hub_sha256_files=sum(e.hub_sha256 is not None for e in weights),
        definition_files=tuple(e.name for e in definitions), max_read_bytes=max_read_bytes)
    logger.debug("fingerprinted %s: %s", root, result.describe())
    return result


def fingerprint_weights(model_dir: PathLike, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                        threads: int = DEFAULT_THREADS) -> WeightsFingerprint:
    """The content fingerprint of the checkpoint in `model_dir` (see the module docstring for what enters it).
    Processes that must agree on a namespace must use the same `max_read_bytes`; `threads` never changes it."""
    return _fingerprint(model_dir, _WEIGHTS_DOMAIN, max_read_bytes, max_read_bytes // _SPREAD_SHARE, threads)


def adapter_digest(adapter_dir: PathLike, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                   threads: int = DEFAULT_THREADS) -> bytes:
    """32 bytes over a LoRA adapter directory (adapter_config.json, adapter weights, new embeddings): the same
    rules as `fingerprint_weights` under a distinct domain, reading the adapter whole when it fits the budget."""
    return _fingerprint(adapter_dir, _ADAPTER_DOMAIN, max_read_bytes, max_read_bytes, threads).digest


def find_model_dir(model: str, revision: Optional[str] = None,
                   download_dir: Optional[str] = None) -> Optional[str]:
    """The local directory holding `model`: a local directory as is, a Hugging Face hub id as its cached snapshot
    (never over the network), None for a remote URI, a single file, or a hub id that is not cached."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string (a directory or a hub id), got {model!r}")
    if "://" in model:
        return None
    local = os.path.expanduser(model)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        return None  # a lone file (a .gguf): no directory to fingerprint
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except (OSError, ValueError) as exc:  # not cached (LocalEntryNotFoundError) or not a repo id (HFValidationError)
        logger.debug("%s is not a cached hub model: %s", model, exc)
        return None
    return str(path) if os.path.isdir(path) else None


class AdapterDigests:
    """Adapter digests computed once per adapter and again when any file in its directory changes (size, mtime_ns
    or inode); thread-safe. `get` gives None, and one warning per path, when a directory cannot be read."""

    def __init__(self, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES, threads: int = DEFAULT_THREADS) -> None:
        self._max_read_bytes = max_read_bytes
        self._threads = threads
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[tuple[str, int, int, int], ...], bytes]] = {}
        self._warned: set[str] = set()
        self.computed = 0  # digests computed (not served from the cache)

    @staticmethod
    def _signature(root: str) -> tuple[tuple[str, int, int, int], ...]:
        signature = []
        for name, path in _walk(root):
            st = os.stat(path)
            signature.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(signature)

    def get(self, path: PathLike) -> Optional[bytes]:
        """The adapter's digest, from the cache while no file under it changed."""
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            try:
                signature = self._signature(key)  # taken first: a write during the digest shows up next time
                cached = self._cache.get(key)
                if cached is not None and cached[0] == signature:
                    return cached[1]
                digest = adapter_digest(key, max_read_bytes=self._max_read_bytes, threads=self._threads)
            except (OSError, ValueError) as exc:
                self._cache.pop(key, None)
                if key not in self._warned:
                    self._warned.add(key)
                    logger.warning("cannot digest LoRA adapter %s: %s", key, exc)
                return None
            self._warned.discard(key)
            self._cache[key] = (signature, digest)
            self.computed += 1
            return digest
