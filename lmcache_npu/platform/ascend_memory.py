"""The three ways an arena segment becomes DMA-able on an Ascend NPU (lmcache_npu._npu's calls), and the pinning
chain a host gets from its facts (`ascend_host.host_memory_chain`: driver, kernel, SoC) and the `npu_host_memory`
key."""

from __future__ import annotations

import logging
from typing import Optional

from .ascend_host import AscendHostFacts, NpuHostMethod, host_memory_chain, probe_ascend_host
from .host_memory import HostMemoryPath, SegmentPinning
from .npu_runtime import NpuRuntime

logger = logging.getLogger(__name__)


class AclHostRegister:
    """aclrtHostRegister(MAPPED) of our mmap'd segment: keeps our hugepages and NUMA placement."""

    name = NpuHostMethod.HOST_REGISTER.value

    def __init__(self, runtime: NpuRuntime) -> None:
        self.runtime = runtime

    def bind_thread(self) -> None:
        self.runtime.bind_thread()

    def register(self, address: int, nbytes: int) -> int:
        return int(self.runtime.native.host_register(address, nbytes))

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
        return int(self.runtime.native.hal_register(address, nbytes))

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
