"""The host arena (DESIGN §7, tier L1): one host allocation split into fixed-size chunk slots.

Every worker process keeps an identical arena (same slot count and slot size), so a slot number chosen by the
scheduler-side index means the same place on every rank. The arena holds bytes only; which slot holds which chunk,
and in which state, is the index's business. Memory is page-locked when an accelerator is present (the transfer
kernels DMA straight into it) and can be placed on one NUMA node (the node next to the accelerator's PCIe root).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import weakref
from typing import Optional

import numpy as np
import torch

from ..ops.backend import npu_available
from ..ops.plan import align_up
from .envelope import ENVELOPE_BYTES

logger = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096  # page-aligned slots: DMA engines and O_DIRECT-style readers like whole pages

_MPOL_DEFAULT = 0
_MPOL_BIND = 2
_SET_MEMPOLICY_SYSCALL = {"x86_64": 238, "aarch64": 237}


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU can page-lock host memory for this process."""
    return torch.cuda.is_available() or npu_available()


def numa_nodes() -> list[int]:
    """NUMA nodes with memory on this host (empty where the kernel does not expose them)."""
    try:
        names = os.listdir("/sys/devices/system/node")
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


class _BoundToNode:
    """Binds the calling thread's future page allocations to one NUMA node, then restores the default policy.

    The arena's pages are faulted in (zeroed or page-locked) inside this scope, so they land on the node."""

    def __init__(self, node: int) -> None:
        nodes = numa_nodes()
        if node not in nodes:
            raise ValueError(f"numa_node {node} is not a NUMA node of this host (nodes: {nodes or 'none exposed'})")
        syscall = _SET_MEMPOLICY_SYSCALL.get(platform.machine())
        if syscall is None:
            raise ValueError(f"numa_node is not supported on {platform.machine()}")
        self._syscall = syscall
        self._node = node
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _set(self, mode: int, mask: Optional[ctypes.Array]) -> None:
        max_node = 0 if mask is None else len(mask) * 64 + 1
        if self._libc.syscall(self._syscall, mode, mask, ctypes.c_ulong(max_node)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"set_mempolicy for NUMA node {self._node}: {os.strerror(err)}")

    def __enter__(self) -> "_BoundToNode":
        mask = (ctypes.c_ulong * (self._node // 64 + 1))()
        mask[self._node // 64] = 1 << (self._node % 64)
        self._set(_MPOL_BIND, mask)
        return self

    def __exit__(self, *exc: object) -> None:
        self._set(_MPOL_DEFAULT, None)


class HostArena:
    """`num_slots` slots, each holding a chunk object of `object_bytes` (what the transfer kernels see) followed by
    its envelope trailer (`sealed_view`: what disk and Mooncake see), every slot starting on a page boundary."""

    def __init__(self, num_slots: int, object_bytes: int, *, pinned: Optional[bool] = None,
                 numa_node: Optional[int] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host arena needs at least one slot (num_slots={num_slots}); raise cpu_bytes")
        if object_bytes < 1:
            raise ValueError(f"object_bytes must be positive, got {object_bytes}")
        self.num_slots = num_slots
        self.object_bytes = object_bytes
        self.sealed_bytes = object_bytes + ENVELOPE_BYTES
        self.slot_bytes = slot_bytes_for(object_bytes)
        self.pinned = accelerator_present() if pinned is None else pinned
        self.numa_node = numa_node
        self._cuda_registration: Optional[weakref.finalize] = None  # undoes cudaHostRegister, once
        total = num_slots * self.slot_bytes
        try:
            if numa_node is None:
                self._buffer = self._allocate(total)
            else:
                with _BoundToNode(numa_node):
                    self._buffer = self._allocate(total)
        except RuntimeError as exc:  # torch reports allocation failures (including pinning) as RuntimeError
            raise MemoryError(f"could not allocate a {total / 2**30:.2f} GiB host arena "
                              f"({'pinned' if self.pinned else 'pageable'}): {exc}") from exc
        self._slots = self._buffer.view(num_slots, self.slot_bytes)
        self._numpy = self._buffer.numpy()
        logger.info("host arena: %d slots x %d B (%.2f GiB, %s%s)", num_slots, self.slot_bytes, total / 2**30,
                    "pinned" if self.pinned else "pageable", "" if numa_node is None else f", NUMA node {numa_node}")

    def _allocate(self, total: int) -> torch.Tensor:
        # zeros, not empty: touching every page now puts it on the bound node and keeps stale heap bytes out of stores;
        # one spare page lets the slots start on a page boundary whatever alignment the allocator gives
        if self.pinned and not torch.cuda.is_available():
            # torch_npu: its pinned host allocator (power-of-two rounding like CUDA's caching host allocator)
            rounded = 1 << (total + SLOT_ALIGN_BYTES - 1).bit_length()
            if rounded > total * 1.05:
                logger.warning("host arena: the pinned allocator rounds %.2f GiB up to %.2f GiB; a cpu_bytes just "
                               "under a power of two wastes less", total / 2**30, rounded / 2**30)
            raw = torch.zeros(total + SLOT_ALIGN_BYTES, dtype=torch.uint8, pin_memory=True)
        else:
            raw = torch.zeros(total + SLOT_ALIGN_BYTES, dtype=torch.uint8)
        skip = -raw.data_ptr() % SLOT_ALIGN_BYTES
        buffer = raw[skip:skip + total]
        if self.pinned and torch.cuda.is_available():
            # CUDA: page-lock exactly these bytes (pin_memory=True would round the allocation up to a power of two)
            self._cuda_registration = _register_with_cuda(self, buffer, raw)
        return buffer

    def close(self) -> None:
        """Unregisters the memory from CUDA now instead of whenever the arena is collected: cudaHostUnregister waits
        for the device, so the owner picks a moment when no stream is held back. The slots stay readable."""
        if self._cuda_registration is not None:
            self._cuda_registration()

    @classmethod
    def for_capacity(cls, cpu_bytes: int, object_bytes: int, **options: object) -> "HostArena":
        """As many slots as fit in `cpu_bytes`."""
        return cls(slots_for_capacity(cpu_bytes, object_bytes), object_bytes, **options)  # type: ignore[arg-type]

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def base_address(self) -> int:
        return self._buffer.data_ptr()

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"arena slot {slot} is out of range (the arena has {self.num_slots} slots)")

    def slot(self, slot: int) -> torch.Tensor:
        """The chunk object in `slot`: a uint8 tensor of `object_bytes` (what the transfer kernels read and write)."""
        self._check(slot)
        return self._slots[slot, : self.object_bytes]

    def slot_view(self, slot: int) -> memoryview:
        """The same bytes as a writable memoryview (what the disk and Mooncake tiers read and write)."""
        return memoryview(self.slot_array(slot))

    def slot_array(self, slot: int) -> np.ndarray:
        self._check(slot)
        start = slot * self.slot_bytes
        return self._numpy[start:start + self.object_bytes]

    def sealed_view(self, slot: int) -> memoryview:
        """The chunk object and its envelope trailer, one contiguous writable range of `sealed_bytes` (what goes to
        disk and Mooncake, and what a promotion writes)."""
        return memoryview(self.sealed_array(slot))

    def sealed_array(self, slot: int) -> np.ndarray:
        self._check(slot)
        start = slot * self.slot_bytes
        return self._numpy[start:start + self.sealed_bytes]

    def slot_address(self, slot: int) -> int:
        self._check(slot)
        return self.base_address + slot * self.slot_bytes


_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # every context sees it, and kernels may address it directly


def _register_with_cuda(owner: object, buffer: torch.Tensor, raw: torch.Tensor) -> weakref.finalize:
    """cudaHostRegister the buffer; unregistered when `owner` goes away (or the returned finalizer is called), before
    `raw`'s memory is freed."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    if int(error) != 0:
        raise MemoryError(f"cudaHostRegister of a {buffer.numel() / 2**30:.2f} GiB host arena failed (CUDA error "
                          f"{int(error)}); lower cpu_bytes or raise the locked-memory limit (ulimit -l)")
    return weakref.finalize(owner, _unregister_with_cuda, buffer.data_ptr(), raw)


def _unregister_with_cuda(address: int, raw: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
    del raw  # the memory goes only after it is unregistered


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
