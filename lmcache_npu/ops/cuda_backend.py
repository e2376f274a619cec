"""The CUDA kernel (lmcache_npu._cuda): the same contract on NVIDIA GPUs.

Two ways to reach host chunk objects:
* ``mapped``: the kernel reads/writes pinned host memory directly through UVA (zero-copy);
* ``staging``: the kernel gathers into (scatters from) a device buffer and the copy engine moves the
  contiguous bytes with cudaMemcpyAsync.
``path="auto"`` picks per direction from ``AUTO_PATH`` (measured, see docs/performance.md). Staging transfers from
``AUTO_PIPELINE_MIN_BYTES`` on pipeline the kernel with the copy engine (slice flags); below it the kernel moves a
prefix of the bytes straight to (a store) or from (a load) the pinned host objects while it gathers or scatters the
rest through staging, so PCIe is busy during the kernel too.
Either way a transfer is exactly one kernel launch, and one native call enqueues everything around it (table
upload, staging zeroing, copies, events) so the GPU never waits for Python between them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .device_staging import PlaneTables, StagingBuffer, host_stretches, pack_into, packed_offsets
from .transfer_backend import AfterKernel, BackendUnavailable, KernelReport, TransferBackend, warm_up
from .batch import ChunkBatch
from .plan import Direction, TransferPlan

logger = logging.getLogger(__name__)

PATHS = ("auto", "mapped", "staging")
# Chosen from the H200 measurements in docs/performance.md: staging is as fast as mapped or faster in both
# directions and leaves the SMs to the model while the copy engine crosses PCIe.
AUTO_PATH = {Direction.STORE: "staging", Direction.LOAD: "staging"}
# Pipelining (the copy engine meets the kernel through per-slice flags) from this much payload: below it the
# handshakes cost more than the kernel they hide (H100, 2026-11-24, docs/performance.md).
AUTO_PIPELINE_MIN_BYTES = {Direction.STORE: 34 << 20, Direction.LOAD: 34 << 20}
PIECE_BYTES = 64 << 10  # runs are cut so one block gathers about this much: slices complete in staging order
STORE_FIRST_SLICE_BYTES = 1 << 20  # a store's copy engine starts once this much is gathered...
STORE_SLICE_GROWTH = 4  # ...and its later slices grow by this factor, so few handshakes remain
# A load's tail: what still crosses PCIe once the kernel starts. It must outlast the kernel's start (~20 µs after the
# first slice lands) and the first slice's scatter (~1/20 of its PCIe time), or the kernel runs after PCIe is done.
LOAD_TAIL_BYTES = 2 << 20
LOAD_TAIL_SHARE = 12
# An unpipelined store's kernel writes 1/this of the bytes straight into the pinned host objects over PCIe while it
# gathers the rest, so PCIe is busy during the kernel too (H100: 1/16 beat 1/12, 1/24 and 1/48, docs/performance.md).
# Gap-free plans only: the kernel writes items, never the gaps between them.
STORE_MAPPED_PREFIX_SHARE = 16
# An unpipelined load's copy engine moves all but 1/this of the bytes before the kernel, which reads that share
# straight from the pinned host objects while it scatters the rest, so PCIe is busy during the scatter too (H100:
# 1/32 beat 1/8 and 1/16, one llama3-8b chunk 0.949 -> 0.972 of the pinned copy, docs/performance.md).
LOAD_MAPPED_PREFIX_SHARE = 32
MAX_SLICES = 256

NO_PIPELINE, RELEASE_SLICES, ACQUIRE_SLICES, MAPPED_PREFIX = 0, 1, 2, 3

# The native transfer record (LmcacheCudaTransfer in csrc/cuda/kv_transfer_cuda.h), field by field.
_RECORD_U64 = ("stream", "planes", "groups", "runs", "objects", "host_objects", "items", "slice_items",
               "slice_counters", "slice_flags", "status", "num_items")
_RECORD_U32 = ("num_planes", "num_groups", "num_runs", "num_chunks", "kernel_direction", "blocks", "threads",
               "num_slices", "epoch", "pipeline")
_RECORD_TAIL = ("copy_stream", "table_host", "table_device", "table_bytes", "zero_address", "zero_bytes", "copies",
                "num_copies", "direction", "status_host")
(EVENT_FIRST, EVENT_KERNEL_BEGIN, EVENT_KERNEL_END, EVENT_LAST, EVENT_COPIES_DONE, EVENT_RETURNED,
 EVENT_FIRST_SLICE_IN, EVENT_PAGES_FREE) = range(8)  # the last slot: the caller's own event, per transfer


def record_dtype(cuda: Any) -> np.dtype:
    """The numpy twin of the native record, at the offsets the built module reports (a stale build fails here)."""
    names = _RECORD_U64 + _RECORD_U32 + _RECORD_TAIL + ("events",)
    fields = dict(cuda.TRANSFER_FIELDS)
    if set(fields) != set(names) or cuda.EVENTS != EVENT_PAGES_FREE + 1:
        raise BackendUnavailable(f"lmcache_npu._cuda has transfer fields {sorted(fields)}; this package expects "
                                 f"{sorted(names)}: rebuild it (pip install -e . or setup.py build_ext)")
    formats = (["<u8"] * len(_RECORD_U64) + ["<u4"] * len(_RECORD_U32) + ["<u8"] * len(_RECORD_TAIL)
               + [("<u8", (cuda.EVENTS,))])
    return np.dtype({"names": list(names), "formats": formats, "offsets": [fields[n] for n in names],
                     "itemsize": cuda.TRANSFER_BYTES})


@dataclass(frozen=True)
class WorkOrder:
    """The kernel's work: the batch's runs cut into pieces, and (run, plane) items in staging-byte order, cut into
    byte-balanced slices for the copy engine."""

    runs: np.ndarray  # RUN_DESC_DTYPE: the batch's runs, each cut into pieces of about PIECE_BYTES per plane
    group_table: np.ndarray  # GROUP_DESC_DTYPE over `runs`
    items: np.ndarray  # (n, 4) uint32: run, plane, slice, 0
    slice_items: np.ndarray  # uint32 per slice
    pieces: list[list[tuple[int, int, int]]]  # per slice: (chunk, offset in object, length)


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


def work_order(batch: ChunkBatch, pipelined: bool = False, piece_bytes: int = PIECE_BYTES,
               bounds: Optional[np.ndarray] = None) -> WorkOrder:
    """The kernel's items for `batch` in staging-byte order, with the slice each belongs to (`bounds`: slice end
    offsets; default slice_bounds for the batch's direction)."""
    plan = batch.plan
    runs, group_table = split_runs(batch, piece_bytes)
    plane_offsets = np.array(plan.object_offsets, dtype=np.int64)
    plane_rows = np.array([p.row_bytes for p in plan.moved_planes], dtype=np.int64)
    run_ids, plane_ids = [], []
    for group in group_table:
        r = np.arange(group["run_begin"], group["run_begin"] + group["run_count"], dtype=np.int64)
        p = np.arange(group["plane_begin"], group["plane_begin"] + group["plane_count"], dtype=np.int64)
        if r.size and p.size:
            rr, pp = np.meshgrid(r, p, indexing="ij")
            run_ids.append(rr.reshape(-1))
            plane_ids.append(pp.reshape(-1))
    if not run_ids:
        return WorkOrder(runs, group_table, np.zeros((0, 4), dtype=np.uint32), np.zeros(0, dtype=np.uint32), [])
    run_id, plane_id = np.concatenate(run_ids), np.concatenate(plane_ids)
    chunk = runs["chunk"][run_id].astype(np.int64)
    offset = plane_offsets[plane_id] + runs["first_row"][run_id].astype(np.int64) * plane_rows[plane_id]
    length = runs["num_rows"][run_id].astype(np.int64) * plane_rows[plane_id]
    start = chunk * plan.object_bytes + offset
    order = np.argsort(start, kind="stable")
    run_id, plane_id, start, length = run_id[order], plane_id[order], start[order], length[order]
    total = batch.num_chunks * plan.object_bytes
    if bounds is None:
        bounds = slice_bounds(total, batch.direction, pipelined)
    _, slice_id = np.unique(np.searchsorted(bounds, start, side="right"), return_inverse=True)
    slice_items = np.bincount(slice_id).astype(np.uint32)
    pieces: list[list[tuple[int, int, int]]] = []
    ends = np.cumsum(slice_items)
    for k in range(slice_items.size):
        first, last = int(ends[k] - slice_items[k]), int(ends[k] - 1)
        lo, hi = int(start[first]), int(start[last] + length[last])
        pieces.append([(c, max(lo, c * plan.object_bytes) - c * plan.object_bytes,
                        min(hi, (c + 1) * plan.object_bytes) - max(lo, c * plan.object_bytes))
                       for c in range(lo // plan.object_bytes, (hi - 1) // plan.object_bytes + 1)])
    items = np.zeros((len(order), 4), dtype=np.uint32)
    items[:, 0], items[:, 1], items[:, 2] = run_id, plane_id, slice_id
    return WorkOrder(runs, group_table, items, slice_items, pieces)


def copy_table(staging_address: int, objects: tuple[torch.Tensor, ...], order: WorkOrder, object_bytes: int,
               pipelined: bool, from_slice: int = 0) -> np.ndarray:
    """The copy engine's steps as LmcacheCudaCopy rows (staging address, host address, bytes, slice): one per
    stretch contiguous on both sides, per slice when pipelined, else merged across slices. Slices before
    `from_slice` are not copied (a mapped prefix: the kernel wrote them into the objects itself)."""
    if pipelined:
        per_slice = [(k, host_stretches(objects, pieces, object_bytes)) for k, pieces in enumerate(order.pieces)
                     if k >= from_slice]
    else:
        per_slice = [(0, host_stretches(objects, [p for pieces in order.pieces[from_slice:] for p in pieces],
                                        object_bytes))]
    rows = [(staging_address + chunk * object_bytes + offset, objects[chunk].data_ptr() + offset, length, k)
            for k, stretches in per_slice for chunk, offset, length in stretches]
    return np.array(rows, dtype=np.uint64).reshape(-1, 4)


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


class _Native:
    """What every transfer on one device reuses: the record, its events, the table buffers, the copy stream."""

    def __init__(self, cuda: Any, device: torch.device) -> None:
        self.cuda = cuda
        self.device = device
        self.record = np.zeros(1, dtype=record_dtype(cuda))
        with torch.cuda.device(device):
            self.events = [cuda.event_create() for _ in range(EVENT_PAGES_FREE)]
            self.copy_stream = torch.cuda.Stream(device)
        self.record["events"][0, :EVENT_PAGES_FREE] = self.events
        self.flags = torch.zeros(MAX_SLICES, dtype=torch.int32, device=device)
        self.epoch = 0
        self.host_tables = torch.zeros(0, dtype=torch.uint8)
        self.device_tables = torch.zeros(0, dtype=torch.uint8, device=device)
        torch.cuda.current_stream(device).synchronize()  # the flags are zero before the copy stream waits on them

    def tables(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host and device table buffers of at least `nbytes`, kept across transfers (each transfer is done
        before the next starts), so none allocates page-locked memory while the device may be busy."""
        if self.host_tables.numel() < nbytes:
            size = max(4096, 1 << (nbytes - 1).bit_length())
            self.host_tables = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
            self.device_tables = torch.empty(size, dtype=torch.uint8, device=self.device)  # used on this stream only
        return self.host_tables, self.device_tables

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1
        if self.epoch == 1:  # wrapped (or first): flags from 2^32 transfers ago must not satisfy a wait
            self.flags.zero_()
            torch.cuda.current_stream(self.device).synchronize()
        return self.epoch

    def elapsed_ms(self, begin: int, end: int) -> float:
        return float(self.cuda.event_elapsed_ms(self.events[begin], self.events[end]))

    def close(self) -> None:
        for event in self.events:
            self.cuda.event_destroy(event)
        self.events = []


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, path: str = "auto", blocks: Optional[int] = None, threads: int = 512,
                 pipeline: Optional[bool] = None, piece_bytes: int = PIECE_BYTES,
                 store_first_slice_bytes: int = STORE_FIRST_SLICE_BYTES, store_slice_growth: int = STORE_SLICE_GROWTH,
                 load_tail_bytes: int = LOAD_TAIL_BYTES, load_tail_share: int = LOAD_TAIL_SHARE,
                 pipelined_blocks: Optional[int] = None,
                 store_mapped_prefix_share: int = STORE_MAPPED_PREFIX_SHARE,
                 load_mapped_prefix_share: int = LOAD_MAPPED_PREFIX_SHARE) -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("the cuda backend needs a visible CUDA device")
        try:
            from lmcache_npu import _cuda  # type: ignore[attr-defined]
        except ImportError as exc:
            raise BackendUnavailable(f"lmcache_npu._cuda is not built ({exc})") from exc
        self._cuda: Any = _cuda
        record_dtype(_cuda)  # a stale build is refused here, not at the first transfer
        self.path = path
        self.threads = threads
        self.multiprocessors = _cuda.multiprocessors(torch.cuda.current_device())
        self.blocks = blocks
        # None: one per SM for a store, so its slices complete in order; a load's blocks only wait for the copy engine,
        # which never waits for them, so it keeps the unpipelined count
        self.pipelined_blocks = pipelined_blocks
        self.piece_bytes = piece_bytes
        self.store_first_slice_bytes = store_first_slice_bytes
        self.store_slice_growth = store_slice_growth
        self.load_tail_bytes = load_tail_bytes
        self.mapped_prefix_share = {Direction.STORE: store_mapped_prefix_share,  # 0: no mapped prefix
                                    Direction.LOAD: load_mapped_prefix_share}
        self.load_tail_share = load_tail_share
        self._plane_tables = PlaneTables()
        self._staging = StagingBuffer()
        self._staging_address = 0
        self._native: Optional[_Native] = None
        self._lock = threading.Lock()  # one transfer at a time: the record and buffers are reused
        # Stream memory operations let one launch overlap the kernel with the copy engine.
        probe = torch.zeros(1, dtype=torch.int32, device="cuda")
        probe_stream = torch.cuda.current_stream().cuda_stream
        supported = bool(_cuda.stream_write_value32(probe_stream, probe.data_ptr(), 1)) and bool(
            _cuda.stream_wait_value32(probe_stream, probe.data_ptr(), 1))
        torch.cuda.current_stream().synchronize()
        self._memops = supported
        self.pipeline = pipeline  # None: AUTO_PIPELINE_MIN_BYTES per direction
        if not supported:
            logger.warning("cuStreamWaitValue32 is unavailable: the staging path runs kernel and copy back to back")
        self.last_kernel_ms: Optional[float] = None
        self.last_mapped_prefix = False  # whether the last transfer's kernel moved a prefix straight to/from the host
        self._last_pipelined = False

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None:
            try:
                native.close()
            except Exception:  # the CUDA context may already be gone at interpreter exit
                logger.debug("cuda events not destroyed", exc_info=True)

    def path_for(self, batch: ChunkBatch) -> str:
        if all(o.device.type == "cuda" for o in batch.objects):
            return "device"
        return AUTO_PATH[batch.direction] if self.path == "auto" else self.path

    def pipelined(self, batch: ChunkBatch) -> bool:
        """Whether a staging transfer of `batch` overlaps its kernel with the copy engine."""
        if not self._memops or self.path_for(batch) != "staging":
            return False
        if self.pipeline is not None:
            return self.pipeline
        return batch.payload_bytes >= AUTO_PIPELINE_MIN_BYTES[batch.direction]

    def _host_mapped(self, obj: torch.Tensor) -> bool:
        """Page-locked and addressable by kernels: torch's pinned memory, or a cudaHostRegister'ed arena (torch's
        is_pinned() does not see registrations it did not make)."""
        return obj.is_pinned() or bool(self._cuda.host_mapped(obj.data_ptr(), obj.numel() * obj.element_size()))

    def prepare(self, plan: TransferPlan) -> None:
        self._plane_tables.upload(plan)
        warm_up(self, plan)

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        with self._lock:
            return self._launch_locked(batch, after_kernel)

    def last_phases_ms(self) -> dict[str, float]:
        """Where the last transfer's device window went, from its events (valid until the next transfer): start to
        kernel (table upload, zeroing, a load's copies), the kernel, kernel end to the end of the window."""
        state = self._native
        if state is None:
            return {}
        phases = {"to_kernel": state.elapsed_ms(EVENT_FIRST, EVENT_KERNEL_BEGIN),
                  "kernel": state.elapsed_ms(EVENT_KERNEL_BEGIN, EVENT_KERNEL_END),
                  "after_kernel": state.elapsed_ms(EVENT_KERNEL_END, EVENT_LAST)}
        if self._last_pipelined:
            phases["copies_done"] = state.elapsed_ms(EVENT_FIRST, EVENT_COPIES_DONE)
        return phases

    def _state(self, device: torch.device) -> _Native:
        if self._native is None or self._native.device != device:
            if self._native is not None:
                self._native.close()
            self._native = _Native(self._cuda, device)
        return self._native

    def _launch_locked(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        plan = batch.plan
        device = plan.device
        if device.type != "cuda":
            raise ValueError(f"the cuda backend moves CUDA pages; the plan's planes are on {device}")
        path = self.path_for(batch)
        for i, obj in enumerate(batch.objects):
            if path == "mapped" and not (obj.device.type == "cpu" and self._host_mapped(obj)):
                raise ValueError(f"chunk {i}: the mapped path needs pinned host objects (pin_memory=True or "
                                 f"cudaHostRegister, e.g. the store's host arena)")
            if path == "staging" and obj.device.type != "cpu":
                raise ValueError(f"chunk {i}: the staging path moves host objects; this one is on {obj.device}")
        staging_path = path == "staging"
        pipelined = self.pipelined(batch)
        object_bytes = plan.object_bytes
        total = batch.num_chunks * object_bytes
        bounds = slice_bounds(total, batch.direction, pipelined, self.store_first_slice_bytes,
                              self.store_slice_growth, self.load_tail_bytes, self.load_tail_share)
        prefix = None
        share = self.mapped_prefix_share[batch.direction]
        if (staging_path and not pipelined and share > 0 and (batch.direction == Direction.LOAD or plan.gap_free)
                and all(self._host_mapped(o) for o in batch.objects)):
            prefix = prefix_order(batch, self.piece_bytes, share)
        order = prefix or work_order(batch, pipelined, self.piece_bytes, bounds)
        pipelined = pipelined and order.slice_items.size > 1  # one slice: nothing to overlap
        slices = order.slice_items.size
        state = self._state(device)
        stream = torch.cuda.current_stream(device)
        zero = None
        copies = np.zeros((0, 4), dtype=np.uint64)
        if staging_path:
            staging = self._staging.reserve(plan, total, batch.direction)
            if staging.data_ptr() != self._staging_address:  # new memory: its zeroing done before any stream uses it
                stream.synchronize()
                self._staging_address = staging.data_ptr()
            zero = self._staging.take_pending()
            addresses = staging.data_ptr() + np.arange(batch.num_chunks, dtype=np.uint64) * np.uint64(object_bytes)
            copies = copy_table(staging.data_ptr(), batch.objects, order, object_bytes, pipelined,
                                from_slice=0 if prefix is None else 1)
        else:
            addresses = batch.object_addresses()
        parts = [order.group_table, order.runs, addresses, order.items, order.slice_items,
                 np.zeros(slices, dtype=np.uint32),  # per-slice counters
                 np.zeros(self._cuda.STATUS_BYTES, dtype=np.uint8),  # the kernel's status starts at zero
                 batch.object_addresses() if prefix is not None else np.zeros(0, dtype=np.uint64)]
        offsets, table_bytes = packed_offsets(parts)
        host_tables, device_tables = state.tables(table_bytes)
        pack_into(host_tables.numpy(), parts, offsets)
        host, base = host_tables.data_ptr(), device_tables.data_ptr()
        if pipelined:
            blocks = self.blocks or self.pipelined_blocks or (
                self.multiprocessors if batch.direction == Direction.STORE else 4 * self.multiprocessors)
        else:
            blocks = self.blocks or (self.multiprocessors if path == "mapped" else 4 * self.multiprocessors)
        record = state.record
        for name, value in (
                ("stream", stream.cuda_stream), ("planes", self._plane_tables.get(plan).data_ptr()),
                ("groups", base + offsets[0]), ("runs", base + offsets[1]), ("objects", base + offsets[2]),
                ("host_objects", 0 if prefix is None else base + offsets[7]),
                ("items", base + offsets[3]), ("slice_items", base + offsets[4]),
                ("slice_counters", base + offsets[5]), ("slice_flags", state.flags.data_ptr()),
                ("status", base + offsets[6]), ("num_items", len(order.items)), ("num_planes", len(plan.plane_table)),
                ("num_groups", len(order.group_table)), ("num_runs", order.runs.size),
                ("num_chunks", batch.num_chunks), ("kernel_direction", int(batch.direction)), ("blocks", blocks),
                ("threads", self.threads), ("num_slices", slices), ("epoch", state.next_epoch()),
                ("pipeline", MAPPED_PREFIX if prefix is not None
                 else RELEASE_SLICES if pipelined and batch.direction == Direction.STORE
                 else ACQUIRE_SLICES if pipelined else NO_PIPELINE),
                ("copy_stream", state.copy_stream.cuda_stream if pipelined else 0), ("table_host", host),
                ("table_device", base), ("table_bytes", table_bytes),
                ("zero_address", 0 if zero is None else staging.data_ptr() + zero[0]),
                ("zero_bytes", 0 if zero is None else zero[1] - zero[0]),
                ("copies", copies.ctypes.data), ("num_copies", len(copies)), ("direction", int(batch.direction)),
                ("status_host", host + offsets[6])):
            record[name] = value
        pages_free = None
        if after_kernel is not None:
            pages_free = torch.cuda.Event()
            pages_free.record(stream)  # creates the event; the native call records it again right after the kernel
        record["events"][0, EVENT_PAGES_FREE] = 0 if pages_free is None else pages_free.cuda_event
        address = state.record.ctypes.data
        try:
            # One GIL-free call: no host step (nor a wait for the GIL) between the kernel and a store's copies.
            self._cuda.transfer(address)
            if after_kernel is not None:
                after_kernel(pages_free)  # completes once the kernel is done with the pages
            # The host waits on events, never on a synchronous copy: that would hold the driver while a stream is
            # held and block other threads' CUDA calls.
            self._cuda.event_synchronize(state.events[EVENT_RETURNED])
            if pipelined:
                self._cuda.event_synchronize(state.events[EVENT_COPIES_DONE])
        except BaseException:
            stream.synchronize()  # nothing enqueued may still read the reused buffers when the next transfer starts
            state.copy_stream.synchronize()
            raise
        window_ms = state.elapsed_ms(EVENT_FIRST, EVENT_LAST)
        if pipelined:
            window_ms = max(window_ms, state.elapsed_ms(EVENT_FIRST, EVENT_COPIES_DONE))
        self.last_kernel_ms = state.elapsed_ms(EVENT_KERNEL_BEGIN, EVENT_KERNEL_END)
        self._last_pipelined = pipelined
        self.last_mapped_prefix = prefix is not None
        status = host_tables.numpy()[offsets[6]: offsets[6] + 24].view(np.uint64)
        return KernelReport(bytes_moved=int(status[2]), launches=1, items_done=int(status[0]),
                            items_rejected=int(status[1]), items_launched=len(order.items),
                            device_seconds=window_ms / 1e3)
