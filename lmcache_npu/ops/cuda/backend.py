"""The CUDA kernel (lmcache_npu._cuda): the same contract on NVIDIA GPUs.

Two ways to reach host chunk objects (CudaPath):
* ``mapped``: the kernel reads/writes pinned host memory directly through UVA (zero-copy);
* ``staging``: the kernel gathers into (scatters from) a device buffer and the copy engine moves the
  contiguous bytes with cudaMemcpyAsync.
``path="auto"`` picks per direction from ``AUTO_PATH`` (measured, see docs/performance.md). Staging transfers from
``AUTO_PIPELINE_MIN_BYTES`` on pipeline the kernel with the copy engine (slice flags); below it the kernel moves a
prefix of the bytes straight to (a store) or from (a load) the pinned host objects while it gathers or scatters the
rest through staging, so PCIe is busy during the kernel too.
Either way a transfer is exactly one kernel launch, and one native call enqueues everything around it (table
upload, staging zeroing, copies, events) so the GPU never waits for Python between them. A sliced load (issue 41) is
one native call too, a kernel per slice, its copies back to back on the copy stream; `copy_ahead` enqueues slice 0's
copies before the load is even planned.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..batch import ChunkBatch, as_chunk_objects
from ..device_staging import PlaneTables, StagingBuffer, pack_into, packed_offsets, plane_segments
from ..plan import Direction, TransferPlan
from ..transfer_backend import (AfterKernel, BackendUnavailable, KernelReport, PendingTransfer, TransferBackend,
                                TransferStats, warm_up)
from . import work_order as planner
from .work_order import PackedPart
from .native import (NativeResources, Pipeline, SliceEvent, TransferEvent, load_cuda_module,
                     stream_memops_supported)
from .tuning import AUTO_PATH, AUTO_PIPELINE_MIN_BYTES, CudaPath, CudaTuning

logger = logging.getLogger(__name__)

_STATUS_WORDS = 3  # items done, items rejected, bytes moved: the LmcacheCudaStatus counters the host reads
PREPARED_SPARES = 8  # launched loads' records made before serving (more are made when a load has more slices)


class CudaBackend(TransferBackend):
    """`options`: the CudaTuning knobs by name; `tuning` may be replaced between transfers."""

    name = "cuda"

    def __init__(self, **options: object) -> None:
        self.tuning = CudaTuning.from_options(options)
        if not torch.cuda.is_available():
            raise BackendUnavailable("the cuda backend needs a visible CUDA device")
        self._cuda: Any = load_cuda_module()
        self.multiprocessors = self._cuda.multiprocessors(torch.cuda.current_device())
        self._plane_tables = PlaneTables()
        self._staging = StagingBuffer()
        self._staging_address = 0
        self._staging_claims = 0  # every use of the staging buffer counts: a copy ahead is stale once another came
        # slice 0's (offset, length) pairs for copy_ahead, for the last (plan, plane_slice) seen (held weakly)
        self._ahead_segments: Optional[tuple[Any, Any, list[int]]] = None
        self._native: Optional[NativeResources] = None
        self._lock = threading.Lock()  # one transfer at a time: the record and buffers are reused
        self._memops = stream_memops_supported(self._cuda)
        if not self._memops:
            logger.warning("cuStreamWaitValue32 is unavailable: the staging path runs kernel and copy back to back")
        self.last_kernel_ms: Optional[float] = None
        self.last_mapped_prefix = False  # whether the last transfer's kernel moved a prefix straight to/from the host
        self._last_pipelined = False
        self._last_state: Optional[NativeResources] = None  # the last completed transfer's events
        self._spares: list[NativeResources] = []  # for launched loads: one each until finished

    @classmethod
    def option_names(cls) -> list[str]:
        return CudaTuning.option_names()

    def __del__(self) -> None:
        for native in [getattr(self, "_native", None), *getattr(self, "_spares", [])]:
            if native is None:
                continue
            try:
                native.close()
            except Exception:  # the CUDA context may already be gone at interpreter exit
                logger.debug("cuda events not destroyed", exc_info=True)

    def path_for(self, batch: ChunkBatch) -> CudaPath:
        return self._path(batch.objects, batch.direction)

    def _path(self, objects: Sequence[torch.Tensor], direction: Direction) -> CudaPath:
        if all(o.is_cuda for o in objects):
            return CudaPath.DEVICE
        return AUTO_PATH[direction] if self.tuning.path == CudaPath.AUTO else self.tuning.path

    def pipelined(self, batch: ChunkBatch) -> bool:
        """Whether a staging transfer of `batch` overlaps its kernel with the copy engine."""
        if not self._memops or self.path_for(batch) != CudaPath.STAGING:
            return False
        if self.tuning.pipeline is not None:
            return self.tuning.pipeline
        return batch.payload_bytes >= AUTO_PIPELINE_MIN_BYTES[batch.direction]

    def _host_mapped(self, obj: torch.Tensor) -> bool:
        """Page-locked and addressable by kernels: torch's pinned memory, or a cudaHostRegister'ed arena (torch's
        is_pinned() does not see registrations it did not make)."""
        return obj.is_pinned() or bool(self._cuda.host_mapped(obj.data_ptr(), obj.numel() * obj.element_size()))

    def prepare(self, plan: TransferPlan) -> None:
        self._plane_tables.upload(plan)
        warm_up(self, plan)
        while len(self._spares) < PREPARED_SPARES:  # a sliced load's first launches make none on the lane's stream
            self._spares.append(self._new_state(plan.device))

    def last_phases_ms(self) -> dict[str, float]:
        """Where the last transfer's device window went, from its events (valid until the next transfer): start to
        kernel (table upload, zeroing, a load's copies), the kernel, kernel end to the end of the window."""
        state = self._last_state
        if state is None:
            return {}
        phases = {"to_kernel": state.elapsed_ms(TransferEvent.FIRST, TransferEvent.KERNEL_BEGIN),
                  "kernel": state.elapsed_ms(TransferEvent.KERNEL_BEGIN, TransferEvent.KERNEL_END),
                  "after_kernel": state.elapsed_ms(TransferEvent.KERNEL_END, TransferEvent.LAST)}
        if self._last_pipelined:
            phases["copies_done"] = state.elapsed_ms(TransferEvent.FIRST, TransferEvent.COPIES_DONE)
        return phases

    def _state(self, device: torch.device) -> NativeResources:
        if self._native is None or self._native.device != device:
            if self._native is not None:
                self._native.close()
            self._native = NativeResources(self._cuda, device)
        return self._native

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        with self._lock:
            return self._launch_locked(batch, after_kernel)

    def _check_objects(self, batch: ChunkBatch, path: CudaPath) -> None:
        if batch.plan.device.type != "cuda":
            raise ValueError(f"the cuda backend moves CUDA pages; the plan's planes are on {batch.plan.device}")
        for i, obj in enumerate(batch.objects):
            if path == CudaPath.MAPPED and not (obj.is_cpu and self._host_mapped(obj)):
                raise ValueError(f"chunk {i}: the mapped path needs pinned host objects (pin_memory=True or "
                                 f"cudaHostRegister, e.g. the store's host arena)")
            if path == CudaPath.STAGING and not obj.is_cpu:
                raise ValueError(f"chunk {i}: the staging path moves host objects; this one is on {obj.device}")

    def _mapped_prefix_order(self, batch: ChunkBatch, path: CudaPath,
                             pipelined: bool) -> Optional[planner.WorkOrder]:
        """An unpipelined staging transfer's order with a mapped prefix, where the objects and the plan allow one
        (a store's kernel writes items, never the gaps between them: gap-free plans only)."""
        share = self.tuning.mapped_prefix_share(batch.direction)
        # a partial plan (one slice's planes) rarely has items in a byte prefix of its staging: not planned twice
        if (path != CudaPath.STAGING or pipelined or share <= 0 or batch.plan.partial
                or (batch.direction == Direction.STORE and not batch.plan.gap_free)
                or not all(self._host_mapped(o) for o in batch.objects)):
            return None
        return planner.prefix_order(batch, self.tuning.piece_bytes, share)

    def _blocks(self, batch: ChunkBatch, path: CudaPath, pipelined: bool) -> int:
        tuning = self.tuning
        if pipelined:
            return tuning.blocks or tuning.pipelined_blocks or (
                self.multiprocessors if batch.direction == Direction.STORE else 4 * self.multiprocessors)
        return tuning.blocks or (self.multiprocessors if path == CudaPath.MAPPED else 4 * self.multiprocessors)

    @staticmethod
    def _pipeline_mode(batch: ChunkBatch, mapped_prefix: bool, pipelined: bool) -> Pipeline:
        if mapped_prefix:
            return Pipeline.MAPPED_PREFIX
        if not pipelined:
            return Pipeline.NO_PIPELINE
        return Pipeline.RELEASE_SLICES if batch.direction == Direction.STORE else Pipeline.ACQUIRE_SLICES

    def launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> PendingTransfer:
        """A load returns once enqueued (on its own record, tables and events, so the next launch reuses none of
        them before it is finished); a store runs to its end (its copies out would race the next kernel's gather)."""
        if batch.direction != Direction.LOAD:
            return super().launch(batch, after_kernel)
        return self._launch_load(batch, after_kernel, None)

    def launch_sliced(self, batch: ChunkBatch, plane_slice: np.ndarray, num_slices: int,
                      after_kernel: Optional[AfterKernel] = None,
                      ahead: Optional["CopiedAhead"] = None) -> SlicedLaunch:
        """A sliced load (issue 41) in one native call: slice k moves the planes `plane_slice` (per moved plane of
        the batch's plan) puts in k; per slice its kernel, then its event, in order on the current stream, each
        kernel after its own copies, which run back to back on the record's copy stream, so the host makes no step
        between slices. `ahead` (from `copy_ahead`): slice 0's copies are already on the stream, skipped here where
        they still hold this batch's bytes (else copied again). Raises before anything is enqueued on bad input."""
        if batch.direction != Direction.LOAD:
            raise ValueError("launch_sliced moves loads only: a store has no layer to wait for")
        slices = _SliceLaunch(self._cuda, plane_slice, num_slices)
        pending = self._launch_load(batch, after_kernel, slices, ahead)
        return SlicedLaunch(pending, tuple(slices.events))

    def copy_ahead(self, plan: TransferPlan, plane_slice: np.ndarray,
                   objects: Sequence[torch.Tensor]) -> Optional["CopiedAhead"]:
        """A sliced load's slice-0 staging copies enqueued now, on the current stream, on the record the load will
        continue on, so the copy engine starts before the load's runs are cut and its work order planned (about
        0.5 ms of host time on the H200 host). `launch_sliced(ahead=...)` with the same plan, plane_slice and
        objects, on the same stream and with no other use of staging in between, skips them. None where nothing is
        copied ahead (off the staging path, no plane in slice 0, objects the load would refuse). The caller
        `release`s the result once the launch is done (or never happened)."""
        if (plan.device.type != "cuda" or not objects or len(plane_slice) != len(plan.moved_planes)
                or not all(o.is_cpu for o in objects) or self._path(objects, Direction.LOAD) != CudaPath.STAGING):
            return None
        try:  # every copy reads within its object: objects the load would refuse are not copied ahead
            as_chunk_objects(plan, objects)
        except ValueError:
            return None
        segments = self._first_segments(plan, plane_slice)
        if not segments:
            return None
        stream = torch.cuda.current_stream(plan.device)
        addresses = [o.data_ptr() for o in objects]
        with self._lock:
            staging = self._claim_staging(plan, len(objects) * plan.object_bytes, Direction.LOAD, CudaPath.STAGING,
                                          stream)[0]
            state = self._spare_state(plan.device)
            try:  # the load's window starts before its first copy; COPIES_DONE marks their end
                self._cuda.copy_ahead(stream.cuda_stream, state.events[TransferEvent.FIRST],
                                      state.events[TransferEvent.COPIES_DONE], staging, plan.object_bytes, addresses,
                                      segments)
            except BaseException:  # copies it queued before failing may read the objects: none may still run
                stream.synchronize()
                self._spares.append(state)
                raise
            return CopiedAhead(self, state, plan, plane_slice, addresses, stream.cuda_stream, self._staging_claims)

    def _first_segments(self, plan: TransferPlan, plane_slice: np.ndarray) -> list[int]:
        """Slice 0's planes as flat (offset, length) pairs in an object, kept for the last (plan, plane_slice)."""
        cached = self._ahead_segments
        if cached is not None and cached[0]() is plan and cached[1]() is plane_slice:
            return cached[2]
        first = {i for i, k in enumerate(plane_slice.tolist()) if k == 0}
        flat = [value for segment in plane_segments(plan, first) for value in segment]
        self._ahead_segments = (weakref.ref(plan), weakref.ref(plane_slice), flat)
        return flat

    def _release_ahead(self, ahead: "CopiedAhead") -> None:
        with self._lock:
            state = ahead.take()
        if state is not None:  # no launch took it: its copies may still read objects the job is about to drop
            self._settled(state)
            with self._lock:
                self._spares.append(state)

    def _settled(self, state: NativeResources) -> NativeResources:
        """`state` once the copies a copy ahead enqueued on it read no host memory any more (at once where none
        were made: an event never recorded is complete)."""
        self._cuda.event_synchronize(state.events[TransferEvent.COPIES_DONE])
        return state

    def _ahead_fits(self, ahead: "CopiedAhead", batch: ChunkBatch, plane_slice: np.ndarray) -> bool:
        """Whether staging still holds what `ahead` copied (on this launch's stream) for this batch's slice 0
        (called before its claim)."""
        return (ahead.claims == self._staging_claims and ahead.plan is batch.plan and ahead.plane_slice is plane_slice
                and ahead.addresses == batch.object_addresses().tolist())

    def _launch_load(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel],
                     sliced: Optional["_SliceLaunch"], ahead: Optional["CopiedAhead"] = None) -> PendingTransfer:
        """A load enqueued on a spare record, or the record a copy ahead began (given back once it is finished)."""
        start = time.perf_counter()
        with self._lock:
            begun = None if ahead is None else ahead.take()
            stream = torch.cuda.current_stream(batch.plan.device)
            # begun for another launch, device or stream: its copies are not ordered before this launch's
            if begun is not None and (sliced is None or begun.device != batch.plan.device
                                      or ahead.stream != stream.cuda_stream):  # type: ignore[union-attr]
                self._spares.append(self._settled(begun))
                begun = None
            state = begun if begun is not None else self._spare_state(batch.plan.device)
            try:
                if begun is not None:
                    sliced.copied_ahead = self._ahead_fits(ahead, batch, sliced.plane_slice)  # type: ignore
                enqueued = self._enqueue(batch, after_kernel, state, sliced)
            except BaseException:  # nothing enqueued reads the record's buffers or (copied ahead) host memory
                self._spares.append(self._settled(state) if state is begun else state)
                raise
        seconds = time.perf_counter() - start

        def finish() -> TransferStats:
            try:
                report = self._complete(enqueued)
            finally:
                with self._lock:
                    self._spares.append(state)
            return self._stats(batch, report, seconds)

        return PendingTransfer(finish, asynchronous=True)

    def _spare_state(self, device: torch.device) -> NativeResources:
        """A record, tables and events no launched transfer still uses (made on first need: a cold cost)."""
        for i, state in enumerate(self._spares):
            if state.device == device:
                return self._spares.pop(i)
        return self._new_state(device)

    def _new_state(self, device: torch.device) -> NativeResources:
        state = NativeResources(self._cuda, device)
        state.next_epoch()  # the first epoch zeroes the flags and synchronizes: done here, once
        return state

    def _launch_locked(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        return self._complete(self._enqueue(batch, after_kernel, self._state(batch.plan.device)))

    def _order(self, batch: ChunkBatch, path: CudaPath, pipelined: bool) -> tuple[planner.WorkOrder, bool]:
        """The kernel's work order, and whether it has a mapped prefix."""
        tuning = self.tuning
        prefix = self._mapped_prefix_order(batch, path, pipelined)
        if prefix is not None:
            return prefix, True
        bounds = planner.slice_bounds(batch.num_chunks * batch.plan.object_bytes, batch.direction, pipelined,
                                      tuning.store_first_slice_bytes, tuning.store_slice_growth,
                                      tuning.load_tail_bytes, tuning.load_tail_share)
        return planner.work_order(batch, pipelined, tuning.piece_bytes, bounds), False

    def _claim_staging(self, plan: TransferPlan, nbytes: int, direction: Direction, path: CudaPath,
                       stream: torch.cuda.Stream) -> tuple[int, Any]:
        """The staging buffer's address for `nbytes` of `plan`'s objects (0 off the staging path) and the range to
        zero before use."""
        if path != CudaPath.STAGING:
            return 0, None
        self._staging_claims += 1
        address = self._staging.claim(plan, nbytes, direction)
        if address != self._staging_address:  # new memory: its zeroing done before any stream uses it
            stream.synchronize()
            self._staging_address = address
        return address, self._staging.take_pending()

    def _whole_tables(self, batch: ChunkBatch, order: planner.WorkOrder, state: NativeResources, staging: int,
                      copied: bool, mapped_prefix: bool) -> planner.PackedTables:
        """A whole transfer's tables packed into `state`'s host buffer; `copied`: its copies are per slice."""
        copies = np.zeros((0, 4), dtype=np.uint64)
        if staging:
            addresses = staging + np.arange(batch.num_chunks, dtype=np.uint64) * np.uint64(batch.plan.object_bytes)
            copies = planner.copy_table(staging, batch, order, copied, from_slice=1 if mapped_prefix else 0)
        else:
            addresses = batch.object_addresses()
        slices = order.slice_items.size
        parts = [order.group_table, order.runs, addresses, order.items, order.slice_items,
                 np.zeros(slices, dtype=np.uint32),  # per-slice counters
                 np.zeros(self._cuda.STATUS_BYTES, dtype=np.uint8),  # the kernel's status starts at zero
                 batch.object_addresses() if mapped_prefix else np.zeros(0, dtype=np.uint64)]
        offsets, table_bytes = packed_offsets(parts)
        pack_into(state.host_buffer(table_bytes), parts, offsets)
        return planner.PackedTables(offsets, table_bytes, len(order.items), order.runs.size, len(order.group_table),
                                    order.slice_items, copies)

    def _enqueue(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel], state: NativeResources,
                 sliced: Optional["_SliceLaunch"] = None) -> "_Enqueued":
        """Everything of one transfer on the current stream, in one native call, using `state`'s buffers; `sliced`:
        a sliced load's slices, each its own copies, kernel and event (`launch_sliced`), planned and packed by one
        native call."""
        plan, tuning = batch.plan, self.tuning
        path = self.path_for(batch)
        self._check_objects(batch, path)
        stream = torch.cuda.current_stream(plan.device)
        staging, zero = self._claim_staging(plan, batch.num_chunks * plan.object_bytes, batch.direction, path, stream)
        if sliced is None:
            pipelined = self.pipelined(batch)
            order, mapped_prefix = self._order(batch, path, pipelined)
            pipelined = pipelined and order.slice_items.size > 1  # one slice: nothing to overlap
            tables = self._whole_tables(batch, order, state, staging, pipelined, mapped_prefix)
        else:  # each slice's kernel runs once its copies are in: no flags inside a launch
            mapped_prefix = pipelined = False
            tables = sliced.pack(batch, staging, self._cuda.STATUS_BYTES, tuning.piece_bytes, state)
        offsets, table_bytes, copies = tables.offsets, tables.table_bytes, tables.copies
        host, base = state.host_tables.data_ptr(), state.device_tables.data_ptr()
        part = PackedPart
        state.set_fields({
            "stream": stream.cuda_stream, "planes": self._plane_tables.get(plan).data_ptr(),
            "groups": base + offsets[part.GROUPS], "runs": base + offsets[part.RUNS],
            "objects": base + offsets[part.OBJECTS],
            "host_objects": base + offsets[part.HOST_OBJECTS] if mapped_prefix else 0,
            "items": base + offsets[part.ITEMS], "slice_items": base + offsets[part.SLICE_ITEMS],
            "slice_counters": base + offsets[part.COUNTERS], "slice_flags": state.flags.data_ptr(),
            "status": base + offsets[part.STATUS], "num_items": tables.num_items, "num_planes": len(plan.plane_table),
            "num_groups": tables.num_groups, "num_runs": tables.num_runs,
            "num_chunks": batch.num_chunks, "kernel_direction": int(batch.direction),
            "blocks": self._blocks(batch, path, pipelined), "threads": tuning.threads,
            "num_slices": tables.slice_items.size, "epoch": state.next_epoch(),
            "pipeline": self._pipeline_mode(batch, mapped_prefix, pipelined),
            "copy_stream": self._copy_stream(state, pipelined, sliced is not None), "table_host": host,
            "table_device": base, "table_bytes": table_bytes,
            "zero_address": 0 if zero is None else staging + zero[0],
            "zero_bytes": 0 if zero is None else zero[1] - zero[0],
            "copies": copies.ctypes.data, "num_copies": len(copies), "direction": int(batch.direction),
            "status_host": host + offsets[part.STATUS],
        })
        record = state.record
        pages_free = None
        if after_kernel is not None:
            pages_free = torch.cuda.Event()
            pages_free.record(stream)  # creates the event; the native call records it again right after the kernel
        record["events"][0, TransferEvent.PAGES_FREE] = 0 if pages_free is None else pages_free.cuda_event
        try:
            # One GIL-free call: no host step (nor a wait for the GIL) between the kernel and a store's copies.
            if sliced is None:
                self._cuda.transfer(record.ctypes.data)
            else:
                try:
                    self._cuda.sliced_load(record.ctypes.data, sliced.native())
                finally:
                    sliced.take_events()
            if after_kernel is not None:
                after_kernel(pages_free)  # completes once the kernel is done with the pages
        except BaseException:
            self._drain(stream, state)
            raise
        return _Enqueued(state, stream, pipelined, mapped_prefix, offsets[part.STATUS], tables.num_items,
                         sliced is not None and sliced.copied_ahead)

    @staticmethod
    def _copy_stream(state: NativeResources, pipelined: bool, sliced: bool) -> int:
        """The stream a transfer's copies run on beside its kernel (0: the kernel's own): a pipelined transfer's,
        and a sliced load's (its copies back to back, each slice's kernel after its own copies)."""
        return state.copy_stream.cuda_stream if pipelined or sliced else 0

    @staticmethod
    def _drain(stream: torch.cuda.Stream, state: NativeResources) -> None:
        stream.synchronize()  # nothing enqueued may still read the reused buffers when the next transfer starts
        state.copy_stream.synchronize()

    def _complete(self, enqueued: "_Enqueued") -> KernelReport:
        """Waits for an enqueued transfer's end and reads what its kernel reported."""
        state, pipelined = enqueued.state, enqueued.pipelined
        try:
            # The host waits on events, never on a synchronous copy: that would hold the driver while a stream is
            # held and block other threads' CUDA calls.
            self._cuda.event_synchronize(state.events[TransferEvent.RETURNED])
            if pipelined:
                self._cuda.event_synchronize(state.events[TransferEvent.COPIES_DONE])
        except BaseException:
            self._drain(enqueued.stream, state)
            raise
        window_ms = state.elapsed_ms(TransferEvent.FIRST, TransferEvent.LAST)
        if enqueued.copied_ahead:  # the move alone: not the wait between the copies ahead and the load's turn
            window_ms -= max(0.0, state.elapsed_ms(TransferEvent.COPIES_DONE, TransferEvent.KERNEL_BEGIN))
        if pipelined:
            window_ms = max(window_ms, state.elapsed_ms(TransferEvent.FIRST, TransferEvent.COPIES_DONE))
        self.last_kernel_ms = state.elapsed_ms(TransferEvent.KERNEL_BEGIN, TransferEvent.KERNEL_END)
        self._last_pipelined = pipelined
        self._last_state = state
        self.last_mapped_prefix = enqueued.mapped_prefix
        offset = enqueued.status_offset
        status = state.host_tables.numpy()[offset: offset + 8 * _STATUS_WORDS].view(np.uint64)
        return KernelReport(bytes_moved=int(status[2]), launches=1, items_done=int(status[0]),
                            items_rejected=int(status[1]), items_launched=enqueued.items,
                            device_seconds=window_ms / 1e3)


