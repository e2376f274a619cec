"""Host memory on an NVIDIA GPU: arena segments page-locked and mapped with cudaHostRegister, and the GPU's NUMA
node (so the arena's pages sit next to it)."""

from __future__ import annotations

from typing import Optional

import torch

from .numa import pci_numa_node

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # every context sees it, and kernels may address it directly


class CudaHostRegistrar:
    """Page-locks host arena segments with cudaHostRegister (portable, mapped), one call per segment, so no single
    registration has to cover the whole arena and kernels reach every segment through UVA."""

    name = "cudaHostRegister"

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        # the owner's thread gets the primary context now: a thread without a current context sees no registration
        # (cudaPointerGetAttributes calls the arena unregistered there; seen on the H100, 2026-11-25)
        torch.cuda.synchronize(device_index)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device_index)
        torch.cuda.synchronize(self.device_index)  # the primary context current here too, before cudaHostRegister

    def register(self, address: int, nbytes: int) -> int:
        error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if error != 0:
            raise MemoryError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB at 0x{address:x} failed (CUDA error "
                              f"{error}); lower cpu_bytes or raise the locked-memory limit (ulimit -l)")
        return address  # UVA: the device addresses registered host memory at its host address

    def unregister(self, address: int, nbytes: int) -> None:
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
        if error != 0:
            raise RuntimeError(f"cudaHostUnregister at 0x{address:x} failed (CUDA error {error})")


def cuda_device_numa_node(device_index: int) -> Optional[int]:
    """The NUMA node of the GPU's PCI root (None where the properties or the firmware do not say)."""
    props = torch.cuda.get_device_properties(device_index)
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    return pci_numa_node(f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0")
