"""Where a fingerprint samples a checkpoint's weight files, within a read budget.

Samples are page-sized (4 KiB) and page-aligned where the tensor allows. Their positions are a deterministic
function of the file's relative name, size and header (and the budget), never random, so every process on every
host that reads the same files with the same budget gets the same digest.

Budget: headers and definition files are read first and are mandatory; if they alone exceed `max_read_bytes` the
call fails. When every weight file together is no larger than the spread share (and the budget), the files are
read whole instead of sampled. Otherwise, when there are more tensors than the budget allows one 4 KiB sample
each, every tensor still gets one sample, all of the same smaller size `s`: the largest `s` for which
`sum(min(tensor_bytes, s))` fits (tensors smaller than `s` stay whole). A sub-page sample still costs the device
one page, so this bounds the bytes read and hashed, not the device pages touched. If even one byte per tensor does
not fit, the call fails naming the budget. A DeepSeek-V3-like checkpoint (700 GB, 163 shards, ~91,000 tensors,
half of them 3.5 KiB fp8 block scales read whole) reads ~406 MiB in ~107,000 ranges with the 512 MiB default
(lmcache_npu/tools/bench/studies/fingerprint_bench.py): headers, one sample per tensor and 16,300 spread pages.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import xxhash

from .checkpoint_files import CheckpointFile, FileKind

PAGE_BYTES = 4096
# Other weight files below this are read whole: sampling them would save little.
WHOLE_FILE_BELOW = 1 << 20
SPREAD_SHARE = 8  # spread samples (and whole-read checkpoints) get 1/8 of the budget
_READ_PIECE = 1 << 20  # merged reads are cut to this so a worker never holds more than one piece in memory
_PHASE_BITS = 16


@dataclass
class FilePlan:
    """One weight file open for sampling: what its header said and the (offset, length) ranges to read."""

    entry: CheckpointFile
    fd: int
    header: bytes = b""  # safetensors: the 8-byte length and the JSON, as read
    region: tuple[int, int] = (0, 0)  # the byte range holding tensor data
    tensors: Sequence[tuple[int, int]] = ()  # absolute (begin, end) of each non-empty tensor, header order
    seed: int = 0
    samples: Optional[list[tuple[int, int]]] = None  # (offset, length) planned


def file_seed(entry: CheckpointFile, header: bytes) -> int:
    """The seed of a file's sample positions: its name, size and header, nothing else."""
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


def _spread(plan: FilePlan, count: int) -> list[tuple[int, int]]:
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


def merge_ranges(samples: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


def plan_samples(plans: list[FilePlan], budget: int, whole_read_bytes: int,
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
        if p.entry.kind is FileKind.WEIGHTS:
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
    pages = min(budget - used, max_read_bytes // SPREAD_SHARE) // PAGE_BYTES
    spread = 0
    for p in plans:
        count = pages * (p.region[1] - p.region[0]) // data_bytes
        extra = _spread(p, count)
        p.samples.extend(extra)  # type: ignore[union-attr]
        spread += len(extra)
    return False, sample_bytes, spread
