"""The host arena (DESIGN §7, tier L1): fixed-size chunk slots in separately mapped and registered segments.

Every worker process keeps an identical arena (same slot count and slot size), so a slot number chosen by the
scheduler-side index means the same place on every rank. The arena holds bytes only; which slot holds which chunk,
and in which state, is the index's business. Its memory is anonymous mmap segments (`segments.py`: hugepages, NUMA
placement, no power-of-two rounding), made DMA-able for the accelerator one segment at a time in the background when
one is present (`platform/host_memory.py`: registered where the device allows, else allocated by the device runtime
itself). Slots never straddle segments; only slots of live segments (`usable_ranges`) may be handed out, and the
workers report those to the scheduler's index.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..platform.npu_runtime import npu_available
from ..ops.plan import align_up
from ..platform.host_memory import SegmentPinning
from ..platform.vm import SLOT_ALIGN_BYTES
from .envelope import ENVELOPE_BYTES
from .metrics import Metric
from .segments import DEFAULT_SEGMENT_BYTES, SegmentedMemory

logger = logging.getLogger(__name__)


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU can page-lock host memory for this process."""
    return torch.cuda.is_available() or npu_available()


def device_pinning(npu_host_memory: str = "auto") -> tuple[Optional[SegmentPinning], Optional[int]]:
    """How this process's accelerator makes arena segments DMA-able, and the NUMA node it hangs off (None, None
    without one). `npu_host_memory` picks the Ascend path (auto: from the host's driver, kernel and SoC)."""
    if torch.cuda.is_available():
        from ..platform.cuda_memory import CudaHostRegistrar, cuda_device_numa_node

        index = torch.cuda.current_device()
        return SegmentPinning([CudaHostRegistrar(index)]), cuda_device_numa_node(index)
    if npu_available():
        from ..platform.ascend_memory import npu_segment_pinning
        from ..platform.npu_runtime import DeviceUnavailable, NpuRuntime

        try:
            runtime = NpuRuntime.load()
        except DeviceUnavailable as exc:
            raise MemoryError(f"the host arena cannot be made DMA-able for the NPU: {exc}") from exc
        return npu_segment_pinning(runtime, npu_host_memory), None
    return None, None


