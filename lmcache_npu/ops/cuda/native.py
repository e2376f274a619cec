"""The bridge to lmcache_npu._cuda: the native transfer record (LmcacheCudaTransfer in csrc/cuda/kv_transfer_cuda.h)
as a numpy record, the C enums it carries, and what every transfer on one device reuses."""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Any, Optional

import numpy as np
import torch

from ..transfer_backend import BackendUnavailable
from .work_order import MAX_SLICES

logger = logging.getLogger(__name__)


class Pipeline(IntEnum):
    """How the kernel meets the copy engine inside one launch (LmcachePipeline)."""

    NO_PIPELINE = 0
    RELEASE_SLICES = 1  # store: a slice's flag rises when its last item is written
    ACQUIRE_SLICES = 2  # load: a slice's bytes are read once its flag rose
    MAPPED_PREFIX = 3  # slice 0's items move straight to/from the host objects, the rest through staging


class TransferEvent(IntEnum):
    """The slots of the record's events (LmcacheTransferEvent); the last is the caller's own event, per transfer."""

    FIRST = 0
    KERNEL_BEGIN = 1
    KERNEL_END = 2
    LAST = 3
    COPIES_DONE = 4
    RETURNED = 5
    FIRST_SLICE_IN = 6
    PAGES_FREE = 7


# Events a lane's host thread synchronizes on to finish a transfer: made with cudaEventBlockingSync, so the waiting
# thread sleeps instead of spinning on the driver while the model's thread launches its forward.
_HOST_WAITED = frozenset({TransferEvent.RETURNED, TransferEvent.COPIES_DONE})


# The native transfer record, field by field.
_RECORD_U64 = ("stream", "planes", "groups", "runs", "objects", "host_objects", "items", "slice_items",
               "slice_counters", "slice_flags", "status", "num_items")
_RECORD_U32 = ("num_planes", "num_groups", "num_runs", "num_chunks", "kernel_direction", "blocks", "threads",
               "num_slices", "epoch", "pipeline")
_RECORD_TAIL = ("copy_stream", "table_host", "table_device", "table_bytes", "zero_address", "zero_bytes", "copies",
                "num_copies", "direction", "status_host")


def record_dtype(cuda: Any) -> np.dtype:
    """The numpy twin of the native record, at the offsets the built module reports (a stale build fails here)."""
    names = _RECORD_U64 + _RECORD_U32 + _RECORD_TAIL + ("events",)
    fields = dict(cuda.TRANSFER_FIELDS)
    if set(fields) != set(names) or cuda.EVENTS != len(TransferEvent):
        raise BackendUnavailable(f"lmcache_npu._cuda has transfer fields {sorted(fields)}; this package expects "
                                 f"{sorted(names)}: rebuild it (pip install -e . or setup.py build_ext)")
    formats = (["<u8"] * len(_RECORD_U64) + ["<u4"] * len(_RECORD_U32) + ["<u8"] * len(_RECORD_TAIL)
               + [("<u8", (cuda.EVENTS,))])
    return np.dtype({"names": list(names), "formats": formats, "offsets": [fields[n] for n in names],
                     "itemsize": cuda.TRANSFER_BYTES})


def load_cuda_module() -> Any:
    """lmcache_npu._cuda, checked against this package's record layout (a stale build is refused here, not at the
    first transfer)."""
    try:
        from lmcache_npu import _cuda  # type: ignore[attr-defined]
    except ImportError as exc:
        raise BackendUnavailable(f"lmcache_npu._cuda is not built ({exc})") from exc
    record_dtype(_cuda)
    if not getattr(_cuda, "BLOCKING_EVENTS", False):
        raise BackendUnavailable("lmcache_npu._cuda makes no blocking-sync events: rebuild it (pip install -e . or "
                                 "setup.py build_ext)")
    if getattr(_cuda, "SLICES_BYTES", None) != 4 * 8 or not hasattr(_cuda, "copy_ahead"):
        raise BackendUnavailable("lmcache_npu._cuda has no sliced loads with copies ahead (LmcacheCudaSlices): "
                                 "rebuild it (pip install -e . or setup.py build_ext)")
    return _cuda


