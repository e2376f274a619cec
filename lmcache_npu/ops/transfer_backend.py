"""The TransferBackend interface every backend implements, and what every backend reports.

Backends import this module; the registry that picks one (backend.py) imports the backends, never the reverse.
"""

from __future__ import annotations

import abc
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from .batch import ChunkBatch, SlotArray
from .plan import Direction, TransferPlan


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class TransferStats:
    backend: str
    direction: Direction
    chunks: int
    payload_bytes: int
    launches: int
    seconds: float  # host wall time of the backend's whole call (planning, launch, waits)
    dma_ops: Optional[int] = None  # DMA calls issued by the kernel, where the backend can count them
    device_seconds: Optional[float] = None  # GPU time from the first enqueued op to the last (CUDA events)


@dataclass(frozen=True)
class KernelReport:
    """What one backend call did, as its kernel counted it (the torch backend: as its gathers and scatters did)."""

    bytes_moved: int
    launches: int
    items_done: Optional[int] = None  # None: the backend does not work in (run, plane) items
    items_rejected: int = 0
    items_launched: Optional[int] = None  # the work items launched where the backend cut the batch's runs finer
    dma_ops: Optional[int] = None
    device_seconds: Optional[float] = None


# Told that the kernel is done with the pages: a device event that completes then, or None (see transfer()).
AfterKernel = Callable[[Optional[Any]], None]


class _PagesFreeNotice:
    """The caller's after_kernel, remembering whether the backend has called it: a backend that does not (its pages
    are free once _launch returns) is covered by transfer()."""

    def __init__(self, after_kernel: AfterKernel) -> None:
        self._after_kernel = after_kernel
        self.sent = False

    def __call__(self, event: Optional[Any]) -> None:
        self.sent = True
        self._after_kernel(event)


class PendingTransfer:
    """A launched batch (`TransferBackend.launch`). Everything it moves is enqueued on the caller's current stream
    (on the host: already done); `finish()` waits for its end once and returns its stats, raising as transfer()
    would when the kernel did not move the whole batch. Every launched batch must be finished, in launch order."""

    def __init__(self, finish: Callable[[], TransferStats], asynchronous: bool) -> None:
        self._finish: Optional[Callable[[], TransferStats]] = finish
        self._stats: Optional[TransferStats] = None
        self.asynchronous = asynchronous  # False: the bytes were in place when launch() returned

    @classmethod
    def done(cls, stats: TransferStats) -> "PendingTransfer":
        return cls(lambda: stats, asynchronous=False)

    def finish(self) -> TransferStats:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._stats = finish()
        assert self._stats is not None
        return self._stats


class TransferBackend(abc.ABC):
    """Moves a ChunkBatch between paged planes and chunk objects, one launch per direction."""

    name: str = ""

    @classmethod
    def option_names(cls) -> list[str]:
        """The backend_options this backend takes, in order: its constructor's keyword parameters."""
        parameters = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        """Runs one validated batch; raises before touching memory if the backend cannot run it, and raises if its
        kernel reports anything but the whole batch moved.

        `after_kernel(event)` is called once the kernel is done with the pages, before the transfer's host copy
        ends: with a device event recorded right after the kernel, or with None where the current stream's present
        position is right after the launch (an event recorded there completes when every page row has been read or
        written) or, on host backends, once the copy has finished. The connector uses it to let the model overwrite
        pages as early as possible. `seconds` in the stats is the host's wall time of the backend's whole call."""
        notice = None if after_kernel is None else _PagesFreeNotice(after_kernel)
        start = time.perf_counter()
        report = self._launch(batch, notice)
        seconds = time.perf_counter() - start
        if notice is not None and not notice.sent:
            notice(None)  # the backend returned with its copy finished: the pages are free now
        return self._stats(batch, report, seconds)

    def launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> PendingTransfer:
        """transfer() split in two where the backend can return before its copy is done (the CUDA backend's loads):
        the batch is validated and enqueued on the current stream, `after_kernel` as transfer() says; an event the
        caller records on that stream afterwards completes once the bytes are in place. Other backends run the
        batch to its end here. The caller finishes every pending transfer, in launch order."""
        return PendingTransfer.done(self.transfer(batch, after_kernel))

    def _stats(self, batch: ChunkBatch, report: KernelReport, seconds: float) -> TransferStats:
        """The checked stats of a finished batch (raises unless its kernel moved the whole batch)."""
        verify_kernel_report(batch, report)
        return TransferStats(backend=self.name, direction=batch.direction, chunks=batch.num_chunks,
                             payload_bytes=batch.payload_bytes, launches=report.launches, seconds=seconds,
                             dma_ops=report.dma_ops, device_seconds=report.device_seconds)

    @abc.abstractmethod
    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        """Moves the batch and reports what the kernel did. A device backend calls `after_kernel` (when given) as
        transfer() describes, before it waits for its copies; a backend whose pages are free only once it returns
        leaves that call to transfer()."""

    def prepare(self, plan: TransferPlan) -> None:
        """Readies what every transfer of `plan` reuses, once, before serving (device backends upload the plane
        table: a first upload inside a transfer would copy from pageable memory and wait for the stream, which a
        connector's stream has ordered behind the model's work). Host backends keep nothing per plan."""

    def store(
        self,
        plan: TransferPlan,
        slots: Sequence[Optional[SlotArray]],
        objects: Union[torch.Tensor, Sequence[torch.Tensor]],
    ) -> TransferStats:
        return self.transfer(ChunkBatch.build(plan, slots, objects, Direction.STORE))

    def load(
        self,
        plan: TransferPlan,
        slots: Sequence[Optional[SlotArray]],
        objects: Union[torch.Tensor, Sequence[torch.Tensor]],
    ) -> TransferStats:
        return self.transfer(ChunkBatch.build(plan, slots, objects, Direction.LOAD))


def verify_kernel_report(batch: ChunkBatch, report: KernelReport) -> None:
    """Every kernel reports what it did; anything but the whole batch is an error, never a silent loss."""
    expected = batch.total_items if report.items_launched is None else report.items_launched
    done = expected if report.items_done is None else report.items_done
    if report.items_rejected or done != expected:
        raise RuntimeError(
            f"kernel moved {done} of {expected} work items and rejected {report.items_rejected}: the host "
            "validation and the kernel disagree about this batch"
        )
    if report.bytes_moved != batch.payload_bytes:
        raise RuntimeError(f"kernel wrote {report.bytes_moved} B, the batch has {batch.payload_bytes} B of payload")


def warm_up(backend: TransferBackend, plan: TransferPlan, scratch: Optional[torch.Tensor] = None) -> None:
    """One store of a chunk whose rows are all skipped (it writes zeros to a scratch object and reads no page):
    the device loads the kernel's module and the backend allocates what its first transfer would, before serving,
    where a first launch can wait for every stream of the device. `scratch`: a host object of at least
    `plan.object_bytes` the backend can reach (default: torch's pinned memory)."""
    slots = [None if g.skip else np.full((1, rows), -1, dtype=np.int64)
             for g, rows in zip(plan.groups, plan.rows_per_chunk)]
    if scratch is None:
        scratch = torch.zeros(plan.object_bytes, dtype=torch.uint8, pin_memory=True)
    backend.store(plan, slots, [scratch[:plan.object_bytes]])