class HostArena:
    """`num_slots` slots, each holding a chunk object of `object_bytes` (what the transfer kernels see) followed by
    its envelope trailer (`sealed_view`: what disk and Mooncake see), every slot starting on a 4 KiB boundary.

    `pinned` (None: when an accelerator is present) makes every segment DMA-able for the device; `pinning` overrides
    how (tests), `npu_host_memory` picks the Ascend path. `numa_node` binds the pages to a node; unset, they prefer
    the device's node where it is known.
    `share` puts every segment in a memory file other processes can map (the node cache service's arena);
    `shared_fds` maps such files instead of allocating (a worker of an engine attached to the node cache).
    The constructor returns once the first segment is usable (registration of the rest goes on in the background);
    `wait_ready()` blocks until every segment has settled."""

    def __init__(self, num_slots: int, object_bytes: int, *, pinned: Optional[bool] = None,
                 numa_node: Optional[int] = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 hugepages: str = "auto", prefault: bool = True, pinning: Optional[SegmentPinning] = None,
                 npu_host_memory: str = "auto", share: bool = False,
                 shared_fds: Optional[Sequence[int]] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host arena needs at least one slot (num_slots={num_slots}); raise cpu_bytes")
        if object_bytes < 1:
            raise ValueError(f"object_bytes must be positive, got {object_bytes}")
        self.num_slots = num_slots
        self.object_bytes = object_bytes
        self.sealed_bytes = object_bytes + ENVELOPE_BYTES
        self.slot_bytes = slot_bytes_for(object_bytes)
        self.pinned = (accelerator_present() or pinning is not None) if pinned is None else pinned
        self.numa_node = numa_node
        total = num_slots * self.slot_bytes
        device_node = None
        if self.pinned and pinning is None:
            pinning, device_node = device_pinning(npu_host_memory)
            if pinning is None:
                raise MemoryError(f"could not allocate a {total / 2**30:.2f} GiB host arena (pinned): no CUDA GPU or "
                                  "Ascend NPU here to register it with; set pinned: false")
        elif not self.pinned:
            pinning = None
        self.memory = SegmentedMemory(num_slots, self.slot_bytes, segment_bytes=segment_bytes, hugepages=hugepages,
                                      pinning=pinning, numa_node=numa_node, preferred_node=device_node,
                                      prefault=prefault, share=share, shared_fds=shared_fds)
        # one array and tensor per segment (its own storage), made once the segment is live: host copies are merged
        # only within a segment, and an allocated segment's address is known only then
        self._views: list[Optional[tuple[np.ndarray, torch.Tensor]]] = [None] * len(self.memory.segments)
        self.memory.start()
        if not self.memory.wait_first():
            errors = sorted({s.error for s in self.memory.segments})
            self.memory.close()
            raise MemoryError(f"could not allocate a {total / 2**30:.2f} GiB host arena (pinned): no segment could be "
                              f"made DMA-able ({'; '.join(errors)})")
        logger.info("host arena: %d slots x %d B (%.2f GiB) in %d segment(s) of up to %d slots, %s, hugepages %s%s",
                    num_slots, self.slot_bytes, total / 2**30, len(self.memory.segments),
                    self.memory.slots_per_segment, pinning.describe() if pinning is not None else "pageable",
                    hugepages if hugepages != "auto" else ("auto (THP)" if self.memory.transparent else "auto (none)"),
                    "" if numa_node is None else f", NUMA node {numa_node}")

    def close(self) -> None:
        """Stops background registration and unregisters every segment now instead of whenever the arena is
        collected: unregistering waits for the device, so the owner picks a moment when no stream is held back.
        The slots stay readable."""
        self.memory.close()

    @property
    def segment_fds(self) -> list[int]:
        """The shared segment files' descriptors, one per segment (empty unless shared)."""
        return self.memory.segment_fds

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every segment is live or left out; True when all have settled within `timeout`."""
        return self.memory.wait_all(timeout)

    @classmethod
    def for_capacity(cls, cpu_bytes: int, object_bytes: int, **options: Any) -> "HostArena":
        """As many slots as fit in `cpu_bytes`."""
        return cls(slots_for_capacity(cpu_bytes, object_bytes), object_bytes, **options)

    @property
    def contiguous(self) -> bool:
        """Whether every slot lies in [base_address, base_address + total_bytes): false where the device runtime
        allocated the segments (aclrtMallocHost); `registration_ranges()` covers both."""
        return self.memory.contiguous

    @property
    def total_bytes(self) -> int:
        """The arena's address range from `base_address` (every slot lies in it when `contiguous`): the slots' bytes,
        plus page rounding between segments where hugepages need it."""
        return self.memory.span_bytes

    @property
    def base_address(self) -> int:
        return self.memory.base_address

    def registration_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) a remote transfer engine registers to reach the slots (memory.registration_ranges)."""
        return self.memory.registration_ranges()

    def add_live_listener(self, listener: Callable[[int, int], None]) -> None:
        """`listener(address, bytes)` for each allocated segment that goes live later (see SegmentedMemory)."""
        self.memory.add_live_listener(listener)

    @property
    def ready_slots(self) -> int:
        """How many leading slots are usable now."""
        return self.memory.ready_slots

    def usable_ranges(self) -> tuple[tuple[int, int], ...]:
        """[first, end) slot ranges of the live segments: the only slots the index may hand out."""
        return self.memory.usable_ranges()

    def segment_stats(self) -> dict[str, int]:
        """arena_bytes (slots' bytes), arena_live_bytes (in live segments), segments_live, segments_total."""
        return {Metric.ARENA_BYTES: self.num_slots * self.slot_bytes, Metric.ARENA_LIVE_BYTES: self.memory.live_bytes,
                Metric.SEGMENTS_LIVE: self.memory.segments_live, Metric.SEGMENTS_TOTAL: len(self.memory.segments)}

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"arena slot {slot} is out of range (the arena has {self.num_slots} slots)")

    def _segment(self, slot: int) -> tuple[int, tuple[np.ndarray, torch.Tensor]]:
        """`slot`'s offset inside its segment, and that segment's array and tensor (made on first use)."""
        self._check(slot)
        index, within = divmod(slot, self.memory.slots_per_segment)
        view = self._views[index]
        if view is None:
            array = self.memory.segment_view(index)
            # a first use may come from a thread in vLLM's inference mode: the view must not become an inference
            # tensor, which the io threads could then not write into
            with torch.inference_mode(False):
                view = self._views[index] = (array, torch.from_numpy(array))
        return within * self.slot_bytes, view

    def slot(self, slot: int) -> torch.Tensor:
        """The chunk object in `slot`: a uint8 tensor of `object_bytes` (what the transfer kernels read and write)."""
        start, (_, tensor) = self._segment(slot)
        return tensor[start:start + self.object_bytes]

    def slot_view(self, slot: int) -> memoryview:
        """The same bytes as a writable memoryview (what the disk and Mooncake tiers read and write)."""
        return memoryview(self.slot_array(slot))

    def slot_array(self, slot: int) -> np.ndarray:
        start, (array, _) = self._segment(slot)
        return array[start:start + self.object_bytes]

    def sealed_view(self, slot: int) -> memoryview:
        """The chunk object and its envelope trailer, one contiguous writable range of `sealed_bytes` (what goes to
        disk and Mooncake, and what a promotion writes)."""
        return memoryview(self.sealed_array(slot))

    def sealed_array(self, slot: int) -> np.ndarray:
        start, (array, _) = self._segment(slot)
        return array[start:start + self.sealed_bytes]

    def slot_address(self, slot: int) -> int:
        self._check(slot)
        return self.memory.slot_address(slot)


def slot_bytes_for(object_bytes: int) -> int:
    """One arena slot: the chunk object and its envelope trailer, rounded up to whole 4 KiB pages (on every host)."""
    return align_up(object_bytes + ENVELOPE_BYTES, SLOT_ALIGN_BYTES)


def slots_for_capacity(cpu_bytes: int, object_bytes: int) -> int:
    """How many arena slots `cpu_bytes` buys for chunk objects of `object_bytes` (the index and every worker agree)."""
    slot_bytes = slot_bytes_for(object_bytes)
    if cpu_bytes < slot_bytes:
        raise ValueError(f"cpu_bytes {cpu_bytes} is smaller than one chunk slot ({slot_bytes} B for a "
                         f"{object_bytes} B chunk object and its envelope); raise cpu_bytes or lower chunk_tokens")
    return cpu_bytes // slot_bytes