def stream_memops_supported(cuda: Any) -> bool:
    """Whether the driver offers stream memory operations (cuStreamWaitValue32), which let one launch overlap the
    kernel with the copy engine."""
    probe = torch.zeros(1, dtype=torch.int32, device="cuda")
    probe_stream = torch.cuda.current_stream().cuda_stream
    supported = bool(cuda.stream_write_value32(probe_stream, probe.data_ptr(), 1)) and bool(
        cuda.stream_wait_value32(probe_stream, probe.data_ptr(), 1))
    torch.cuda.current_stream().synchronize()
    return supported


class SliceEvent:
    """One slice's landing event, a cudaEvent_t the native sliced load made (no timing), used like torch's: a
    stream's `wait_event` calls `wait`. Destroyed with its last reference (a wait already queued is unaffected)."""

    __slots__ = ("_cuda", "cuda_event")

    def __init__(self, cuda: Any, handle: int) -> None:
        self._cuda = cuda
        self.cuda_event = handle

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """`stream`'s later work (the current stream's when None) waits for this slice."""
        stream = torch.cuda.current_stream() if stream is None else stream
        self._cuda.stream_wait_event(stream.cuda_stream, self.cuda_event)

    def query(self) -> bool:
        return bool(self._cuda.event_query(self.cuda_event))

    def synchronize(self) -> None:
        self._cuda.event_synchronize(self.cuda_event)

    def __del__(self) -> None:
        try:
            self._cuda.event_destroy(self.cuda_event)
        except Exception:  # the CUDA context may already be gone at interpreter exit
            logger.debug("slice event not destroyed", exc_info=True)


class NativeResources:
    """What every transfer on one device reuses: the record, its events, the table buffers, the copy stream."""

    def __init__(self, cuda: Any, device: torch.device) -> None:
        self.cuda = cuda
        self.device = device
        self.record = np.zeros(1, dtype=record_dtype(cuda))
        self._scalar_names = tuple(name for name in self.record.dtype.names if name != "events")
        self._scalars = self.record[list(self._scalar_names)]  # a view: every scalar field set in one numpy call
        with torch.cuda.device(device):
            # the two the lane's host waits on sleep rather than spin (`_HOST_WAITED`)
            self.events = [cuda.event_create(blocking=TransferEvent(i) in _HOST_WAITED)
                           for i in range(TransferEvent.PAGES_FREE)]
            self.copy_stream = torch.cuda.Stream(device)
        self.record["events"][0, :TransferEvent.PAGES_FREE] = self.events
        self.flags = torch.zeros(MAX_SLICES, dtype=torch.int32, device=device)
        self.epoch = 0
        self.host_tables = torch.zeros(0, dtype=torch.uint8)
        self.host_view = self.host_tables.numpy()  # the same bytes, for native planners that pack into them
        self.device_tables = torch.zeros(0, dtype=torch.uint8, device=device)
        torch.cuda.current_stream(device).synchronize()  # the flags are zero before the copy stream waits on them

    def set_fields(self, fields: dict[str, int]) -> None:
        """Sets every scalar field of the record (all of them: a missing one raises) in one assignment."""
        if len(fields) != len(self._scalar_names):
            raise ValueError(f"the transfer record has {len(self._scalar_names)} scalar fields, {len(fields)} given: "
                             f"{sorted(set(fields) ^ set(self._scalar_names))}")
        self._scalars[0] = tuple(fields[name] for name in self._scalar_names)

    def tables(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host and device table buffers of at least `nbytes`, kept across transfers (each transfer is done
        before the next starts), so none allocates page-locked memory while the device may be busy."""
        if self.host_tables.numel() < nbytes:
            size = max(4096, 1 << (nbytes - 1).bit_length())
            self.host_tables = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
            self.host_view = self.host_tables.numpy()
            self.device_tables = torch.empty(size, dtype=torch.uint8, device=self.device)  # used on this stream only
        return self.host_tables, self.device_tables

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """The pinned host table buffer as numpy, of at least `nbytes` (grown like `tables`)."""
        self.tables(nbytes)
        return self.host_view

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1
        if self.epoch == 1:  # wrapped (or first): flags from 2^32 transfers ago must not satisfy a wait
            self.flags.zero_()
            torch.cuda.current_stream(self.device).synchronize()
        return self.epoch

    def elapsed_ms(self, begin: TransferEvent, end: TransferEvent) -> float:
        return float(self.cuda.event_elapsed_ms(self.events[begin], self.events[end]))

    def close(self) -> None:
        for event in self.events:
            self.cuda.event_destroy(event)
        self.events = []
