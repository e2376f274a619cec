"""Reference points measured in the same run as a CUDA transfer: a plain pinned copy of the same bytes,
a naive torch transfer (per-plane gather + one copy), and the slowdown transfers cause to a matmul loop."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...ops import ChunkBatch, Direction
from ...ops.torch_backend import row_view

QUEUE_CYCLES = 2_000_000  # ~1 ms of GPU sleep ahead of a queued transfer: longer than its host preparation


def queue_gpu_work(cycles: int = QUEUE_CYCLES) -> None:
    """About 1 ms of work on the current CUDA stream: a transfer enqueued next starts behind it, as behind a forward
    in serving, so its window holds GPU time only and not the host's enqueue latency."""
    torch.cuda._sleep(cycles)


def _best_ms(fn: Callable[[], None], stream: torch.cuda.Stream, repeats: int, queued: bool = False) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if queued:
            with torch.cuda.stream(stream):
                queue_gpu_work()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, begin.elapsed_time(end))
    return best


def pinned_copy_gbps(nbytes: int, direction: Direction, device: torch.device, repeats: int = 5,
                     queued: bool = False) -> float:
    """One cudaMemcpyAsync of `nbytes` between device memory and pinned host memory (best of `repeats`; `queued`:
    each behind GPU work, see queue_gpu_work)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream(device)
    copy = (lambda: host.copy_(dev, non_blocking=True)) if direction == Direction.STORE else (
        lambda: dev.copy_(host, non_blocking=True))
    return nbytes / (_best_ms(copy, stream, repeats, queued) / 1e3) / 1e9


def naive_torch_gbps(batch: ChunkBatch, repeats: int = 5) -> float:
    """Per-plane torch gather into one device buffer plus one copy to pinned host (load: the reverse)."""
    plan = batch.plan
    device = plan.device
    views, indices, sizes = [], [], []
    for plane in plan.moved_planes:
        slots = torch.from_numpy(batch.slots[plane.group]).reshape(-1).to(device)
        slots = slots[slots >= 0]
        views.append(row_view(plane))
        indices.append((slots // plane.rows_per_block, slots % plane.rows_per_block))
        sizes.append(int(slots.numel()) * plane.row_bytes)
    total = sum(sizes)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    chunks = list(buffer.split(sizes))

    def store() -> None:
        for view, (blocks, within), out in zip(views, indices, chunks):
            out.view(blocks.numel(), -1).copy_(view[blocks, within].reshape(blocks.numel(), -1))
        host.copy_(buffer, non_blocking=True)

    def load() -> None:
        buffer.copy_(host, non_blocking=True)
        for view, (blocks, within), src in zip(views, indices, chunks):
            view[blocks, within] = src.view((blocks.numel(),) + tuple(view.shape[2:]))

    stream = torch.cuda.current_stream(device)
    ms = _best_ms(store if batch.direction == Direction.STORE else load, stream, repeats)
    return total / (ms / 1e3) / 1e9


@dataclass(frozen=True)
class OverlapResult:
    path: str
    priority: int
    matmul_ms_alone: float
    matmul_ms_with_transfers: float
    transfer_gb_per_s: float
    transfers: int
    kernel_ms: float

    @property
    def slowdown_percent(self) -> float:
        return 100.0 * (self.matmul_ms_with_transfers / self.matmul_ms_alone - 1.0)


def _overlap(device: torch.device, step: Callable[[], tuple[int, float, float]], label: str, matmuls: int, size: int,
             priority: int) -> OverlapResult:
    """bf16 matmuls on the compute stream while `step` (returns payload bytes, seconds, kernel ms) runs again and
    again on a side stream."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    compute = torch.cuda.current_stream(device)

    def matmul_loop() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(compute)
        for _ in range(matmuls):
            torch.matmul(a, b)
        end.record(compute)
        return begin, end

    matmul_loop()[1].synchronize()  # warm-up
    begin, end = matmul_loop()
    end.synchronize()
    alone = begin.elapsed_time(end) / matmuls
    side = torch.cuda.Stream(device, priority=priority)
    begin, end = matmul_loop()
    moved, seconds, kernel_ms, count = 0, 0.0, 0.0, 0
    with torch.cuda.stream(side):
        while not end.query():
            nbytes, step_seconds, step_kernel_ms = step()
            moved += nbytes
            seconds += step_seconds
            kernel_ms += step_kernel_ms
            count += 1
    end.synchronize()
    with_transfers = begin.elapsed_time(end) / matmuls
    return OverlapResult(label, priority, alone, with_transfers, moved / seconds / 1e9 if seconds else 0.0, count,
                         kernel_ms / max(count, 1))


def overlap(batch: ChunkBatch, backend, path: str, matmuls: int = 150, size: int = 8192,
            priority: int = 0) -> OverlapResult:
    """The matmul loop's slowdown while `batch` is transferred again and again on a side stream (`priority` < 0: a
    high-priority stream, whose blocks the scheduler places first as SMs free up)."""
    backend.tuning = replace(backend.tuning, path=path)

    def step() -> tuple[int, float, float]:
        stats = backend.transfer(batch)
        return stats.payload_bytes, stats.device_seconds or stats.seconds, backend.last_kernel_ms or 0.0

    return _overlap(batch.plan.device, step, path, matmuls, size, priority)


def pinned_copy_overlap(nbytes: int, direction: Direction, device: torch.device, matmuls: int = 150,
                        size: int = 8192) -> OverlapResult:
    """The same matmul loop next to plain pinned copies of `nbytes`: the PCIe rate a transfer can hope for there."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def step() -> tuple[int, float, float]:
        stream = torch.cuda.current_stream(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        (host.copy_(dev, non_blocking=True) if direction == Direction.STORE else dev.copy_(host, non_blocking=True))
        end.record(stream)
        end.synchronize()
        return nbytes, begin.elapsed_time(end) / 1e3, 0.0

    return _overlap(device, step, "pinned copy", matmuls, size, 0)