@dataclass(frozen=True)
class SlicedLaunch:
    """A launched sliced load: `pending` finishes it (every slice), `events[k]` completes once slice k is in the
    pages (slices complete in order)."""

    pending: PendingTransfer
    events: tuple[SliceEvent, ...]


class _SliceLaunch:
    """A sliced load's slices and the native slices record: per slice its item count, and its landing event, which
    the native call makes (fresh per load: the model's stream waits on it)."""

    def __init__(self, cuda: Any, plane_slice: np.ndarray, num_slices: int) -> None:
        self.events: list[SliceEvent] = []
        self.plane_slice = plane_slice
        self.copied_ahead = False  # slice 0's copies are on the stream already (CudaBackend.copy_ahead)
        self._cuda = cuda
        self._num_slices = num_slices
        self._record = np.zeros(4, dtype=np.uint64)
        self._slice_items = np.zeros(0, dtype=np.uint32)
        self._handles = np.zeros(0, dtype=np.uint64)

    def pack(self, batch: ChunkBatch, staging: int, status_bytes: int, piece_bytes: int,
             state: NativeResources) -> planner.PackedTables:
        """The load's work order planned and packed into `state`'s host buffer in one native call."""
        tables = planner.sliced_load_tables(batch, self.plane_slice, self._num_slices, piece_bytes, staging,
                                            status_bytes, state.host_buffer)
        self._slice_items = tables.slice_items
        self._handles = np.zeros(self._slice_items.size, dtype=np.uint64)
        return tables

    def native(self) -> int:
        """The LmcacheCudaSlices record's address (its arrays live as long as this object)."""
        self._record[:] = (self._slice_items.size, self._slice_items.ctypes.data, self._handles.ctypes.data,
                           int(self.copied_ahead))
        return int(self._record.ctypes.data)

    def take_events(self) -> None:
        """Owns the events the native call made (all of them, also after it failed: each is destroyed with its
        last reference)."""
        self.events = [SliceEvent(self._cuda, int(handle)) for handle in self._handles.tolist() if handle]


