"""The host arena (DESIGN §7, tier L1): fixed-size chunk slots in separately mapped and registered segments.

Every worker process keeps an identical arena (same slot count and slot size), so a slot number chosen by the
scheduler-side index means the same place on every rank. The arena holds bytes only; which slot holds which chunk,
and in which state, is the index's business. Its memory is anonymous mmap segments (`segments.py`: hugepages, NUMA
placement, no power-of-two rounding), registered with the accelerator one segment at a time in the background when
one is present (the transfer kernels DMA straight into it). Slots never straddle segments; only slots of live
segments (`usable_ranges`) may be handed out, and the workers report those to the scheduler's index.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from ..ops.backend import npu_available
from ..ops.plan import align_up
from .envelope import ENVELOPE_BYTES
from .segments import DEFAULT_SEGMENT_BYTES, HostRegistrar, SegmentedMemory, numa_nodes

logger = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096  # page-aligned slots: DMA engines and O_DIRECT-style readers like whole pages

__all__ = ["HostArena", "SLOT_ALIGN_BYTES", "accelerator_present", "device_registrar", "numa_nodes",
           "slot_bytes_for", "slots_for_capacity"]


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU can page-lock host memory for this process."""
    return torch.cuda.is_available() or npu_available()


def device_registrar() -> tuple[Optional[HostRegistrar], Optional[int]]:
    """The registrar of this process's accelerator and the NUMA node it hangs off (None, None without one)."""
    if torch.cuda.is_available():
        from ..ops.cuda_backend import CudaHostRegistrar, cuda_device_numa_node

        index = torch.cuda.current_device()
        return CudaHostRegistrar(index), cuda_device_numa_node(index)
    if npu_available():
        from ..ops.npu_backend import NpuHostRegistrar

        return NpuHostRegistrar(torch.npu.current_device()), None  # type: ignore[attr-defined]
    return None, None


