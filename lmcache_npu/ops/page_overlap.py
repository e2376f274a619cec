"""Which bytes two paged planes, or a plane and a chunk object, have in common (issue 21, item 6).

A plane addresses a comb: block b is the interval [base + b * stride, base + b * stride + block_bytes). Two planes
may share a byte range and still be safe, in two ways layout discovery produces:
- their combs interleave without a common byte (CUDA flash K and V of one tensor, per-head components);
- they are planes of different groups over one allocation (vLLM's hybrid allocator: a block id belongs to one
  group at a time), and only blocks with the same id share bytes.
Anything else lets one transfer write a byte twice or write a byte another plane reads, so a plan refuses it.
Chunk objects are plain intervals and may share no byte of any plane's page range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Comb:
    """The bytes one plane addresses."""

    label: str
    group: int
    base: int
    stride: int
    block_bytes: int
    num_blocks: int

    @property
    def end(self) -> int:
        """One past the last byte of the last block."""
        return self.base + (self.num_blocks - 1) * self.stride + self.block_bytes

    def block_range(self, block: int) -> str:
        start = self.base + block * self.stride
        return f"[{start:#x}, {start + self.block_bytes:#x})"


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _same_stride_clash(a: Comb, b: Comb, stride: int, same_id_ok: bool) -> Optional[tuple[int, int]]:
    """Closed form for combs of one stride: block i of a and block j = i + k of b share a byte iff
    -b.block_bytes < (b.base - a.base) + k * stride < a.block_bytes."""
    delta = b.base - a.base
    low = max((-b.block_bytes - delta) // stride + 1, -(a.num_blocks - 1))
    high = min(_ceil_div(a.block_bytes - delta, stride) - 1, b.num_blocks - 1)
    if low > high:
        return None
    if same_id_ok:
        if low != 0:
            k = low
        elif high != 0:
            k = high
        else:
            return None  # only equal block ids share bytes: one id is one group's at a time
    else:
        k = low
    return (0, k) if k >= 0 else (-k, 0)


def _strided_clash(a: Comb, b: Comb, same_id_ok: bool) -> Optional[tuple[int, int]]:
    """Different strides: for each block i of the comb with fewer blocks, the blocks j of the other it touches."""
    if a.num_blocks > b.num_blocks:
        found = _strided_clash(b, a, same_id_ok)
        return None if found is None else (found[1], found[0])
    i = np.arange(a.num_blocks, dtype=np.int64)
    start = (a.base - b.base) + i * a.stride
    j_low = np.maximum((start - b.block_bytes) // b.stride + 1, 0)
    j_high = np.minimum(-((-(start + a.block_bytes)) // b.stride) - 1, b.num_blocks - 1)
    touching = j_low <= j_high
    if same_id_ok:
        touching &= ~((j_low == i) & (j_high == i))
    hits = np.flatnonzero(touching)
    if not hits.size:
        return None
    first = int(hits[0])
    j = int(j_low[first]) if not same_id_ok or int(j_low[first]) != first else int(j_high[first])
    return first, j


def comb_clash(a: Comb, b: Comb) -> Optional[tuple[int, int]]:
    """(block of a, block of b) sharing a byte where that is not allowed, or None when the planes may coexist."""
    same_id_ok = a.group != b.group
    if a.num_blocks == 1 or b.num_blocks == 1 or a.stride == b.stride:
        stride = b.stride if a.num_blocks == 1 else a.stride
        return _same_stride_clash(a, b, max(stride, 1), same_id_ok)
    return _strided_clash(a, b, same_id_ok)


def _range_pairs(bases: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (a, b) of indices into base-sorted arrays, a < b, whose page ranges meet."""
    upto = np.searchsorted(bases, ends, side="left")  # planes starting before this one ends
    counts = np.maximum(upto - np.arange(bases.size) - 1, 0)
    first = np.repeat(np.arange(bases.size), counts)
    second = first + 1 + np.arange(first.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return first, second


def _pair_clashes(c: dict[str, np.ndarray], a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Closed form of _same_stride_clash over many pairs at once: (clashing pairs, pairs left to the scalar
    check because their strides differ)."""
    single_a, single_b = c["num_blocks"][a] == 1, c["num_blocks"][b] == 1
    stride = np.where(single_a, c["stride"][b], c["stride"][a])
    same = single_a | single_b | (c["stride"][a] == c["stride"][b])
    stride = np.maximum(stride, 1)
    delta = c["base"][b] - c["base"][a]
    low = np.maximum((-c["block_bytes"][b] - delta) // stride + 1, -(c["num_blocks"][a] - 1))
    high = np.minimum(-((delta - c["block_bytes"][a]) // stride) - 1, c["num_blocks"][b] - 1)
    shared_id_only = (c["group"][a] != c["group"][b]) & (low == 0) & (high == 0)
    return same & (low <= high) & ~shared_id_only, ~same


def check_planes_disjoint(combs: Sequence[Comb]) -> None:
    """Refuses the first two planes that share a byte they may not share (see the module docstring).

    Sort-and-sweep over page ranges, then the closed form over every pair whose ranges meet, in numpy (a CPU
    attention plan has thousands of planes and hundreds of thousands of such pairs)."""
    if len(combs) < 2:
        return
    ordered = sorted(combs, key=lambda comb: comb.base)
    columns = {name: np.array([getattr(comb, name) for comb in ordered], dtype=np.int64)
               for name in ("base", "stride", "block_bytes", "num_blocks", "group")}
    ends = np.array([comb.end for comb in ordered], dtype=np.int64)
    a, b = _range_pairs(columns["base"], ends)
    clashing, other_stride = _pair_clashes(columns, a, b)
    suspects = sorted(set(np.flatnonzero(clashing).tolist()) | set(np.flatnonzero(other_stride).tolist()))
    for pair in suspects:
        first, second = ordered[int(a[pair])], ordered[int(b[pair])]
        clash = comb_clash(first, second)
        if clash is not None:
            i, j = clash
            raise ValueError(
                f"planes {first.label} (group {first.group}, pages [{first.base:#x}, {first.end:#x})) and "
                f"{second.label} (group {second.group}, pages [{second.base:#x}, {second.end:#x})) overlap: block "
                f"{i} {first.block_range(i)} and block {j} {second.block_range(j)} share bytes; planes may share "
                "memory only where their blocks interleave or, in different groups, under one block id"
            )


class PlaneSpans:
    """The plan's page ranges sorted by start, to find an object that meets any of them in O(log planes)."""

    def __init__(self, combs: Sequence[Comb]) -> None:
        ordered = sorted(combs, key=lambda c: c.base)
        self._combs = ordered
        self._starts = np.array([c.base for c in ordered], dtype=np.uint64)
        self._max_end = np.maximum.accumulate(np.array([c.end for c in ordered], dtype=np.uint64)) if ordered \
            else np.zeros(0, dtype=np.uint64)

    def first_overlap(self, starts: np.ndarray, nbytes: int) -> Optional[tuple[int, Comb]]:
        """(index into `starts`, plane) of the first interval [start, start + nbytes) that meets a page range."""
        if not self._combs or nbytes <= 0 or not starts.size:
            return None
        ends = starts + np.uint64(nbytes)
        below = np.searchsorted(self._starts, ends, side="left")  # planes starting before the object ends
        reach = np.where(below > 0, self._max_end[np.maximum(below, 1) - 1], np.uint64(0))
        hits = np.flatnonzero((below > 0) & (reach > starts))
        if not hits.size:
            return None
        index = int(hits[0])
        start, end = int(starts[index]), int(ends[index])
        comb = next(c for c in self._combs if c.base < end and c.end > start)
        return index, comb
