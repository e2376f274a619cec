"""The TransferBackend interface every backend implements, and how one is chosen."""

from __future__ import annotations

import abc
import importlib.util
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from .batch import ChunkBatch, SlotArray
from .plan import Direction, TransferPlan

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "emu", "cuda", "npu", "auto")


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


class PlaneTables:
    """The plan's plane table, uploaded once per plan to the device its planes live on."""

    def __init__(self) -> None:
        self._tables: "weakref.WeakKeyDictionary[TransferPlan, torch.Tensor]" = weakref.WeakKeyDictionary()

    def get(self, plan: TransferPlan) -> torch.Tensor:
        table = self._tables.get(plan)
        if table is None:
            table = torch.from_numpy(plan.plane_table.view(np.uint8)).to(plan.device)
            self._tables[plan] = table
        return table

    def upload(self, plan: TransferPlan) -> None:
        """The table on the device now, the copy finished: later transfers on any stream read it."""
        table = self.get(plan)
        getattr(torch, table.device.type).current_stream(table.device).synchronize()


def warm_up(backend: TransferBackend, plan: TransferPlan) -> None:
    """One store of a chunk whose rows are all skipped (it writes zeros to a scratch object and reads no page):
    the device loads the kernel's module and the backend allocates what its first transfer would, before serving,
    where a first launch can wait for every stream of the device."""
    slots = [None if g.skip else np.full((1, rows), -1, dtype=np.int64)
             for g, rows in zip(plan.groups, plan.rows_per_chunk)]
    scratch = torch.zeros(plan.object_bytes, dtype=torch.uint8, pin_memory=True)
    backend.store(plan, slots, [scratch])


