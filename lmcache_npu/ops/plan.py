"""TransferPlan: the planes and groups a transfer moves (DESIGN §3-§4).

Mirrors ``csrc/common/transfer_plan.h``; the numpy dtypes below are the same bytes as the C
structs. A plan is built once (at ``register_kv_caches``) and reused for every transfer.
"""

from __future__ import annotations

import copy
import enum
import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np
import torch

from .page_overlap import Comb, PlaneSpans, check_planes_disjoint

LAYOUT_VERSION = 1
OBJECT_ALIGN_BYTES = 64
SKIP_SLOT = -1
UB_BLOCK_BYTES = 32
MAX_STRIDE_UNITS = 65535
# The kernels' table fields (transfer_plan.h): a slot is an int32 (RunDesc.first_slot), counts are uint32.
MAX_SLOT_ROWS = 2**31 - 1  # rows one group may address: every slot in [0, rows) then fits int32
MAX_U32 = 2**32 - 1


class PageLayout(enum.IntEnum):
    ND = 0
    FRACTAL_NZ = 1


class Direction(enum.IntEnum):
    STORE = 0  # pages -> chunk objects
    LOAD = 1  # chunk objects -> pages


PLANE_DESC_DTYPE = np.dtype(
    [
        ("base_addr", "<u8"),
        ("block_stride_bytes", "<u8"),
        ("object_offset_bytes", "<u8"),
        ("num_blocks", "<u4"),
        ("rows_per_block", "<u4"),
        ("row_bytes", "<u4"),
        ("group_index", "<u4"),
        ("layout", "<u4"),
        ("nz_unit_bytes", "<u4"),
        ("reserved", "<u4", (4,)),
    ]
)
GROUP_DESC_DTYPE = np.dtype(
    [
        ("rows_per_chunk", "<u4"),
        ("rows_per_block", "<u4"),
        ("plane_begin", "<u4"),
        ("plane_count", "<u4"),
        ("run_begin", "<u4"),
        ("run_count", "<u4"),
        ("item_begin", "<u8"),
    ]
)
RUN_DESC_DTYPE = np.dtype([("first_slot", "<i4"), ("chunk", "<u4"), ("first_row", "<u4"), ("num_rows", "<u4")])
CORE_STATUS_DTYPE = np.dtype(
    [
        ("items_done", "<u4"),
        ("items_rejected", "<u4"),
        ("dma_ops", "<u4"),
        ("pieces", "<u4"),
        ("bytes_moved", "<u8"),
        ("reserved", "<u8"),
    ]
)
assert PLANE_DESC_DTYPE.itemsize == 64 and GROUP_DESC_DTYPE.itemsize == 32
assert RUN_DESC_DTYPE.itemsize == 16 and CORE_STATUS_DTYPE.itemsize == 32


def align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def rows_per_chunk(chunk_tokens: int, compress_ratio: int, sliding_window: Optional[int]) -> int:
    """Rows of a group one chunk stores: only the window's tail for sliding-window groups."""
    tokens = chunk_tokens if sliding_window is None else min(chunk_tokens, sliding_window)
    return tokens // compress_ratio


@dataclass(frozen=True)
class GroupSpec:
    """One scheduler KV-cache group: one block table, one slot mapping."""

    tokens_per_block: int
    compress_ratio: int = 1
    sliding_window: Optional[int] = None
    skip: bool = False
    skip_reason: str = ""
    name: str = ""


@dataclass(frozen=True, eq=False)
class Plane:
    """One paged tensor component of one layer.

    ``pages`` is a uint8 view ``(num_blocks, rows_per_block * row_bytes)`` whose first stride
    is the block stride in bytes (pages may be padded) and whose second stride is 1.
    """

    pages: torch.Tensor
    group: int
    rows_per_block: int
    row_bytes: int
    layout: PageLayout = PageLayout.ND
    nz_unit_bytes: int = 0
    dtype: torch.dtype = torch.uint8
    name: str = ""
    replicated: bool = False  # the same bytes on every tensor-parallel rank: stored once across the group

    @property
    def num_blocks(self) -> int:
        return int(self.pages.shape[0])

    @property
    def block_stride_bytes(self) -> int:
        return int(self.pages.stride(0)) if self.pages.shape[0] > 1 else int(self.pages.shape[1])

    @property
    def base_addr(self) -> int:
        return int(self.pages.data_ptr())

    @property
    def extent_bytes(self) -> int:
        """Bytes from block 0 to the end of the last block's rows."""
        return (self.num_blocks - 1) * self.block_stride_bytes + self.rows_per_block * self.row_bytes

    @property
    def label(self) -> str:
        return self.name or f"plane@{self.base_addr:#x}"

    def comb(self) -> Comb:
        """The bytes this plane addresses, for overlap checks."""
        return Comb(self.label, self.group, self.base_addr, self.block_stride_bytes,
                    self.rows_per_block * self.row_bytes, self.num_blocks)


