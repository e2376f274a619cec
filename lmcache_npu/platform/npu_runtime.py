"""What the NPU backend and the host arena need from an Ascend device: the native module (lmcache_npu._npu) and the
device it drives, and memory that module allocates (device buffers, page-locked host buffers).

`NpuRuntime.load()` is the real one: torch_npu's current device and the module built with CANN. x86 tests build the
same native sources against a fake device and hand that runtime to the backend, so everything above the ACL calls
runs in CI. torch_npu is imported only inside `load()`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)


def npu_available() -> bool:
    """True when torch_npu is installed and sees an Ascend NPU (importing it registers `torch.npu`)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


BUILT_SOC_TAG = re.compile(rb"LMCACHE_NPU_BUILT_SOC=([A-Za-z0-9_.-]*)\x00")


def recorded_built_soc(module_path: str) -> Optional[str]:
    """The SOC_VERSION a built `_npu` records (csrc/bindings/npu_module.cpp), read from the file's bytes without
    importing it (an import runs CANN's constructor, which needs a device); None when the file has no tag or cannot
    be read, "" for a build that was given no SoC."""
    try:
        with open(module_path, "rb") as module:
            match = BUILT_SOC_TAG.search(module.read())
    except OSError:
        return None
    return match.group(1).decode() if match else None


class DeviceUnavailable(RuntimeError):
    """This machine cannot run the device code asked for; the message says what is missing."""


@dataclass(frozen=True)
class NpuPlatform:
    """What the native module reads from the device (SoC name, vector cores, UB bytes, task queue state) and the
    SOC_VERSION its kernel library was built for ("" for a build that did not record it)."""

    soc: str
    vector_cores: int
    ub_bytes: int
    task_queue: bool
    built_soc: str = ""


class NpuRuntime:
    """The native module and its device. `bind_thread` selects the device on the calling thread (every ACL call
    acts on the thread's current device); `is_device_tensor` tells device memory from host memory."""

    def __init__(self, native: Any, device_index: int, device: torch.device, bind_thread: Callable[[], None],
                 is_device_tensor: Callable[[torch.Tensor], bool]) -> None:
        self.native = native
        self.device_index = device_index
        self.device = device
        self.bind_thread = bind_thread
        self.is_device_tensor = is_device_tensor
        self._platform: Optional[NpuPlatform] = None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, device_index: Optional[int] = None) -> "NpuRuntime":
        """torch_npu's device (the current one unless given) with lmcache_npu._npu; DeviceUnavailable saying what
        is missing otherwise."""
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as exc:
            raise DeviceUnavailable("torch_npu (with CANN) is needed and is not importable here: "
                                     f"{exc}") from exc
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailable("torch_npu is installed but no Ascend NPU is visible")
        index = int(torch.npu.current_device() if device_index is None else device_index)  # type: ignore[attr-defined]
        device = torch.device("npu", index)

        def bind_thread() -> None:
            torch.npu.set_device(index)  # type: ignore[attr-defined]  # also initialises ACL on a first call

        # the device first: importing _npu runs CANN's kernel-registration constructor, which asks ACL for the SoC
        # (vllm-ascend imports its custom ops late for the same reason)
        bind_thread()
        try:
            from lmcache_npu import _npu  # type: ignore[attr-defined]
        except ImportError as exc:
            raise DeviceUnavailable(f"lmcache_npu._npu cannot be loaded ({exc}): reinstall with CANN present "
                                     "(ASCEND_HOME_PATH set, SOC_VERSION or npu-smi available)") from exc

        return cls(_npu, index, device, bind_thread, lambda t: t.device.type == "npu")

    def platform(self) -> NpuPlatform:
        """Read once, after selecting the device on this thread (a first ACL call without one gets no SoC name)."""
        with self._lock:
            if self._platform is None:
                self.bind_thread()
                info = self.native.platform(self.device_index)
                self._platform = NpuPlatform(str(info["soc"]), int(info["vector_cores"]), int(info["ub_bytes"]),
                                             bool(info["task_queue"]), str(info.get("built_soc", "")))
            return self._platform

    def device_buffer(self, nbytes: int, what: str) -> "DeviceBuffer":
        return DeviceBuffer(self.native, nbytes, what)

    def pinned_buffer(self, nbytes: int, what: str) -> "PinnedBuffer":
        return PinnedBuffer(self.native, nbytes, what)


class DeviceBuffer:
    """`nbytes` of device memory from aclrtMalloc, freed when the buffer is collected or closed. Outside torch's
    caching allocator on purpose: it is sized once, up front, and `doctor` counts it."""

    def __init__(self, native: Any, nbytes: int, what: str) -> None:
        if nbytes < 1:
            raise ValueError(f"{what}: a device buffer needs at least one byte, got {nbytes}")
        self.nbytes = nbytes
        self.what = what
        self.address = int(native.device_malloc(nbytes))
        self._free = weakref.finalize(self, _free_quietly, native.device_free, self.address, what)

    def close(self) -> None:
        self._free()


class PinnedBuffer:
    """`nbytes` of page-locked host memory from aclrtMallocHost (what the device's copy engine reads and writes
    asynchronously), with a numpy view; freed when collected or closed."""

    def __init__(self, native: Any, nbytes: int, what: str) -> None:
        if nbytes < 1:
            raise ValueError(f"{what}: a pinned buffer needs at least one byte, got {nbytes}")
        self.nbytes = nbytes
        self.address = int(native.malloc_host(nbytes))
        self.array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(self.address), dtype=np.uint8)
        self._free = weakref.finalize(self, _free_quietly, native.free_host, self.address, what)

    def close(self) -> None:
        self._free()


def _free_quietly(free: Callable[[int], None], address: int, what: str) -> None:
    try:
        free(address)
    except Exception as exc:  # at interpreter exit the device may be gone already
        logger.debug("%s at 0x%x not freed: %s", what, address, exc)