def packed_offsets(parts: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Where each part of a packed table buffer starts (64 B aligned), and the buffer's size."""
    offsets = np.cumsum([0] + [(p.nbytes + 63) // 64 * 64 for p in parts]).tolist()
    return [int(o) for o in offsets[:-1]], max(int(offsets[-1]), 64)


def pack_into(view: np.ndarray, parts: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    """Writes each part at its offset of a uint8 host buffer."""
    for part, offset in zip(parts, offsets):
        view[offset: offset + part.nbytes] = np.ascontiguousarray(part).view(np.uint8).reshape(-1)


def pack_pinned(parts: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    """Per-call tables in one pinned host buffer (64 B aligned parts), so one async copy uploads them all."""
    offsets, nbytes = packed_offsets(parts)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    pack_into(host.numpy(), parts, offsets)
    return host, offsets


class StagingBuffer:
    """The device buffer host chunk objects pass through, kept across transfers and zeroed only where needed.

    A store copies whole stretches of it to the host, alignment gaps included, so every byte a store can copy out
    holds the kernel's output or zeros: never another plan's device payload, nor host bytes (another object's gaps)
    that an earlier load copied in. A gap-free plan's store overwrites every byte, so it never zeroes; otherwise
    the zeroing is stream-ordered before the store's kernel and covers only bytes a load or another plan dirtied."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        self._plan: Optional["weakref.ref[TransferPlan]"] = None
        self._dirty = (0, 0)  # [begin, end): may hold bytes that are not a store's output
        self._pending: Optional[tuple[int, int]] = None  # bytes reserve() found dirty, zeroed by zero_pending() or by the caller (take_pending())

    def get(self, plan: TransferPlan, nbytes: int, direction: Direction) -> torch.Tensor:
        """reserve() then zero_pending(): the buffer ready for this transfer's kernel."""
        view = self.reserve(plan, nbytes, direction)
        self.zero_pending()
        return view

    def reserve(self, plan: TransferPlan, nbytes: int, direction: Direction) -> torch.Tensor:
        """The first `nbytes` of the buffer for one transfer; host bookkeeping only (an allocation at most), so a
        caller can prepare everything before its first device operation and zero the pending bytes right before
        the kernel."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != plan.device:
            buffer = self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=plan.device)
            self._dirty = (0, 0)
        elif self._plan is None or self._plan() is not plan:
            self._dirty = (0, buffer.numel())  # the old plan's payload sits where this plan has gaps
        self._plan = weakref.ref(plan)
        begin, end = self._dirty
        self._pending = None
        if direction == Direction.LOAD:
            if not plan.gap_free:
                self._dirty = (0, max(end, nbytes))  # host bytes land in [0, nbytes), this plan's gaps included
            return buffer[:nbytes]
        if not plan.gap_free and begin < min(end, nbytes):
            self._pending = (begin, min(end, nbytes))
        rest = max(begin, nbytes)  # [0, nbytes) will hold this store's output or zeros
        self._dirty = (rest, end) if rest < end else (0, 0)
        return buffer[:nbytes]

    def zero_pending(self) -> None:
        """Enqueues the zeroing reserve() found necessary on the current stream (nothing when none was)."""
        pending = self.take_pending()
        if pending is not None and self._buffer is not None:
            self._buffer[pending[0]:pending[1]].zero_()

    def take_pending(self) -> Optional[tuple[int, int]]:
        """The [begin, end) bytes reserve() found dirty, for a caller that enqueues the zeroing itself."""
        pending, self._pending = self._pending, None
        return pending

    @property
    def dirty(self) -> tuple[int, int]:
        """The byte range a store would zero before use (for tests and logs)."""
        return self._dirty


def host_stretches(objects: Sequence[torch.Tensor], pieces: Sequence[tuple[int, int, int]],
                   object_bytes: int) -> list[tuple[int, int, int]]:
    """Merges (chunk, offset, length) pieces, ordered by staging offset, into the longest stretches contiguous in
    both staging (chunk c at c * object_bytes) and host memory, so each becomes one async copy."""
    merged: list[list[int]] = []
    for chunk, offset, length in pieces:
        if merged:
            c0, o0, n0 = merged[-1]
            if (chunk * object_bytes + offset == c0 * object_bytes + o0 + n0
                    and objects[chunk].data_ptr() + offset == objects[c0].data_ptr() + o0 + n0
                    and objects[chunk].untyped_storage().data_ptr() == objects[c0].untyped_storage().data_ptr()):
                merged[-1][2] += length
                continue
        merged.append([chunk, offset, length])
    return [(c, o, n) for c, o, n in merged]


def copy_stretches(staging: torch.Tensor, objects: Sequence[torch.Tensor], stretches: Sequence[tuple[int, int, int]],
                   object_bytes: int, to_device: bool) -> None:
    """One non-blocking copy per stretch between host objects and the staging buffer, on the current stream."""
    for chunk, offset, length in stretches:
        obj = objects[chunk]
        host = torch.as_strided(obj, (length,), (1,), obj.storage_offset() + offset)
        device = staging[chunk * object_bytes + offset: chunk * object_bytes + offset + length]
        (device.copy_(host, non_blocking=True) if to_device else host.copy_(device, non_blocking=True))


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def _cuda_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("lmcache_npu._cuda") is not None


def backend_class(name: str) -> type[TransferBackend]:
    """The class behind a backend name (not "auto"); importing it loads no native module."""
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend
    if name == "emu":
        from .emu_backend import EmuBackend

        return EmuBackend
    if name == "npu":
        from .npu_backend import NpuBackend

        return NpuBackend
    if name == "cuda":
        from .cuda_backend import CudaBackend

        return CudaBackend
    raise ValueError(f"unknown transfer backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")


def backend_for_device(device_type: str, requested: str = "auto") -> str:
    """The backend that moves KV pages held on `device_type`: `requested` if it can, else a ValueError; "auto" picks
    the device's own kernels (on the host: the AscendC source built for x86 when present, else torch)."""
    if requested == "auto":
        if device_type in ("npu", "cuda"):
            return device_type
        if device_type == "cpu":
            return "emu" if importlib.util.find_spec("lmcache_npu._emu") is not None else "torch"
        raise ValueError(f"no transfer backend moves {device_type} memory")
    backend_class(requested)  # an unknown name fails here, naming the choices
    if (requested == "emu" and device_type != "cpu") or (requested in ("cuda", "npu") and device_type != requested):
        raise ValueError(f"backend {requested!r} cannot move {device_type} memory; use backend 'auto'")
    return requested


def auto_backend_name() -> str:
    """The backend this machine runs best: npu > cuda > emu > torch."""
    if npu_available():
        return backend_for_device("npu")
    if _cuda_available():
        return backend_for_device("cuda")
    return backend_for_device("cpu")


def get_backend(name: str = "auto", **options: object) -> TransferBackend:
    """Returns a backend by name: torch, emu, npu, cuda or auto (npu > cuda > emu > torch)."""
    if name == "auto":
        name = auto_backend_name()
        logger.info("auto-selected the %s transfer backend", name)
    cls = backend_class(name)
    if name == "cuda" and not _cuda_available():
        raise BackendUnavailable(
            "the cuda backend needs lmcache_npu._cuda (built at install time when nvcc and a CUDA build of "
            "torch are present, or with LMCACHE_NPU_CUDA=1) and a visible CUDA device"
        )
    return cls(**options)  # type: ignore[arg-type]
