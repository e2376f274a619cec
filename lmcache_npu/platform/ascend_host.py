"""Facts about an Ascend host, and the rule that turns them into the order in which the arena tries to make its
host segments DMA-able (the `npu_host_memory` key).

Stdlib only at import time: `doctor` and the arena both read it, on machines with and without CANN.

Where each rule comes from (finding B4 of the 2026-11 first-contact audit):

* `aclrtHostRegister` is not supported on the Atlas inference products (310P) in the CANN API reference, and
  LMCache-Ascend never registers host memory on a 310 (`csrc/common/mem_alloc.cpp`, `alloc_pinned_ptr`);
* on OS kernels 5.10 and older the same page says memory that `aclrtMallocHost` did not allocate "causes exceptions"
  when registered (openEuler 22.03 LTS ships 5.10);
* LMCache-Ascend uses `aclrtHostRegister` only with a driver of major version 25 or newer and `halHostRegister` +
  `mlock` below (`csrc/common/managed_mem.cpp`, `is_version_at_least_25`; its deployment guide: IPC_LOCK and a
  memlock limit are needed below 25 only).
"""

from __future__ import annotations

import os
import platform
import re
import resource
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Mapping, Optional

from .npu_smi import Runner, detected_soc, driver_version_from_table, run_command, soc_family


NPU_HOST_MEMORY_KEY = "npu_host_memory"
HOST_REGISTER_MIN_DRIVER = 25  # LMCache-Ascend: aclrtHostRegister from driver 25 on, halHostRegister below
NEEDS_MALLOC_HOST_KERNEL = (5, 10)  # CANN: on kernels <= 5.10 registered memory must come from aclrtMallocHost
INSTALL_INFO = "/etc/ascend_install.info"
DEFAULT_ASCEND_PATH = "/usr/local/Ascend"
CAP_IPC_LOCK = 14  # linux/capability.h


class NpuHostMethod(str, Enum):
    HOST_REGISTER = "aclrtHostRegister"  # our mmap'd arena segment, registered with ACL (MAPPED)
    MALLOC_HOST = "aclrtMallocHost"  # ACL allocates the segment itself (pinned by construction)
    HAL_REGISTER = "halHostRegister"  # our mmap'd segment, mlock'ed and registered with the driver (libascend_hal)


AUTO_ORDER = (NpuHostMethod.HOST_REGISTER, NpuHostMethod.MALLOC_HOST, NpuHostMethod.HAL_REGISTER)


@dataclass(frozen=True)
class AscendHostFacts:
    soc: Optional[str]  # "Ascend910B1", "Ascend910_9391", "Ascend310P3", ...
    driver_version: Optional[tuple[int, ...]]  # e.g. (25, 0) from the driver's version file
    driver_version_text: Optional[str]  # as the file says it, e.g. "25.0.rc1.1"
    kernel_release: str  # platform.release(), e.g. "5.10.0-60.18.0.50.oe2203.aarch64"
    memlock_bytes: Optional[int]  # RLIMIT_MEMLOCK soft limit, None = unlimited

    def describe(self) -> str:
        memlock = "unlimited" if self.memlock_bytes is None else f"{self.memlock_bytes / 2**20:.0f} MiB"
        return (f"SoC {self.soc or 'unknown'}, driver {self.driver_version_text or 'unknown'}, kernel "
                f"{self.kernel_release or 'unknown'}, memlock {memlock}")


@dataclass(frozen=True)
class HostMemoryChain:
    methods: tuple[NpuHostMethod, ...]  # to try in this order; empty = none can work here
    skipped: tuple[tuple[NpuHostMethod, str], ...]  # left out, each with the reason (facts that rule it out)
    notes: tuple[str, ...] = ()  # facts that could not be read, so no rule could use them

    def describe(self) -> str:
        """One line for logs and doctor."""
        if self.methods:
            text = f"{NPU_HOST_MEMORY_KEY}: " + " -> ".join(m.value for m in self.methods)
        else:
            text = f"{NPU_HOST_MEMORY_KEY}: no method can make host memory DMA-able here"
        if self.skipped:
            text += "; left out: " + "; ".join(f"{m.value} ({reason})" for m, reason in self.skipped)
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return text


