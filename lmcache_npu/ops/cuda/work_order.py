"""The CUDA kernel's work order, planned on the host in numpy: the batch's runs cut into pieces, (run, plane) items in
staging-byte order, byte-balanced slices for the copy engine, and the copy engine's steps (no GPU needed)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Optional, Sequence

import numpy as np

from ..batch import ChunkBatch
from ..device_staging import stretch_table
from ... import _host
from ..plan import GROUP_DESC_DTYPE, OBJECT_ALIGN_BYTES, RUN_DESC_DTYPE, Direction, TransferPlan

PIECE_BYTES = 64 << 10  # runs are cut so one block gathers about this much: slices complete in staging order
STORE_FIRST_SLICE_BYTES = 1 << 20  # a store's copy engine starts once this much is gathered...
STORE_SLICE_GROWTH = 4  # ...and its later slices grow by this factor, so few handshakes remain
# A load's tail: what still crosses PCIe once the kernel starts. It must outlast the kernel's start (~20 µs after the
# first slice lands) and the first slice's scatter (~1/20 of its PCIe time), or the kernel runs after PCIe is done.
LOAD_TAIL_BYTES = 2 << 20
LOAD_TAIL_SHARE = 12
MAX_SLICES = 256


@dataclass(frozen=True)
class WorkOrder:
    """The kernel's work: the batch's runs cut into pieces, and (run, plane) items in staging-byte order, cut into
    byte-balanced slices for the copy engine."""

    runs: np.ndarray  # RUN_DESC_DTYPE: the batch's runs, each cut into pieces of about PIECE_BYTES per plane
    group_table: np.ndarray  # GROUP_DESC_DTYPE over `runs`
    items: np.ndarray  # (n, 4) uint32: run, plane, slice, 0
    slice_items: np.ndarray  # uint32 per slice
    piece_table: np.ndarray  # (n, 4) int64 in slice and staging order: chunk, offset in object, length, slice


_WIDEST_ROWS: "weakref.WeakKeyDictionary[TransferPlan, list[int]]" = weakref.WeakKeyDictionary()


def widest_rows(plan: TransferPlan) -> list[int]:
    """Per group, the widest row its moved planes hold (0 for a skipped group); computed once per plan."""
    widest = _WIDEST_ROWS.get(plan)
    if widest is None:
        widest = [0] * len(plan.groups)
        for p in plan.moved_planes:
            widest[p.group] = max(widest[p.group], p.row_bytes)
        _WIDEST_ROWS[plan] = widest
    return widest


def split_runs(batch: ChunkBatch, piece_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch's runs cut so no piece holds more than `piece_bytes` on its group's widest plane (at least one row),
    and the group table over them. Pieces are runs too (consecutive rows and slots inside one block)."""
    runs_out, table = [], batch.group_table.copy()
    run_cursor = item_cursor = 0
    for g, (group, widest) in enumerate(zip(batch.group_table, widest_rows(batch.plan))):
        begin, count = int(group["run_begin"]), int(group["run_count"])
        runs = batch.runs[begin: begin + count]
        plane_count = int(group["plane_count"])
        if count and widest and piece_bytes > 0:
            rows = max(1, piece_bytes // widest)
            num_rows = runs["num_rows"].astype(np.int64)
            counts = -(-num_rows // rows)
            pieces = np.repeat(runs, counts)
            offset = (np.arange(pieces.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * rows
            pieces["first_row"] += offset.astype(np.uint32)
            live = pieces["first_slot"] >= 0
            pieces["first_slot"][live] += offset[live].astype(np.int32)
            pieces["num_rows"] = np.minimum(rows, np.repeat(num_rows, counts) - offset).astype(np.uint32)
            runs = pieces
        table[g]["run_begin"], table[g]["run_count"], table[g]["item_begin"] = run_cursor, runs.size, item_cursor
        runs_out.append(runs)
        run_cursor += runs.size
        item_cursor += runs.size * plane_count
    return (np.concatenate(runs_out) if runs_out else batch.runs), table


def slice_bounds(total: int, direction: Direction, pipelined: bool, first: int = STORE_FIRST_SLICE_BYTES,
                 growth: int = STORE_SLICE_GROWTH, tail_bytes: int = LOAD_TAIL_BYTES,
                 tail_share: int = LOAD_TAIL_SHARE) -> np.ndarray:
    """End offsets of the copy engine's slices of `total` staging bytes.

    Not pipelined: one. A store's grow from `first` by `growth`: the copy engine starts once the first is gathered
    and never waits long for the next. A load's kernel starts once its first slice (all but a tail of `tail_bytes` +
    1/`tail_share` of the bytes) is in and scatters it while the tail crosses PCIe in halving slices, so only the
    last, smallest slice's scatter remains once PCIe is done."""
    if not pipelined or total <= 0:
        return np.array([max(total, 0)], dtype=np.int64)
    if direction == Direction.LOAD:
        tail = min(total // 2, max(0, tail_bytes) + total // max(1, tail_share))
        if tail == 0:
            return np.array([total], dtype=np.int64)
        bounds, position, rest = [total - tail], total - tail, tail
        for part in (tail // 2, tail // 4, tail // 8):  # the last slice is what rest leaves: about tail / 8
            if 0 < part < rest:
                position, rest = position + part, rest - part
                bounds.append(position)
        bounds.append(total)
        return np.array(bounds, dtype=np.int64)
    bounds, position, size = [], 0, max(1, first)
    while position < total and len(bounds) < MAX_SLICES - 1:
        position = min(position + size, total)
        bounds.append(position)
        size *= max(2, growth)
    if bounds[-1] < total:
        bounds.append(total)
    return np.array(bounds, dtype=np.int64)


def _item_spans(batch: ChunkBatch, piece_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                               np.ndarray, np.ndarray]:
    """The batch's runs cut into pieces, their group table, and every (run, plane) pair's run, plane, staging start
    and length, run-major per group (unsorted)."""
    plan = batch.plan
    runs, group_table = split_runs(batch, piece_bytes)
    plane_offsets = np.array(plan.object_offsets, dtype=np.int64)
    plane_rows = np.array([p.row_bytes for p in plan.moved_planes], dtype=np.int64)
    run_ids, plane_ids = [], []
    for group in group_table:
        runs_in, planes_in = int(group["run_count"]), int(group["plane_count"])
        if runs_in and planes_in:  # every (run, plane) pair, run-major
            run_ids.append(np.repeat(np.arange(group["run_begin"], group["run_begin"] + runs_in), planes_in))
            plane_ids.append(np.tile(np.arange(group["plane_begin"], group["plane_begin"] + planes_in), runs_in))
    if not run_ids:
        empty = np.zeros(0, dtype=np.int64)
        return runs, group_table, empty, empty, empty, empty
    run_id, plane_id = np.concatenate(run_ids), np.concatenate(plane_ids)
    chunk = runs["chunk"][run_id].astype(np.int64)
    offset = plane_offsets[plane_id] + runs["first_row"][run_id].astype(np.int64) * plane_rows[plane_id]
    length = runs["num_rows"][run_id].astype(np.int64) * plane_rows[plane_id]
    return runs, group_table, run_id, plane_id, chunk * plan.object_bytes + offset, length


def _items_table(run_id: np.ndarray, plane_id: np.ndarray, slice_id: np.ndarray) -> np.ndarray:
    items = np.zeros((run_id.size, 4), dtype=np.uint32)
    items[:, 0], items[:, 1], items[:, 2] = run_id, plane_id, slice_id
    return items


def work_order(batch: ChunkBatch, pipelined: bool = False, piece_bytes: int = PIECE_BYTES,
               bounds: Optional[np.ndarray] = None) -> WorkOrder:
    """The kernel's items for `batch` in staging-byte order, with the slice each belongs to (`bounds`: slice end
    offsets; default slice_bounds for the batch's direction)."""
    plan = batch.plan
    runs, group_table, run_id, plane_id, start, length = _item_spans(batch, piece_bytes)
    if not run_id.size:
        return WorkOrder(runs, group_table, np.zeros((0, 4), dtype=np.uint32), np.zeros(0, dtype=np.uint32),
                         np.zeros((0, 4), dtype=np.int64))
    order = np.argsort(start, kind="stable")
    run_id, plane_id, start, length = run_id[order], plane_id[order], start[order], length[order]
    total = batch.num_chunks * plan.object_bytes
    if bounds is None:
        bounds = slice_bounds(total, batch.direction, pipelined)
    if len(bounds) == 1:  # one slice (unpipelined): nothing to search
        slice_id = np.zeros(start.size, dtype=np.int64)
    else:
        _, slice_id = np.unique(np.searchsorted(bounds, start, side="right"), return_inverse=True)
    slice_items = np.bincount(slice_id).astype(np.uint32)
    pieces = (item_pieces(start, length, slice_items, plan.object_bytes) if plan.partial
              else span_pieces(start, length, slice_items, plan.object_bytes))
    return WorkOrder(runs, group_table, _items_table(run_id, plane_id, slice_id), slice_items, pieces)


class PackedPart(IntEnum):
    """The parts of a transfer's packed table buffer, in buffer order (csrc/host/sliced_order.h, PackedPart)."""

    GROUPS = 0
    RUNS = 1
    OBJECTS = 2  # per chunk the address the kernel reads: its staging bytes, or the object itself
    ITEMS = 3
    SLICE_ITEMS = 4
    COUNTERS = 5  # per slice, zero
    STATUS = 6  # the kernel's report, zero
    HOST_OBJECTS = 7  # a mapped prefix's host objects (else empty)


@dataclass(frozen=True)
class PackedTables:
    """A transfer's tables written into a backend's host buffer: where each PackedPart starts, the bytes used, the
    counts the native record carries, the per-slice item counts and the copy rows (staging address, host address,
    bytes, slice)."""

    offsets: Sequence[int]
    table_bytes: int
    num_items: int
    num_runs: int
    num_groups: int
    slice_items: np.ndarray  # uint32 per slice
    copies: np.ndarray  # (n, 4) uint64


def _plane_slices(plan: TransferPlan, plane_slice: np.ndarray) -> np.ndarray:
    plane_slice = np.asarray(plane_slice, dtype=np.int64)
    if plane_slice.shape != (len(plan.moved_planes),):
        raise ValueError(f"sliced load: {plane_slice.size} plane slices for {len(plan.moved_planes)} moved planes")
    return plane_slice


def _name_the_plane(plan: TransferPlan, plane_slice: np.ndarray, num_slices: int) -> None:
    """Raises naming the plane by its label where the native planner refused a plane outside the slices."""
    outside = np.flatnonzero((plane_slice < 0) | (plane_slice >= num_slices))
    if outside.size:
        bad = int(outside[0])
        raise ValueError(f"sliced load: plane {plan.moved_planes[bad].label} is in slice {int(plane_slice[bad])}, "
                         f"outside the load's {num_slices} slices") from None


def sliced_load_order(batch: ChunkBatch, plane_slice: np.ndarray, num_slices: int,
                      piece_bytes: int = PIECE_BYTES) -> WorkOrder:
    """A sliced load's items in forward order (issue 41): grouped by the slice of their plane (`plane_slice`, per
    moved plane of the batch's plan), staging-byte order inside each, with exactly `num_slices` slice counts (empty
    slices count 0). A slice's pieces are its items' own bytes: its copies bring in what its kernel reads, and
    nothing of a later slice. Planned natively (csrc/host/sliced_order.h); `sliced_load_tables` packs the same order,
    with its copies, for the CUDA backend (the runtime's path); this form is the order to inspect."""
    plan = batch.plan
    plane_slice = _plane_slices(plan, plane_slice)
    try:  # the native planner checks every plane's slice; the message names the plane by its label
        runs, groups, items, slice_items, pieces = _host.sliced_load_order(
            plan.plane_table, batch.group_table, batch.runs, plane_slice, num_slices, batch.num_chunks,
            max(piece_bytes, 0), plan.object_bytes)
    except ValueError:
        _name_the_plane(plan, plane_slice, num_slices)
        raise
    return WorkOrder(runs.view(RUN_DESC_DTYPE), groups.view(GROUP_DESC_DTYPE), items, slice_items, pieces)


def sliced_load_tables(batch: ChunkBatch, plane_slice: np.ndarray, num_slices: int, piece_bytes: int,
                       staging_address: int, status_bytes: int,
                       buffer: Callable[[int], np.ndarray]) -> PackedTables:
    """`sliced_load_order` planned and packed in one native call into `buffer(nbytes)` (a uint8 host buffer of at
    least nbytes; 0: the current one), with its copies (none where `staging_address` is 0: the kernel reads the
    objects). Nothing but this call lies between a sliced load's checked batch and its enqueue."""
    plan = batch.plan
    plane_slice = _plane_slices(plan, plane_slice)
    out = buffer(0)
    for _ in range(2):  # a buffer too small is grown once to the size the planner reported
        try:
            offsets, table_bytes, items, runs, groups, slice_items, copies = _host.sliced_load_tables(
                plan.plane_table, batch.group_table, batch.runs, plane_slice, num_slices, batch.num_chunks,
                max(piece_bytes, 0), plan.object_bytes, batch.object_addresses(), batch.object_storages(),
                staging_address, status_bytes, out)
        except ValueError:
            _name_the_plane(plan, plane_slice, num_slices)
            raise
        if offsets is not None:
            return PackedTables(offsets, table_bytes, items, runs, groups, slice_items, copies)
        out = buffer(table_bytes)
    raise RuntimeError(f"sliced_load_tables: the buffer did not grow to {table_bytes} B")


def span_pieces(start: np.ndarray, length: np.ndarray, slice_items: np.ndarray, object_bytes: int) -> np.ndarray:
    """Per copy-engine slice, everything from its first item to its last, gaps included (a full plan's store
    writes every object byte: skipped rows and alignment gaps as zeros), cut at chunk edges: piece-table rows."""
    rows = []
    ends = np.cumsum(slice_items)
    for k in range(slice_items.size):
        first, last = int(ends[k] - slice_items[k]), int(ends[k] - 1)
        lo, hi = int(start[first]), int(start[last] + length[last])
        rows += [(c, max(lo, c * object_bytes) - c * object_bytes,
                  min(hi, (c + 1) * object_bytes) - max(lo, c * object_bytes), k)
                 for c in range(lo // object_bytes, (hi - 1) // object_bytes + 1)]
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def item_pieces(start: np.ndarray, length: np.ndarray, slice_items: np.ndarray, object_bytes: int) -> np.ndarray:
    """Per copy-engine slice, its items' bytes merged only across gaps under OBJECT_ALIGN_BYTES inside one chunk: a
    partial plan's copies never reach a plane outside it (planes are aligned, so one in between is farther).
    Piece-table rows, vectorized."""
    if not start.size:
        return np.zeros((0, 4), dtype=np.int64)
    end = start + length
    slice_id = np.repeat(np.arange(slice_items.size), slice_items)
    chunk = start // object_bytes
    cut = np.ones(start.size, dtype=bool)
    cut[1:] = ((start[1:] - end[:-1] >= OBJECT_ALIGN_BYTES) | (chunk[1:] != chunk[:-1])
               | (slice_id[1:] != slice_id[:-1]))
    begins = np.flatnonzero(cut)
    lasts = np.append(begins[1:], start.size) - 1
    table = np.empty((begins.size, 4), dtype=np.int64)
    table[:, 0] = chunk[begins]
    table[:, 1] = start[begins] - chunk[begins] * object_bytes
    table[:, 2] = end[lasts] - start[begins]
    table[:, 3] = slice_id[begins]
    return table


def copy_table(staging_address: int, batch: ChunkBatch, order: WorkOrder, pipelined: bool,
               from_slice: int = 0) -> np.ndarray:
    """The copy engine's steps as LmcacheCudaCopy rows (staging address, host address, bytes, slice): one per
    stretch contiguous on both sides, per slice when pipelined, else merged across slices. Slices before
    `from_slice` are not copied (a mapped prefix: the kernel wrote them into the objects itself). The objects'
    addresses are the batch's, read once per batch."""
    object_bytes = batch.plan.object_bytes
    pieces = order.piece_table[order.piece_table[:, 3] >= from_slice]
    if not pipelined:
        pieces = pieces.copy()
        pieces[:, 3] = 0  # one copy-engine slice: stretches merge across the work order's slices
    address = batch.object_addresses()
    stretches = stretch_table(address, batch.object_storages(), pieces, object_bytes)
    rows = np.empty((len(stretches), 4), dtype=np.uint64)
    chunk, offset = stretches[:, 0], stretches[:, 1].astype(np.uint64)
    rows[:, 0] = np.uint64(staging_address) + chunk.astype(np.uint64) * np.uint64(object_bytes) + offset
    rows[:, 1] = address[chunk] + offset
    rows[:, 2] = stretches[:, 2]
    rows[:, 3] = stretches[:, 3]
    return rows


def prefix_order(batch: ChunkBatch, piece_bytes: int, share: int) -> Optional[WorkOrder]:
    """An unpipelined transfer's work order split in two: slice 0, the items in the first 1/`share` of the staging
    bytes, which the kernel moves straight to (store) or from (load) the host objects; slice 1, the rest, through
    staging: gathered and copied after the kernel, or copied in before it and scattered. None where either side
    would be empty."""
    total = batch.num_chunks * batch.plan.object_bytes
    prefix = total // share if share > 0 else 0
    if prefix <= 0 or prefix >= total:
        return None
    order = work_order(batch, True, piece_bytes, np.array([prefix, total], dtype=np.int64))
    return order if order.slice_items.size == 2 else None