def _fail(where: str, rule: str) -> None:
    raise ValueError(f"{where}: {rule}")


def _validate_group(index: int, group: GroupSpec, chunk_tokens: int) -> None:
    where = f"group {index}{' (' + group.name + ')' if group.name else ''}"
    if group.tokens_per_block < 1:
        _fail(where, f"tokens_per_block must be >= 1, got {group.tokens_per_block}")
    if group.compress_ratio < 1:
        _fail(where, f"compress_ratio must be >= 1, got {group.compress_ratio}")
    if group.sliding_window is not None and group.sliding_window < 1:
        _fail(where, f"sliding_window must be >= 1 token or None, got {group.sliding_window}")
    if group.skip:
        return  # a skipped group moves nothing, so its granularity does not constrain the chunk
    if chunk_tokens % group.compress_ratio:
        _fail(where, f"chunk_tokens {chunk_tokens} is not a multiple of compress_ratio {group.compress_ratio}")
    tail = chunk_tokens if group.sliding_window is None else min(chunk_tokens, group.sliding_window)
    if tail % group.compress_ratio:
        _fail(where, f"sliding-window tail of {tail} tokens is not a multiple of compress_ratio {group.compress_ratio}")


def _validate_plane(index: int, plane: Plane, groups: Sequence[GroupSpec]) -> None:
    where = f"plane {index} ({plane.label})"
    if not 0 <= plane.group < len(groups):
        _fail(where, f"group {plane.group} does not exist (plan has {len(groups)} groups)")
    pages = plane.pages
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 2:
        _fail(where, "pages must be a 2-D uint8 tensor (num_blocks, rows_per_block * row_bytes)")
    if plane.rows_per_block < 1 or plane.row_bytes < 1:
        _fail(where, f"rows_per_block ({plane.rows_per_block}) and row_bytes ({plane.row_bytes}) must be >= 1")
    if pages.shape[0] < 1:
        _fail(where, "has no blocks")
    block_bytes = plane.rows_per_block * plane.row_bytes
    if pages.shape[1] != block_bytes:
        _fail(where, f"pages hold {pages.shape[1]} B per block but rows_per_block x row_bytes = {block_bytes}")
    if pages.stride(1) != 1:
        _fail(where, "bytes inside a block must be contiguous (pages.stride(1) == 1)")
    if plane.block_stride_bytes < block_bytes:
        _fail(where, f"block stride {plane.block_stride_bytes} B is smaller than a block's rows ({block_bytes} B)")
    for field, value in (("num_blocks", plane.num_blocks), ("rows_per_block", plane.rows_per_block),
                         ("row_bytes", plane.row_bytes), ("nz_unit_bytes", plane.nz_unit_bytes)):
        if value > MAX_U32:
            _fail(where, f"{field} {value} exceeds {MAX_U32}, the largest the kernel's uint32 plane field holds")
    group = groups[plane.group]
    if plane.rows_per_block * group.compress_ratio != group.tokens_per_block:
        _fail(
            where,
            f"rows_per_block {plane.rows_per_block} x compress_ratio {group.compress_ratio} must equal "
            f"group {plane.group}'s tokens_per_block {group.tokens_per_block}",
        )
    if plane.layout == PageLayout.FRACTAL_NZ:
        unit = plane.nz_unit_bytes
        if unit < UB_BLOCK_BYTES or unit % UB_BLOCK_BYTES:
            _fail(where, f"FRACTAL_NZ unit of {unit} B is not a multiple of 32 B (310P moves NZ with 32 B DataCopy)")
        if plane.row_bytes % unit:
            _fail(where, f"row_bytes {plane.row_bytes} is not a whole number of {unit} B NZ units")
        if plane.rows_per_block * unit // UB_BLOCK_BYTES > MAX_STRIDE_UNITS:
            _fail(where, "NZ column pitch exceeds the DataCopy stride limit (65535 x 32 B)")
        if plane.row_bytes // UB_BLOCK_BYTES > MAX_STRIDE_UNITS:
            _fail(where, "row_bytes exceeds the DataCopy stride limit (65535 x 32 B)")
    elif plane.layout != PageLayout.ND:
        _fail(where, f"unknown page layout {plane.layout!r}")


