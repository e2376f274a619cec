"""The CUDA kernel (lmcache_npu._cuda): the same contract on NVIDIA GPUs.

Two ways to reach host chunk objects:
* ``mapped``: the kernel reads/writes pinned host memory directly through UVA (zero-copy);
* ``staging``: the kernel gathers into (scatters from) a device buffer and the copy engine moves the
  contiguous bytes with cudaMemcpyAsync.
``path="auto"`` picks per direction from ``AUTO_PATH`` (measured, see docs/performance.md).
Either way a transfer is exactly one kernel launch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from .backend import (
    BackendUnavailable,
    PlaneTables,
    StagingBuffer,
    TransferBackend,
    TransferStats,
    copy_stretches,
    host_stretches,
    pack_pinned,
    verify_kernel_report,
    warm_up,
)
from .batch import ChunkBatch
from .plan import Direction, TransferPlan

logger = logging.getLogger(__name__)

PATHS = ("auto", "mapped", "staging")
# Chosen from the H200 measurements in docs/performance.md: staging (pipelined) is as fast as mapped or
# faster in both directions and leaves the SMs to the model while the copy engine crosses PCIe.
AUTO_PATH = {Direction.STORE: "staging", Direction.LOAD: "staging"}
# Pipelining pays once a store moves about 4 llama-8B chunks (128 MiB); below that the per-slice costs
# dominate. A pipelined load keeps its blocks resident while they wait for slices: 1-2% faster, but it
# cost the matmul loop 7-15%, so loads pipeline only on request. See docs/performance.md.
AUTO_PIPELINE_MIN_BYTES = {Direction.STORE: 128 << 20, Direction.LOAD: None}
FIRST_SLICE_BYTES = 2 << 20  # the copy engine starts after this much is gathered...
MAX_SLICE_BYTES = 64 << 20  # ...and slices double up to this, so fixed per-copy costs stay small
MAX_SLICES = 256
PIPELINED_BLOCKS = 32  # enough to outrun PCIe many times over while leaving most SMs to the model

NO_PIPELINE, RELEASE_SLICES, ACQUIRE_SLICES = 0, 1, 2


@dataclass(frozen=True)
class WorkOrder:
    """Work items in staging-byte order, cut into byte-balanced slices for the copy engine."""

    items: np.ndarray  # (n, 4) uint32: run, plane, slice, 0
    slice_items: np.ndarray  # uint32 per slice
    pieces: list[list[tuple[int, int, int]]]  # per slice: (chunk, offset in object, length)


def slice_bounds(total: int, first: int = FIRST_SLICE_BYTES, largest: int = MAX_SLICE_BYTES) -> np.ndarray:
    """End offsets of geometric slices: first, 2 x first, ... capped at `largest`, at most MAX_SLICES."""
    bounds, position, size = [], 0, first
    while position < total and len(bounds) < MAX_SLICES - 1:
        position += size
        bounds.append(min(position, total))
        size = min(size * 2, largest)
    if not bounds or bounds[-1] < total:
        bounds.append(total)
    return np.array(bounds, dtype=np.int64)


def work_order(batch: ChunkBatch, first_slice_bytes: int = FIRST_SLICE_BYTES) -> WorkOrder:
    plan = batch.plan
    runs = batch.runs
    plane_offsets = np.array(plan.object_offsets, dtype=np.int64)
    plane_rows = np.array([p.row_bytes for p in plan.moved_planes], dtype=np.int64)
    run_ids, plane_ids = [], []
    for group in batch.group_table:
        r = np.arange(group["run_begin"], group["run_begin"] + group["run_count"], dtype=np.int64)
        p = np.arange(group["plane_begin"], group["plane_begin"] + group["plane_count"], dtype=np.int64)
        if r.size and p.size:
            rr, pp = np.meshgrid(r, p, indexing="ij")
            run_ids.append(rr.reshape(-1))
            plane_ids.append(pp.reshape(-1))
    if not run_ids:
        return WorkOrder(np.zeros((0, 4), dtype=np.uint32), np.zeros(0, dtype=np.uint32), [])
    run_id, plane_id = np.concatenate(run_ids), np.concatenate(plane_ids)
    chunk = runs["chunk"][run_id].astype(np.int64)
    offset = plane_offsets[plane_id] + runs["first_row"][run_id].astype(np.int64) * plane_rows[plane_id]
    length = runs["num_rows"][run_id].astype(np.int64) * plane_rows[plane_id]
    start = chunk * plan.object_bytes + offset
    order = np.argsort(start, kind="stable")
    run_id, plane_id, start, length = run_id[order], plane_id[order], start[order], length[order]
    total = batch.num_chunks * plan.object_bytes
    bounds = slice_bounds(total, first_slice_bytes, max(first_slice_bytes, MAX_SLICE_BYTES))
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
    return WorkOrder(items, slice_items, pieces)


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, path: str = "auto", blocks: Optional[int] = None, threads: int = 512,
                 pipeline: Optional[bool] = None) -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("the cuda backend needs a visible CUDA device")
        try:
            from lmcache_npu import _cuda  # type: ignore[attr-defined]
        except ImportError as exc:
            raise BackendUnavailable(f"lmcache_npu._cuda is not built ({exc})") from exc
        self._cuda: Any = _cuda
        self.path = path
        self.threads = threads
        self.multiprocessors = _cuda.multiprocessors(torch.cuda.current_device())
        self.blocks = blocks
        self._plane_tables = PlaneTables()
        self._staging = StagingBuffer()
        self._flags: Optional[torch.Tensor] = None
        self._copy_stream: Optional[torch.cuda.Stream] = None
        self._epoch = 0
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

    def path_for(self, batch: ChunkBatch) -> str:
        if all(o.device.type == "cuda" for o in batch.objects):
            return "device"
        return AUTO_PATH[batch.direction] if self.path == "auto" else self.path

    def _host_mapped(self, obj: torch.Tensor) -> bool:
        """Page-locked and addressable by kernels: torch's pinned memory, or a cudaHostRegister'ed arena (torch's
        is_pinned() does not see registrations it did not make)."""
        return obj.is_pinned() or bool(self._cuda.host_mapped(obj.data_ptr(), obj.numel() * obj.element_size()))

    def prepare(self, plan: TransferPlan) -> None:
        self._plane_tables.upload(plan)
        warm_up(self, plan)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[Callable[[], None]] = None) -> TransferStats:
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
        threshold = AUTO_PIPELINE_MIN_BYTES[batch.direction]
        wanted = (threshold is not None and batch.payload_bytes >= threshold) if self.pipeline is None else self.pipeline
        pipelined = staging_path and self._memops and wanted
        order = work_order(batch)
        slices = order.slice_items.size
        object_bytes = plan.object_bytes
        copies: list[list[tuple[int, int, int]]] = []  # per copy-engine step: stretches contiguous on both sides
        if staging_path:
            staging = self._staging.reserve(plan, batch.num_chunks * object_bytes, batch.direction)
            addresses = staging.data_ptr() + np.arange(batch.num_chunks, dtype=np.uint64) * np.uint64(object_bytes)
            if pipelined:
                copies = [host_stretches(batch.objects, pieces, object_bytes) for pieces in order.pieces]
            else:  # one step: stretches merge across slices, one copy where host objects are adjacent
                copies = [host_stretches(batch.objects, [p for pieces in order.pieces for p in pieces], object_bytes)]
        else:
            addresses = batch.object_addresses()
        # Every host-side step before the first device operation: the GPU never idles waiting for Python between
        # the table upload, the kernel and the copies, and the measured window holds only GPU work.
        host, offsets = pack_pinned([batch.group_table, batch.runs, addresses, order.items, order.slice_items,
                                     np.zeros(slices, dtype=np.uint32),  # per-slice counters
                                     np.zeros(self._cuda.STATUS_BYTES, dtype=np.uint8)])
        tables = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        base = tables.data_ptr()
        stream = torch.cuda.current_stream(device)
        flags = self._slice_flags(device)
        self._epoch = (self._epoch + 1) & 0xFFFFFFFF or 1
        pipeline = NO_PIPELINE if not pipelined else (
            RELEASE_SLICES if batch.direction == Direction.STORE else ACQUIRE_SLICES)
        blocks = self.blocks or (PIPELINED_BLOCKS if pipelined else (
            self.multiprocessors if path == "mapped" else 4 * self.multiprocessors))
        launch = dict(
            stream=stream.cuda_stream, planes=self._plane_tables.get(plan).data_ptr(), groups=base + offsets[0],
            runs=base + offsets[1], objects=base + offsets[2], items=base + offsets[3],
            slice_items=base + offsets[4], slice_counters=base + offsets[5], slice_flags=flags.data_ptr(),
            status=base + offsets[6], num_items=len(order.items), num_planes=len(plan.plane_table),
            num_groups=len(batch.group_table), num_runs=batch.runs.size, num_chunks=batch.num_chunks,
            direction=int(batch.direction), blocks=blocks, threads=self.threads, num_slices=slices,
            epoch=self._epoch, pipeline=pipeline,
        )
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ready = torch.cuda.Event() if pipelined else None
        start = time.perf_counter()
        first.record(stream)
        tables.copy_(host, non_blocking=True)
        if staging_path:
            self._staging.zero_pending()
        if ready is not None:
            ready.record(stream)  # tables on the device; staging free of the previous transfer
        if staging_path and batch.direction == Direction.LOAD:
            self._copy(staging, batch, copies, stream, ready, flags, to_device=True)
        begin.record(stream)
        self._cuda.launch(**launch)
        end.record(stream)
        if after_kernel is not None:
            after_kernel()  # in stream order after the kernel: the pages are free once it completes
        if staging_path and batch.direction == Direction.STORE:
            self._copy(staging, batch, copies, stream, ready, flags, to_device=False)
        # The status comes back into the pinned table buffer and the host waits on an event: a synchronous copy to
        # pageable memory would hold the driver while the stream is held, blocking other threads' CUDA calls.
        last.record(stream)  # the measured window ends with the transfer, before the status read-back
        status_host = host[offsets[6]: offsets[6] + 24]
        status_host.copy_(tables[offsets[6]: offsets[6] + 24], non_blocking=True)
        returned = torch.cuda.Event()
        returned.record(stream)
        returned.synchronize()
        status = status_host.numpy().view(np.uint64)
        seconds = time.perf_counter() - start
        self.last_kernel_ms = begin.elapsed_time(end)
        verify_kernel_report(batch, int(status[0]), int(status[1]), int(status[2]))
        return TransferStats(backend=self.name, direction=batch.direction, chunks=batch.num_chunks,
                             payload_bytes=batch.payload_bytes, launches=1, seconds=seconds,
                             device_seconds=first.elapsed_time(last) / 1e3)

    def _slice_flags(self, device: torch.device) -> torch.Tensor:
        if self._flags is None or self._flags.device != device:
            self._flags = torch.zeros(MAX_SLICES, dtype=torch.int32, device=device)
            self._epoch = 0
        return self._flags

    def _copy(self, staging: torch.Tensor, batch: ChunkBatch, copies: list[list[tuple[int, int, int]]],
              stream: torch.cuda.Stream, ready: Optional[torch.cuda.Event], flags: torch.Tensor,
              to_device: bool) -> None:
        """The copy engine's steps: on the current stream back to back (one step), or pipelined with the kernel.

        Pipelined, a side stream waits only for `ready` (recorded before the launch), never for the kernel itself,
        and meets it through per-slice flags: on a store it copies slice 0 while the kernel still gathers the rest;
        on a load the kernel starts on a slice as soon as its copy raised the flag."""
        object_bytes = batch.plan.object_bytes
        if ready is None:
            for stretches in copies:
                copy_stretches(staging, batch.objects, stretches, object_bytes, to_device)
            return
        if self._copy_stream is None or self._copy_stream.device != stream.device:
            self._copy_stream = torch.cuda.Stream(stream.device)
        side = self._copy_stream
        side.wait_event(ready)
        flag_base = flags.data_ptr()
        with torch.cuda.stream(side):
            for k, stretches in enumerate(copies):
                if not to_device and not self._cuda.stream_wait_value32(side.cuda_stream, flag_base + 4 * k,
                                                                         self._epoch):
                    raise RuntimeError("cuStreamWaitValue32 became unavailable mid-transfer")
                copy_stretches(staging, batch.objects, stretches, object_bytes, to_device)
                if to_device and not self._cuda.stream_write_value32(side.cuda_stream, flag_base + 4 * k,
                                                                     self._epoch):
                    raise RuntimeError("cuStreamWriteValue32 became unavailable mid-transfer")
        if not to_device:
            stream.wait_stream(side)  # the caller's stream sees the host objects complete
