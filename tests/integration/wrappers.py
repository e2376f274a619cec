"""Transfer backends that misbehave on purpose, put between the worker's mover and the real backend."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from lmcache_npu.ops import ChunkBatch, Direction, TransferBackend, TransferStats
from lmcache_npu.ops.transfer_backend import AfterKernel, KernelReport


class Wrapped(TransferBackend):
    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = {Direction.STORE: 0, Direction.LOAD: 0}

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        self.calls[batch.direction] += 1
        return self.inner._launch(batch, after_kernel)  # the inner backend's kernel, under this one's transfer()


class Slow(Wrapped):
    """Transfers of `direction` wait until `release` is set (or `seconds` pass). A store waits after its kernel
    has read the pages, as a device-to-host copy that outlasts the step would (the page fence of the next step is
    already lifted); a load waits before it writes anything."""

    def __init__(self, inner: TransferBackend, direction: Direction, seconds: float = 30.0) -> None:
        super().__init__(inner)
        self.direction = direction
        self.seconds = seconds
        self.release = threading.Event()
        self.waiting = threading.Event()  # set while a transfer waits

    def _hold(self) -> None:
        self.waiting.set()
        self.release.wait(self.seconds)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        if batch.direction != self.direction:
            return super().transfer(batch, after_kernel)
        if batch.direction == Direction.LOAD:
            self._hold()
            return super().transfer(batch, after_kernel)
        stats = super().transfer(batch, after_kernel)
        self._hold()
        return stats


class LateSlices(Wrapped):
    """Load batches of a slice after the first (a plane subset of the plan without its first plane) wait `seconds`
    before they copy: they land after the forward has passed the layers that skipped their hook."""

    def __init__(self, inner: Any, plan: Any, seconds: float) -> None:
        super().__init__(inner)
        self.plan = plan
        self.slow = Slow(inner, Direction.LOAD, seconds)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        moved = batch.plan.moved_planes
        if batch.direction == Direction.LOAD and moved and moved[0] is not self.plan.moved_planes[0]:
            return self.slow.transfer(batch, after_kernel)
        return super().transfer(batch, after_kernel)


class Failing(Wrapped):
    """Loads raise before touching memory, `times` times (None: always)."""

    def __init__(self, inner: TransferBackend, times: Optional[int] = None) -> None:
        super().__init__(inner)
        self.remaining = times
        self.failures = 0

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        if batch.direction == Direction.LOAD and (self.remaining is None or self.remaining > 0):
            if self.remaining is not None:
                self.remaining -= 1
            self.failures += 1
            raise RuntimeError("injected device fault")
        return super().transfer(batch, after_kernel)


class Hollow(Wrapped):
    """Loads report success and write nothing (the pages keep whatever they held)."""

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        if batch.direction != Direction.LOAD:
            return super().transfer(batch, after_kernel)
        self.calls[batch.direction] += 1
        if after_kernel is not None:
            after_kernel(None)
        return TransferStats(self.name, batch.direction, batch.num_chunks, batch.payload_bytes, 1, 0.0)


def wrap(engine, make: Callable[[TransferBackend], Wrapped], direction: Direction,
         ranks: Optional[list[int]] = None) -> list[Wrapped]:
    """Puts a wrapper around the `direction` lane's transfer backend of the given ranks (all by default)."""
    out = []
    for rank, worker in enumerate(engine.workers):
        if ranks is None or rank in ranks:
            mover = worker.worker_half.mover
            wrapped = make(mover.backends[direction])
            mover.set_backend(direction, wrapped)
            out.append(wrapped)
    return out


def wait_until(predicate: Callable[[], bool], step: Callable[[], object], limit: int = 500) -> None:
    for _ in range(limit):
        if predicate():
            return
        step()
        time.sleep(0.001)
    raise AssertionError("condition never held")