class HostArena:
    """`num_slots` slots, each holding a chunk object of `object_bytes` (what the transfer kernels see) followed by
    its envelope trailer (`sealed_view`: what disk and Mooncake see), every slot starting on a page boundary.

    `pinned` (None: when an accelerator is present) registers every segment with the device; `registrar` overrides
    which one (tests). `numa_node` binds the pages to a node; unset, they prefer the device's node where it is known.
    The constructor returns once the first segment is usable (registration of the rest goes on in the background);
    `wait_ready()` blocks until every segment has settled."""

    def __init__(self, num_slots: int, object_bytes: int, *, pinned: Optional[bool] = None,
                 numa_node: Optional[int] = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 hugepages: str = "auto", prefault: bool = True, registrar: Optional[HostRegistrar] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host arena needs at least one slot (num_slots={num_slots}); raise cpu_bytes")
        if object_bytes < 1:
            raise ValueError(f"object_bytes must be positive, got {object_bytes}")
        self.num_slots = num_slots
        self.object_bytes = object_bytes
        self.sealed_bytes = object_bytes + ENVELOPE_BYTES
        self.slot_bytes = slot_bytes_for(object_bytes)
        self.pinned = (accelerator_present() or registrar is not None) if pinned is None else pinned
        self.numa_node = numa_node
        total = num_slots * self.slot_bytes
        device_node = None
        if self.pinned and registrar is None:
            registrar, device_node = device_registrar()
            if registrar is None:
                raise MemoryError(f"could not allocate a {total / 2**30:.2f} GiB host arena (pinned): no CUDA GPU or "
                                  "Ascend NPU here to register it with; set pinned: false")
        elif not self.pinned:
            registrar = None
        self.memory = SegmentedMemory(num_slots, self.slot_bytes, segment_bytes=segment_bytes, hugepages=hugepages,
                                      registrar=registrar, numa_node=numa_node, preferred_node=device_node,
                                      prefault=prefault)
        # one tensor per segment (its own storage): host copies are merged only within a segment, never across two
        buffer = self.memory.buffer()
        whole = np.frombuffer(buffer, dtype=np.uint8)
        self._numpy = whole
        self._segment_tensors = [torch.from_numpy(whole[s.address - self.memory.base_address:][:s.used_bytes])
                                 for s in self.memory.segments]
        self.memory.start()
        if not self.memory.wait_first():
            errors = sorted({s.error for s in self.memory.segments})
            self.memory.close()
            raise MemoryError(f"could not allocate a {total / 2**30:.2f} GiB host arena (pinned): no segment could be "
                              f"registered ({'; '.join(errors)})")
        logger.info("host arena: %d slots x %d B (%.2f GiB) in %d segment(s) of up to %d slots, %s, hugepages %s%s",
                    num_slots, self.slot_bytes, total / 2**30, len(self.memory.segments),
                    self.memory.slots_per_segment, registrar.name if registrar is not None else "pageable",
                    hugepages if hugepages != "auto" else ("auto (THP)" if self.memory.transparent else "auto (none)"),
                    "" if numa_node is None else f", NUMA node {numa_node}")

    def close(self) -> None:
        """Stops background registration and unregisters every segment now instead of whenever the arena is
        collected: unregistering waits for the device, so the owner picks a moment when no stream is held back.
        The slots stay readable."""
        self.memory.close()

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every segment is live or left out; True when all have settled within `timeout`."""
        return self.memory.wait_all(timeout)

    @classmethod
    def for_capacity(cls, cpu_bytes: int, object_bytes: int, **options: Any) -> "HostArena":
        """As many slots as fit in `cpu_bytes`."""
        return cls(slots_for_capacity(cpu_bytes, object_bytes), object_bytes, **options)

    @property
    def total_bytes(self) -> int:
        """The arena's address range from `base_address` (every slot lies in it): the slots' bytes, plus page
        rounding between segments where hugepages need it."""
        return self.memory.span_bytes

    @property
    def base_address(self) -> int:
        return self.memory.base_address

    @property
    def ready_slots(self) -> int:
        """How many leading slots are usable now."""
        return self.memory.ready_slots

    def usable_ranges(self) -> tuple[tuple[int, int], ...]:
        """[first, end) slot ranges of the live segments: the only slots the index may hand out."""
        return self.memory.usable_ranges()

    def segment_stats(self) -> dict[str, int]:
        """arena_bytes (slots' bytes), arena_live_bytes (in live segments), segments_live, segments_total."""
        return {"arena_bytes": self.num_slots * self.slot_bytes, "arena_live_bytes": self.memory.live_bytes,
                "segments_live": self.memory.segments_live, "segments_total": len(self.memory.segments)}

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"arena slot {slot} is out of range (the arena has {self.num_slots} slots)")

    def slot(self, slot: int) -> torch.Tensor:
        """The chunk object in `slot`: a uint8 tensor of `object_bytes` (what the transfer kernels read and write)."""
        self._check(slot)
        segment, within = divmod(slot, self.memory.slots_per_segment)
        start = within * self.slot_bytes
        return self._segment_tensors[segment][start:start + self.object_bytes]

    def slot_view(self, slot: int) -> memoryview:
        """The same bytes as a writable memoryview (what the disk and Mooncake tiers read and write)."""
        return memoryview(self.slot_array(slot))

    def slot_array(self, slot: int) -> np.ndarray:
        self._check(slot)
        start = self.memory.offset(slot)
        return self._numpy[start:start + self.object_bytes]

    def sealed_view(self, slot: int) -> memoryview:
        """The chunk object and its envelope trailer, one contiguous writable range of `sealed_bytes` (what goes to
        disk and Mooncake, and what a promotion writes)."""
        return memoryview(self.sealed_array(slot))

    def sealed_array(self, slot: int) -> np.ndarray:
        self._check(slot)
        start = self.memory.offset(slot)
        return self._numpy[start:start + self.sealed_bytes]

    def slot_address(self, slot: int) -> int:
        self._check(slot)
        return self.memory.base_address + self.memory.offset(slot)


def slot_bytes_for(object_bytes: int) -> int:
    """One arena slot: the chunk object and its envelope trailer, rounded up to whole pages."""
    return align_up(object_bytes + ENVELOPE_BYTES, SLOT_ALIGN_BYTES)


def slots_for_capacity(cpu_bytes: int, object_bytes: int) -> int:
    """How many arena slots `cpu_bytes` buys for chunk objects of `object_bytes` (the index and every worker agree)."""
    slot_bytes = slot_bytes_for(object_bytes)
    if cpu_bytes < slot_bytes:
        raise ValueError(f"cpu_bytes {cpu_bytes} is smaller than one chunk slot ({slot_bytes} B for a "
                         f"{object_bytes} B chunk object and its envelope); raise cpu_bytes or lower chunk_tokens")
    return cpu_bytes // slot_bytes