class TransferPlan:
    """Planes and groups of one model instance, in the order chunk objects store them.

    Plan order is group-major (stable inside a group): the planes of a group are contiguous,
    which is what lets the kernel enumerate work items arithmetically.
    """

    def __init__(self, groups: Sequence[GroupSpec], planes: Sequence[Plane], chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = int(chunk_tokens)
        self.groups: tuple[GroupSpec, ...] = tuple(groups)
        for i, g in enumerate(self.groups):
            _validate_group(i, g, self.chunk_tokens)
        for i, p in enumerate(planes):
            _validate_plane(i, p, self.groups)
        self.planes: tuple[Plane, ...] = tuple(sorted(planes, key=lambda p: p.group))
        devices = {p.pages.device for p in self.planes}
        if len(devices) > 1:
            raise ValueError(f"planes live on several devices {sorted(map(str, devices))}; a plan spans one device")
        self.rows_per_chunk: tuple[int, ...] = tuple(
            rows_per_chunk(self.chunk_tokens, g.compress_ratio, g.sliding_window) for g in self.groups
        )
        self.group_rows_per_block: list[Optional[int]] = [None] * len(self.groups)
        self.group_num_blocks: list[Optional[int]] = [None] * len(self.groups)
        for p in self.planes:
            g = p.group
            if self.group_rows_per_block[g] is None:
                self.group_rows_per_block[g], self.group_num_blocks[g] = p.rows_per_block, p.num_blocks
            elif (self.group_rows_per_block[g], self.group_num_blocks[g]) != (p.rows_per_block, p.num_blocks):
                _fail(
                    f"plane {p.label} (group {g})",
                    f"has {p.num_blocks} blocks of {p.rows_per_block} rows but the group's other planes have "
                    f"{self.group_num_blocks[g]} blocks of {self.group_rows_per_block[g]} rows; one block table "
                    "addresses all planes of a group",
                )
        for g, (rows_per_block, num_blocks) in enumerate(zip(self.group_rows_per_block, self.group_num_blocks)):
            where = f"group {g}{' (' + self.groups[g].name + ')' if self.groups[g].name else ''}"
            if rows_per_block is not None and num_blocks * rows_per_block > MAX_SLOT_ROWS:
                _fail(where, f"{num_blocks} blocks x {rows_per_block} rows = {num_blocks * rows_per_block} rows "
                             f"exceed {MAX_SLOT_ROWS}: the kernels address a slot as an int32")
            if self.rows_per_chunk[g] > MAX_SLOT_ROWS:
                _fail(where, f"{self.rows_per_chunk[g]} rows per chunk exceed {MAX_SLOT_ROWS}, the most rows a "
                             "group may address (a slot is an int32)")
        check_planes_disjoint([p.comb() for p in self.planes])
        self.moved_planes: tuple[Plane, ...] = tuple(p for p in self.planes if not self.groups[p.group].skip)
        # the object holds the rank's own planes first, then the replicated ones, so the part a TP group shares is
        # one contiguous tail; with no replicated plane (tp_size 1) this is plain plan order
        offsets: list[int] = [0] * len(self.moved_planes)
        cursor = 0
        for replicated in (False, True):
            if replicated:
                cursor = align_up(cursor, OBJECT_ALIGN_BYTES)
                self.replicated_offset: int = cursor
            for i, p in enumerate(self.moved_planes):
                if p.replicated != replicated:
                    continue
                cursor = align_up(cursor, OBJECT_ALIGN_BYTES)
                offsets[i] = cursor
                cursor += self.rows_per_chunk[p.group] * p.row_bytes
        self.object_offsets: tuple[int, ...] = tuple(offsets)
        self.object_bytes: int = align_up(cursor, OBJECT_ALIGN_BYTES)
        # a plane subset: its transfers must touch only its planes' bytes of an object (never whole objects)
        self.partial: bool = False

    def plane_subset(self, plane_indices: Sequence[int]) -> "TransferPlan":
        """The plan restricted to `plane_indices` (positions in `moved_planes`): a batch built on it moves only those
        planes' rows, each at its offset in this plan's object (the object layout does not change), and groups with
        none of them move nothing. Plan order is kept, so each group's chosen planes stay contiguous in the plane
        table, as the kernels enumerate them."""
        chosen = sorted(set(int(i) for i in plane_indices))
        outside = [i for i in chosen if not 0 <= i < len(self.moved_planes)]
        if outside:
            raise ValueError(f"plane subset: positions {outside[:5]} are outside the plan's {len(self.moved_planes)} "
                             "moved planes")
        subset = copy.copy(self)
        for derived in ("fingerprint", "plane_table", "gap_free", "moved_group_set", "_plane_ranges"):  # cached over the whole plan: recomputed
            subset.__dict__.pop(derived, None)
        subset.partial = self.partial or len(chosen) < len(self.moved_planes)
        subset.moved_planes = tuple(self.moved_planes[i] for i in chosen)
        subset.object_offsets = tuple(self.object_offsets[i] for i in chosen)
        kept = {p.group for p in subset.moved_planes}
        # a group none of whose planes is chosen takes no slots: batches on the subset need no rows of it
        subset.group_rows_per_block = [rows if g in kept else None for g, rows in enumerate(self.group_rows_per_block)]
        subset.group_num_blocks = [n if g in kept else None for g, n in enumerate(self.group_num_blocks)]
        return subset

    @cached_property
    def device(self) -> torch.device:
        """The pages' device (read once: every batch asks)."""
        return self.planes[0].pages.device if self.planes else torch.device("cpu")

    def moved_group_indices(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if not g.skip and self.group_rows_per_block[i] is not None]

    @cached_property
    def moved_group_set(self) -> frozenset[int]:
        """`moved_group_indices` as a set, computed once (every batch asks)."""
        return frozenset(self.moved_group_indices())

    def group_plane_range(self, group: int) -> tuple[int, int]:
        """(first index, count) of the group's planes in ``moved_planes``."""
        return self._plane_ranges.get(group, (0, 0))

    @cached_property
    def _plane_ranges(self) -> dict[int, tuple[int, int]]:
        ranges: dict[int, tuple[int, int]] = {}
        for i, p in enumerate(self.moved_planes):
            first, count = ranges.get(p.group, (i, 0))
            ranges[p.group] = (first, count + 1)
        return ranges

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes over the geometry and the format version: the same model laid out the same way matches across
        processes and device families; addresses and block counts do not enter it."""
        h = hashlib.sha256(f"lmcache-npu layout v{LAYOUT_VERSION} chunk {self.chunk_tokens}".encode())
        for g in self.groups:
            h.update(repr((g.tokens_per_block, g.compress_ratio, g.sliding_window, g.skip)).encode())
        for p, offset in zip(self.moved_planes, self.object_offsets):
            h.update(repr((p.group, p.rows_per_block, p.row_bytes, int(p.layout), p.nz_unit_bytes, str(p.dtype),
                           offset)).encode())
        h.update(str(self.object_bytes).encode())
        return h.digest()[:16]

    @cached_property
    def page_spans(self) -> PlaneSpans:
        """Every plane's page range (skipped groups' included: a store into them would corrupt model state)."""
        return PlaneSpans([p.comb() for p in self.planes])

    @cached_property
    def plane_table(self) -> np.ndarray:
        table = np.zeros(len(self.moved_planes), dtype=PLANE_DESC_DTYPE)
        for i, (p, off) in enumerate(zip(self.moved_planes, self.object_offsets)):
            table[i] = (p.base_addr, p.block_stride_bytes, off, p.num_blocks, p.rows_per_block, p.row_bytes,
                        p.group, int(p.layout), p.nz_unit_bytes, (0, 0, 0, 0))
        return table

    @property
    def replicated_bytes(self) -> int:
        """Bytes of the object's replicated tail (0 when no plane is replicated across the TP group)."""
        return self.object_bytes - self.replicated_offset

    @cached_property
    def gap_free(self) -> bool:
        """Plane segments tile the object exactly (no alignment gaps): a store then writes every object byte."""
        cursor = 0
        for offset, p in sorted(zip(self.object_offsets, self.moved_planes), key=lambda pair: pair[0]):
            if offset != cursor:
                return False
            cursor = offset + self.rows_per_chunk[p.group] * p.row_bytes
        return cursor == self.object_bytes

    def object_bytes_naive(self) -> int:
        """Bytes per chunk of a copier that stores every group's full chunk, skipped groups included."""
        total = 0
        for p in self.planes:
            g = self.groups[p.group]
            total += (self.chunk_tokens // g.compress_ratio) * p.row_bytes
        return total
