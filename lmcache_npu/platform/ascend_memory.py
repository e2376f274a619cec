"""The three ways an arena segment becomes DMA-able on an Ascend NPU (lmcache_npu._npu's calls), and the pinning
chain a host gets from its facts (`ascend_host.host_memory_chain`: driver, kernel, SoC) and the `npu_host_memory`
key.

A registration that succeeds is not yet proof: aclrtMemcpyAsync is asynchronous only from memory the runtime sees as
page-locked, and from anything else it copies synchronously (on torch_npu's queue thread, stalling the model). So a
registrar asks aclrtPointerGetAttributes about every range it registers and undoes a registration the runtime does
not report as host memory, which moves the arena's first segment on to the next path of the chain.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from .ascend_host import AscendHostFacts, NpuHostMethod, host_memory_chain, probe_ascend_host
from .host_memory import HostMemoryPath, SegmentPinning
from .npu_runtime import NpuRuntime

logger = logging.getLogger(__name__)

# What aclrtPointerGetAttributes reports for page-locked host memory (torch_npu's is_pinned asks for "host"; NUMA-bound
# host memory ACL allocates is page-locked too); "unknown": a toolkit without the call, which cannot be checked.
PAGE_LOCKED_LOCATIONS = ("host", "host_numa")


def require_page_locked(runtime: NpuRuntime, path: str, address: int, undo: Callable[[], None]) -> None:
    """Undoes a registration (and raises MemoryError naming `path` and the answer) unless the runtime reports the
    range as page-locked host memory."""
    location = str(runtime.native.pointer_attributes(address)["location"])
    if location in PAGE_LOCKED_LOCATIONS:
        return
    if location == "unknown":
        logger.warning("%s: this toolkit has no aclrtPointerGetAttributes, so whether ACL sees the registered "
                       "segment as page-locked cannot be checked (doctor --selftest measures it)", path)
        return
    undo()
    raise MemoryError(f"{path} succeeded but aclrtPointerGetAttributes reports the segment as {location!r} memory, "
                      "not page-locked host memory: every aclrtMemcpyAsync from it would run synchronously")


class AclHostRegister:
    """aclrtHostRegisterV2(PINNED | MAPPED) of our mmap'd segment (aclrtHostRegister(MAPPED) on toolkits without V2):
    keeps our hugepages and NUMA placement. `api` names the call that registered the last range."""

    name = NpuHostMethod.HOST_REGISTER.value

    def __init__(self, runtime: NpuRuntime) -> None:
        self.runtime = runtime
        self.api: Optional[str] = None

    def bind_thread(self) -> None:
        self.runtime.bind_thread()

    def register(self, address: int, nbytes: int) -> int:
        device_address, api = self.runtime.native.host_register(address, nbytes)
        require_page_locked(self.runtime, str(api), address, lambda: self.runtime.native.host_unregister(address))
        self.api = str(api)
        return int(device_address)

    def unregister(self, address: int, nbytes: int) -> None:
        self.runtime.native.host_unregister(address)


class AclMallocHost:
    """aclrtMallocHost: ACL allocates the segment, page-locked by construction (what torch_npu itself treats as
    pinned); the only path on 310P and on host kernels <= 5.10."""

    name = NpuHostMethod.MALLOC_HOST.value

    def __init__(self, runtime: NpuRuntime) -> None:
        self.runtime = runtime

    def bind_thread(self) -> None:
        self.runtime.bind_thread()

    def allocate(self, nbytes: int) -> int:
        return int(self.runtime.native.malloc_host(nbytes))

    def free(self, address: int) -> None:
        self.runtime.native.free_host(address)


class HalHostRegister:
    """mlock, then the driver's halHostRegister of our mmap'd segment: drivers older than 25, where
    aclrtHostRegister is unavailable (needs a memlock limit that covers the arena, or CAP_IPC_LOCK)."""

    name = NpuHostMethod.HAL_REGISTER.value

    def __init__(self, runtime: NpuRuntime) -> None:
        self.runtime = runtime

    def bind_thread(self) -> None:
        self.runtime.bind_thread()

    def register(self, address: int, nbytes: int) -> int:
        device_address = int(self.runtime.native.hal_register(address, nbytes))
        require_page_locked(self.runtime, self.name, address,
                            lambda: self.runtime.native.hal_unregister(address, nbytes))
        return device_address

    def unregister(self, address: int, nbytes: int) -> None:
        self.runtime.native.hal_unregister(address, nbytes)


_PATHS = {NpuHostMethod.HOST_REGISTER: AclHostRegister, NpuHostMethod.MALLOC_HOST: AclMallocHost,
          NpuHostMethod.HAL_REGISTER: HalHostRegister}


def npu_segment_pinning(runtime: NpuRuntime, requested: str = "auto",
                        facts: Optional[AscendHostFacts] = None) -> SegmentPinning:
    """The paths this host's arena tries, in order; a MemoryError naming `npu_host_memory` and every reason when the
    facts leave none."""
    facts = facts if facts is not None else probe_ascend_host()
    chain = host_memory_chain(facts, requested)
    logger.info("host arena on %s: %s", facts.describe(), chain.describe())
    paths: list[HostMemoryPath] = [_PATHS[method](runtime) for method in chain.methods]
    left_out = [(method.value, reason) for method, reason in chain.skipped] + [("note", n) for n in chain.notes]
    try:
        return SegmentPinning(paths, left_out)
    except MemoryError as exc:
        raise MemoryError(f"{exc}; the npu_host_memory key picks the way (auto, aclrtHostRegister, aclrtMallocHost, "
                          "halHostRegister)") from None
