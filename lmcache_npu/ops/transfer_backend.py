"""The TransferBackend interface every backend implements, and what every backend reports.

Backends import this module; the registry that picks one (backend.py) imports the backends, never the reverse.
"""

from __future__ import annotations

import abc
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
    seconds: float
    dma_ops: Optional[int] = None  # DMA calls issued by the kernel, where the backend can count them
    device_seconds: Optional[float] = None  # GPU time from the first enqueued op to the last (CUDA events)


# Told that the kernel is done with the pages: a device event that completes then, or None (see transfer()).
AfterKernel = Callable[[Optional[Any]], None]


class TransferBackend(abc.ABC):
    """Moves a ChunkBatch between paged planes and chunk objects, one launch per direction."""

    name: str = ""

    @abc.abstractmethod
    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        """Runs one validated batch; raises before touching memory if the backend cannot run it.

        `after_kernel(event)` is called once the kernel is done with the pages, before the transfer's host copy
        ends: with a device event recorded right after the kernel, or with None where the current stream's present
        position is right after the launch (an event recorded there completes when every page row has been read or
        written) or, on host backends, once the copy has finished. The connector uses it to let the model overwrite
        pages as early as possible."""

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


def verify_kernel_report(batch: ChunkBatch, done: int, rejected: int, bytes_moved: int,
                         items: Optional[int] = None) -> None:
    """Every kernel reports what it did; anything but the whole batch is an error, never a silent loss. `items`:
    the work items launched when the backend cut the batch's runs finer (default: the batch's own)."""
    expected = batch.total_items if items is None else items
    if rejected or done != expected:
        raise RuntimeError(
            f"kernel moved {done} of {expected} work items and rejected {rejected}: the host "
            "validation and the kernel disagree about this batch"
        )
    if bytes_moved != batch.payload_bytes:
        raise RuntimeError(f"kernel wrote {bytes_moved} B, the batch has {batch.payload_bytes} B of payload")


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