def parse_driver_version(text: str) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(numbers, text) of the driver version in `<driver>/version.info` (`Version=24.1.rc1`) or in the `npu-smi info`
    header (`Version: 25.0.rc1.1`); the numbers stop at the first part that is not one ("25.0.rc1.1" -> (25, 0)).
    Anything else is (None, None): unknown, never an exception."""
    if not isinstance(text, str):
        return None, None
    match = re.search(r"^\s*Version\s*=\s*(\S+)\s*$", text, re.MULTILINE | re.IGNORECASE)
    version = match.group(1) if match else driver_version_from_table(text)
    if not version or not re.match(r"^\d+(\.|$)", version):
        return None, None
    numbers = []
    for part in version.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers), version


def kernel_version(release: str) -> Optional[tuple[int, int]]:
    """(major, minor) of `uname -r` ("5.10.0-60.18.0.50.oe2203.aarch64" -> (5, 10)), None when it is unreadable."""
    match = re.match(r"^\s*(\d+)\.(\d+)", release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _ruled_out(facts: AscendHostFacts) -> tuple[dict[NpuHostMethod, list[str]], list[str]]:
    """Each method the facts rule out with its reasons, and the facts that are unknown."""
    out: dict[NpuHostMethod, list[str]] = {m: [] for m in AUTO_ORDER}
    notes: list[str] = []
    family = soc_family(facts.soc)
    if family == "310p":
        out[NpuHostMethod.HOST_REGISTER].append(
            f"SoC {facts.soc}: CANN's aclrtHostRegister page lists the 310P (Atlas inference) products as unsupported")
        out[NpuHostMethod.HAL_REGISTER].append(
            f"SoC {facts.soc}: LMCache-Ascend never registers host memory on 310 (mem_alloc.cpp), so this path is "
            "untried there")
    elif facts.soc is None:
        notes.append("SoC unknown (no npu-smi report)")
    kernel = kernel_version(facts.kernel_release)
    if kernel is None:
        notes.append(f"kernel release {facts.kernel_release!r} unreadable")
    elif kernel <= NEEDS_MALLOC_HOST_KERNEL:
        reason = (f"kernel {facts.kernel_release} <= 5.10: CANN says host memory aclrtMallocHost did not allocate "
                  "causes exceptions when registered")
        out[NpuHostMethod.HOST_REGISTER].append(reason)
        out[NpuHostMethod.HAL_REGISTER].append(reason)
    if facts.driver_version is None:
        notes.append("driver version unknown (no readable version.info or npu-smi header): the order assumes a "
                     f"driver >= {HOST_REGISTER_MIN_DRIVER}")
    elif facts.driver_version[0] < HOST_REGISTER_MIN_DRIVER:
        out[NpuHostMethod.HOST_REGISTER].append(
            f"driver {facts.driver_version_text} < {HOST_REGISTER_MIN_DRIVER}: aclrtHostRegister is unavailable "
            f"(LMCache-Ascend switches to halHostRegister below {HOST_REGISTER_MIN_DRIVER})")
    return out, notes


def parse_requested(requested: str) -> Optional[NpuHostMethod]:
    """None for "auto", else the method named; any other value is a ValueError naming the key and the choices."""
    if requested == "auto":
        return None
    for method in NpuHostMethod:
        if requested == method.value:
            return method
    raise ValueError(f"{NPU_HOST_MEMORY_KEY} must be 'auto' or one of "
                     f"{', '.join(repr(m.value) for m in NpuHostMethod)}, got {requested!r}")


def host_memory_chain(facts: AscendHostFacts, requested: str = "auto") -> HostMemoryChain:
    """The methods the arena tries, in order, on a host with these facts. A requested method is the only one tried;
    when the facts rule it out the chain is empty, with the reason, and the arena refuses to start naming the key."""
    method = parse_requested(requested)
    out, notes = _ruled_out(facts)
    candidates = AUTO_ORDER if method is None else (method,)
    methods = tuple(m for m in candidates if not out[m])
    skipped = [(m, "; ".join(out[m])) for m in candidates if out[m]]
    if method is not None:
        skipped += [(m, f"{NPU_HOST_MEMORY_KEY} is {method.value!r}") for m in AUTO_ORDER if m is not method]
        if not methods:
            notes.append(f"{NPU_HOST_MEMORY_KEY} asks for {method.value} alone: set it to 'auto' or to a method "
                         "this host allows")
    return HostMemoryChain(methods, tuple(skipped), tuple(notes))


def cap_ipc_lock(proc_status: str) -> bool:
    """Whether `/proc/self/status`'s effective capabilities include CAP_IPC_LOCK (mlock beyond RLIMIT_MEMLOCK)."""
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", proc_status or "", re.MULTILINE)
    return bool(match) and bool(int(match.group(1), 16) >> CAP_IPC_LOCK & 1)


def can_lock(memlock_bytes: Optional[int], needed_bytes: int, has_cap_ipc_lock: bool) -> bool:
    """Whether this process may mlock `needed_bytes` (halHostRegister's segments are mlock'ed first): the kernel asks
    only RLIMIT_MEMLOCK or CAP_IPC_LOCK (mm/mlock.c), never the uid; root in a default Docker container lacks it."""
    return memlock_bytes is None or memlock_bytes >= needed_bytes or has_cap_ipc_lock


def _read_text(path: str) -> Optional[str]:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def driver_dir(install_info: Optional[str]) -> str:
    """`<Driver_Install_Path_Param>/driver` from /etc/ascend_install.info, else the default install's."""
    match = re.search(r"^\s*Driver_Install_Path_Param\s*=\s*(\S+)\s*$", install_info or "", re.MULTILINE)
    return os.path.join(match.group(1) if match else DEFAULT_ASCEND_PATH, "driver")


def probe_driver_version(read_file: Callable[[str], Optional[str]] = _read_text,
                         run: Runner = run_command) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """The driver's version from its version.info, else from the `npu-smi info` header; (None, None) if neither."""
    base = driver_dir(read_file(INSTALL_INFO))
    for path in dict.fromkeys((os.path.join(base, "version.info"),
                               os.path.join(DEFAULT_ASCEND_PATH, "driver", "version.info"))):
        numbers, text = parse_driver_version(read_file(path) or "")
        if numbers:
            return numbers, text
    return parse_driver_version(run(["npu-smi", "info"]) or "")


def probe_ascend_host(read_file: Callable[[str], Optional[str]] = _read_text, run: Runner = run_command,
                      release: Callable[[], str] = platform.release,
                      getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
                      environ: Optional[Mapping[str, str]] = None) -> AscendHostFacts:
    """This host's facts; every reader is injectable and none raises (an unreadable fact is None)."""
    env = os.environ if environ is None else environ
    soc = detected_soc(run=run) or (env.get("SOC_VERSION") or "").strip() or None  # the card over the build's choice
    numbers, text = probe_driver_version(read_file, run)
    soft, _ = getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)
    return AscendHostFacts(soc=soc, driver_version=numbers, driver_version_text=text, kernel_release=release(),
                           memlock_bytes=memlock)

