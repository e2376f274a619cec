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
import weakref
from typing import Any, Optional

import numpy as np
import torch

from .backend import BackendUnavailable, TransferBackend, TransferStats
from .batch import ChunkBatch
from .plan import Direction, TransferPlan

logger = logging.getLogger(__name__)

PATHS = ("auto", "mapped", "staging")
# Chosen from the H100/H200 measurements in docs/performance.md.
AUTO_PATH = {Direction.STORE: "mapped", Direction.LOAD: "mapped"}


def chunk_major_items(batch: ChunkBatch) -> np.ndarray:
    """(run, plane) pairs of every work item, ordered by chunk so chunk 0 completes first."""
    parts, keys = [], []
    for group in batch.group_table:
        runs = np.arange(group["run_begin"], group["run_begin"] + group["run_count"], dtype=np.uint32)
        planes = np.arange(group["plane_begin"], group["plane_begin"] + group["plane_count"], dtype=np.uint32)
        if runs.size == 0 or planes.size == 0:
            continue
        run_grid, plane_grid = np.meshgrid(runs, planes, indexing="ij")
        parts.append(np.stack([run_grid.reshape(-1), plane_grid.reshape(-1)], axis=1))
        keys.append(np.repeat(batch.runs["chunk"][runs], planes.size))
    if not parts:
        return np.zeros((0, 2), dtype=np.uint32)
    items, chunk = np.concatenate(parts), np.concatenate(keys)
    return np.ascontiguousarray(items[np.argsort(chunk, kind="stable")])


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, path: str = "auto", blocks: Optional[int] = None, threads: int = 512) -> None:
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
        self._plane_tables: "weakref.WeakKeyDictionary[TransferPlan, torch.Tensor]" = weakref.WeakKeyDictionary()
        self._staging: Optional[torch.Tensor] = None
        self._staging_plan: Optional["weakref.ref[TransferPlan]"] = None
        self.last_kernel_ms: Optional[float] = None

    def path_for(self, batch: ChunkBatch) -> str:
        if all(o.device.type == "cuda" for o in batch.objects):
            return "device"
        return AUTO_PATH[batch.direction] if self.path == "auto" else self.path

    def _plane_table(self, plan: TransferPlan) -> torch.Tensor:
        table = self._plane_tables.get(plan)
        if table is None:
            table = torch.from_numpy(plan.plane_table.view(np.uint8)).to(plan.device)
            self._plane_tables[plan] = table
        return table

    def _staging_buffer(self, plan: TransferPlan, nbytes: int) -> torch.Tensor:
        """Zeroed when allocated and when the plan changes: object gaps copied to the host never carry
        stale device memory."""
        if self._staging is None or self._staging.numel() < nbytes or self._staging.device != plan.device:
            self._staging = torch.zeros(nbytes, dtype=torch.uint8, device=plan.device)
        elif self._staging_plan is None or self._staging_plan() is not plan:
            self._staging.zero_()
        self._staging_plan = weakref.ref(plan)
        return self._staging[:nbytes]

    def transfer(self, batch: ChunkBatch) -> TransferStats:
        plan = batch.plan
        device = plan.device
        if device.type != "cuda":
            raise ValueError(f"the cuda backend moves CUDA pages; the plan's planes are on {device}")
        path = self.path_for(batch)
        for i, obj in enumerate(batch.objects):
            if path == "mapped" and not (obj.device.type == "cpu" and obj.is_pinned()):
                raise ValueError(f"chunk {i}: the mapped path needs pinned host objects (pin_memory=True)")
            if path == "staging" and obj.device.type != "cpu":
                raise ValueError(f"chunk {i}: the staging path moves host objects; this one is on {obj.device}")
        stream = torch.cuda.current_stream(device)
        start = time.perf_counter()
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record(stream)
        staging = None
        if path == "staging":
            staging = self._staging_buffer(plan, batch.num_chunks * plan.object_bytes).view(
                batch.num_chunks, plan.object_bytes)
            addresses = np.array([staging[c].data_ptr() for c in range(batch.num_chunks)], dtype=np.uint64)
            if batch.direction == Direction.LOAD:
                self._copy_objects(batch, staging, to_device=True)
        else:
            addresses = batch.object_addresses()
        items = chunk_major_items(batch)
        parts = [batch.group_table.view(np.uint8), batch.runs.view(np.uint8), addresses.view(np.uint8),
                 items.view(np.uint8).reshape(-1)]
        offsets = np.cumsum([0] + [(p.nbytes + 63) // 64 * 64 for p in parts])
        host = torch.empty(max(int(offsets[-1]), 64) + self._cuda.STATUS_BYTES, dtype=torch.uint8, pin_memory=True)
        for part, off in zip(parts, offsets):
            host[int(off): int(off) + part.nbytes] = torch.from_numpy(np.ascontiguousarray(part))
        tables = host.to(device, non_blocking=True)
        base = tables.data_ptr()
        status_offset = tables.numel() - self._cuda.STATUS_BYTES
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        blocks = self.blocks or (self.multiprocessors if path == "mapped" else 4 * self.multiprocessors)
        self._cuda.launch(
            stream=stream.cuda_stream, planes=self._plane_table(plan).data_ptr(), groups=base + int(offsets[0]),
            runs=base + int(offsets[1]), objects=base + int(offsets[2]), items=base + int(offsets[3]),
            status=base + status_offset, num_items=len(items), num_planes=len(plan.plane_table),
            num_groups=len(batch.group_table), num_runs=batch.runs.size, num_chunks=batch.num_chunks,
            direction=int(batch.direction), blocks=blocks, threads=self.threads,
        )
        end.record(stream)
        if staging is not None and batch.direction == Direction.STORE:
            self._copy_objects(batch, staging, to_device=False)
        last.record(stream)
        status = tables[status_offset:].cpu().numpy().view(np.uint64)  # synchronises the stream
        self.last_kernel_ms = begin.elapsed_time(end)
        seconds = time.perf_counter() - start
        done, rejected, moved = int(status[0]), int(status[1]), int(status[2])
        if rejected or done != batch.total_items:
            raise RuntimeError(f"kernel moved {done} of {batch.total_items} work items and rejected {rejected}")
        if moved != batch.payload_bytes:
            raise RuntimeError(f"kernel wrote {moved} B, the batch has {batch.payload_bytes} B of payload")
        return TransferStats(backend=self.name, direction=batch.direction, chunks=batch.num_chunks,
                             payload_bytes=batch.payload_bytes, launches=1, seconds=seconds,
                             device_seconds=first.elapsed_time(last) / 1e3)

    @staticmethod
    def _copy_objects(batch: ChunkBatch, staging: torch.Tensor, to_device: bool) -> None:
        """One cudaMemcpyAsync per run of chunks whose objects are adjacent in host memory."""
        nbytes = staging.shape[1]
        objects = batch.objects
        c = 0
        while c < len(objects):
            end = c + 1
            while (end < len(objects) and objects[end].data_ptr() == objects[c].data_ptr() + (end - c) * nbytes
                   and objects[end].untyped_storage().data_ptr() == objects[c].untyped_storage().data_ptr()):
                end += 1
            host = torch.as_strided(objects[c], ((end - c) * nbytes,), (1,))
            device = staging[c:end].reshape(-1)
            (device.copy_(host, non_blocking=True) if to_device else host.copy_(device, non_blocking=True))
            c = end
