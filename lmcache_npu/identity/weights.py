"""Model identity from content (DESIGN §7, issue 21): `fingerprint_weights` digests a checkpoint directory without
reading all of it, so a chunk's namespace changes when the weights do, even when new weights are saved at the same
path under the same name. It digests each weight file's name, size, header and sampled pages, every definition file
whole and the sha256 a Hugging Face cache's blob name gives, and nothing about where the checkpoint lies. What it reads
and what sampling misses: docs/storage.md §1. Sample placement: `sampling.py`; reads: `sample_reads.py`; headers:
`safetensors_header.py`; which files count: `checkpoint_files.py`; LoRA adapters: `adapters.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..checks import check_int
from .checkpoint_files import WEIGHT_PATTERNS, FileKind, list_checkpoint_files
from .safetensors_header import read_header
from .sample_reads import digest_samples, pread_exact
from .sampling import SPREAD_SHARE, FilePlan, file_seed, merge_ranges, plan_samples

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

FORMAT_VERSION = 1
DEFAULT_MAX_READ_BYTES = 512 << 20
DEFAULT_THREADS = 32

_WEIGHTS_DOMAIN = b"lmcache-npu model weights v%d" % FORMAT_VERSION


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


def _field(h: "hashlib._Hash", value: bytes) -> None:
    h.update(struct.pack("<Q", len(value)))  # length-prefixed, so no two field sequences feed the same bytes
    h.update(value)


def fingerprint_directory(model_dir: PathLike, domain: bytes, max_read_bytes: int, whole_read_bytes: int,
                          threads: int) -> WeightsFingerprint:
    """The fingerprint of the checkpoint in `model_dir` under `domain` (weights or adapters), its weights read whole
    when they fit `whole_read_bytes`."""
    started = time.perf_counter()
    check_int("max_read_bytes", max_read_bytes, lo=1)
    check_int("threads", threads, lo=1)
    root = os.fspath(model_dir)
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a directory; a model or adapter fingerprint needs a checkpoint directory")
    entries = list_checkpoint_files(root)
    weights = [e for e in entries if e.kind is not FileKind.DEFINITION]
    if not weights:
        raise NoWeightsFound(f"{root} holds no weight files (looked for {', '.join(WEIGHT_PATTERNS)})")
    definitions = [e for e in entries if e.kind is FileKind.DEFINITION]
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
            contents[e.name] = pread_exact(fd, e.size, 0, e.name)
            read += e.size
        plans = []
        for e in weights:
            fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            stack.callback(os.close, fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: a 4 KiB sample stays 4 KiB of I/O
            plan = FilePlan(e, fd, region=(0, e.size))
            if e.kind is FileKind.SAFETENSORS:
                shard = read_header(fd, e.name, e.size, max_read_bytes - read, max_read_bytes)
                plan.header, plan.region, plan.tensors = shard.raw, shard.region, shard.tensors
                read += len(shard.raw)
            plan.seed = file_seed(e, plan.header)
            plans.append(plan)
        whole, sample_bytes, spread = plan_samples(plans, max_read_bytes - read, whole_read_bytes, max_read_bytes)
        for p in plans:
            p.samples = merge_ranges(p.samples or [])
        per_file, sampled = digest_samples([(p.entry.name, p.fd, p.samples or []) for p in plans], threads)
        read += sampled
    total = hashlib.sha256()
    _field(total, domain)
    _field(total, struct.pack("<Q", len(entries)))
    header_of = {p.entry.name: p.header for p in plans}
    for e in entries:
        # a hub blob's entry has its own kind string and one more field, so no plain entry's fields read the same;
        # plain entries keep the fields they always had: their namespaces (and the chunks under them) stay valid
        kind = e.kind.value if e.hub_sha256 is None else f"{e.kind.value}+hub-sha256"
        _field(total, kind.encode())
        _field(total, e.name.encode())
        _field(total, struct.pack("<Q", e.size))
        if e.hub_sha256 is not None:
            _field(total, e.hub_sha256)
        if e.kind is FileKind.DEFINITION:
            _field(total, contents[e.name])
        else:
            _field(total, header_of[e.name])
            _field(total, per_file[e.name])
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
    return fingerprint_directory(model_dir, _WEIGHTS_DOMAIN, max_read_bytes, max_read_bytes // SPREAD_SHARE,
                                 threads)


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