class CopiedAhead:
    """Slice 0's copies of a sliced load, enqueued by `CudaBackend.copy_ahead` on the record the load continues on:
    what the launch checks before it skips them, and that record until a launch takes it (`release` gives it back
    where none did)."""

    def __init__(self, backend: CudaBackend, state: NativeResources, plan: TransferPlan, plane_slice: np.ndarray,
                 addresses: list[int], stream: int, claims: int) -> None:
        self.plan = plan
        self.plane_slice = plane_slice
        self.addresses = addresses
        self.stream = stream
        self.claims = claims  # the backend's staging claims right after this one's
        self._backend = backend
        self._state: Optional[NativeResources] = state

    def take(self) -> Optional[NativeResources]:
        """The record, once (the backend's lock held)."""
        state, self._state = self._state, None
        return state

    def release(self) -> None:
        """Gives the record back unless a launch took it (idempotent)."""
        self._backend._release_ahead(self)


@dataclass(frozen=True)
class _Enqueued:
    """An enqueued transfer: the buffers and events it uses until it is completed."""

    state: NativeResources
    stream: torch.cuda.Stream
    pipelined: bool
    mapped_prefix: bool
    status_offset: int
    items: int
    copied_ahead: bool  # slice 0's copies ran ahead of the load's turn on the stream (its window subtracts the gap)
