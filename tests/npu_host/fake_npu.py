"""The fake Ascend device from Python: the `_npu_fake` module (our native NPU sources on fake ACL), its knobs through
ctypes, an NpuRuntime over it, and tensors in its device memory and page-locked host memory."""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import weakref
from typing import Any, Optional

import numpy as np
import torch

from lmcache_npu.platform.npu_runtime import NpuRuntime

from .fake_build import FakeBuild

_U64 = ctypes.c_uint64


class FakeNpu:
    """One process-wide fake device (its state is global in the module, as a device's is); `reset()` between tests."""

    def __init__(self, build: FakeBuild) -> None:
        loader = importlib.machinery.ExtensionFileLoader("_npu_fake", str(build.module))
        spec = importlib.util.spec_from_file_location("_npu_fake", str(build.module), loader=loader)
        assert spec is not None
        self.native: Any = importlib.util.module_from_spec(spec)
        loader.exec_module(self.native)
        self.lib = ctypes.CDLL(str(build.module))  # the same loaded object: its knobs act on the module's device
        self.hal = ctypes.CDLL(str(build.hal))
        self.lib.lmcache_fake_counter.restype = _U64
        self.lib.lmcache_fake_counter.argtypes = [ctypes.c_char_p]
        self.lib.lmcache_fake_queue_pending.restype = _U64
        self.lib.lmcache_fake_device_log.restype = _U64
        self.lib.lmcache_fake_device_log.argtypes = [ctypes.c_char_p, _U64]
        self.lib.lmcache_fake_stream_error.restype = _U64
        self.lib.lmcache_fake_stream_error.argtypes = [ctypes.c_char_p, _U64]
        self.lib.lmcache_fake_queue_model_write.argtypes = [ctypes.c_char_p, _U64, ctypes.c_int, _U64]
        self.lib.lmcache_fake_fail_async_copy_at.argtypes = [ctypes.c_int64]
        self.lib.lmcache_fake_set_soc.argtypes = [ctypes.c_char_p]
        self.lib.lmcache_fake_set_pointer_host_location.argtypes = [ctypes.c_char_p]
        self.lib.lmcache_fake_registered_flags.restype = ctypes.c_int64
        self.lib.lmcache_fake_registered_flags.argtypes = [_U64]
        self.lib.lmcache_fake_queue_drop_pending.restype = _U64
        self.lib.lmcache_fake_queue_dropped.restype = _U64
        self.lib.lmcache_fake_queue_model_fail.argtypes = [ctypes.c_char_p]
        self.hal.lmcache_fake_hal_count.restype = _U64
        self.hal.lmcache_fake_hal_last_device.restype = ctypes.c_int64
        self.hal.lmcache_fake_hal_unregister_ex_calls.restype = _U64
        self._keep: list[Any] = []

    # ---- knobs ------------------------------------------------------------------------------------------------------

    def fresh(self) -> None:
        """Every knob back to its default (queue on and running, nothing failing), device 0 on this thread."""
        self.lib.lmcache_fake_queue_set_paused(0)
        self.lib.lmcache_fake_queue_set_enabled(1)
        self.lib.lmcache_fake_queue_set_bypass(0)
        self.lib.lmcache_fake_queue_set_refusing(0)
        self.lib.lmcache_fake_queue_drain()
        self.lib.lmcache_fake_queue_reset_errors()
        self.lib.lmcache_fake_reset()
        self.hal.lmcache_fake_hal_set_error(0)
        self.select_device()

    def counter(self, name: str) -> int:
        value = int(self.lib.lmcache_fake_counter(name.encode()))
        assert value != 2**64 - 1, f"the fake device has no counter {name!r}"
        return value

    def device_log(self) -> list[str]:
        size = self.lib.lmcache_fake_device_log(None, 0)
        buffer = ctypes.create_string_buffer(size + 1)
        self.lib.lmcache_fake_device_log(buffer, size + 1)
        return [line for line in buffer.value.decode().split("\n") if line]

    def stream_error(self) -> str:
        buffer = ctypes.create_string_buffer(4096)
        self.lib.lmcache_fake_stream_error(buffer, 4096)
        return buffer.value.decode()

    def set_errors(self, host_register: int = 0, malloc_host: int = 0, launch: int = 0) -> None:
        self.lib.lmcache_fake_set_errors(host_register, malloc_host, launch)

    def set_hal_error(self, error: int) -> None:
        self.hal.lmcache_fake_hal_set_error(error)

    def set_soc(self, soc: Optional[str]) -> None:
        self.lib.lmcache_fake_set_soc(None if soc is None else soc.encode())

    def set_host_register_v2_error(self, error: int) -> None:
        """What aclrtHostRegisterV2 returns (an older runtime refuses it); 0: it registers."""
        self.lib.lmcache_fake_set_host_register_v2_error(error)

    def set_pointer_host_location(self, location: str) -> None:
        """What aclrtPointerGetAttributes says of registered host memory ("host": page-locked, else pageable)."""
        self.lib.lmcache_fake_set_pointer_host_location(location.encode())

    def registered_flags(self, address: int) -> int:
        """aclrtHostRegisterV2's flags for the range at `address`; -1 when V2 did not register it."""
        return int(self.lib.lmcache_fake_registered_flags(address))

    def set_logic_device(self, offset: int = 0, error: int = 0) -> None:
        """aclrtGetLogicDevIdByUserDevId answers user id + `offset`, or fails with `error`."""
        self.lib.lmcache_fake_set_logic_device(offset, error)

    def hal_last_device(self, unregister: bool = False) -> int:
        return int(self.hal.lmcache_fake_hal_last_device(int(unregister)))

    def hal_unregister_ex_calls(self) -> int:
        return int(self.hal.lmcache_fake_hal_unregister_ex_calls())

    def stream_paused(self, paused: bool) -> None:
        """A hung device: the stream runs nothing (events included) until resumed."""
        self.lib.lmcache_fake_stream_set_paused(int(paused))

    def stream_busy(self, seconds: float) -> None:
        """`seconds` of device work queued on the stream at once (a long model kernel)."""
        self.lib.lmcache_fake_stream_busy_us(ctypes.c_uint32(int(seconds * 1e6)))

    def queue_refusing(self, refusing: bool) -> None:
        """torch_npu's queue past its error state: an enqueue returns without queuing the task."""
        self.lib.lmcache_fake_queue_set_refusing(int(refusing))

    def queue_drop_pending(self) -> int:
        """Every queued task released without running, as torch_npu does after a failed task; how many."""
        return int(self.lib.lmcache_fake_queue_drop_pending())

    def queue_dropped(self) -> int:
        return int(self.lib.lmcache_fake_queue_dropped())

    def model_fail(self, name: str) -> None:
        """A model operation that fails when the queue runs it: the queue drops everything behind it."""
        self.lib.lmcache_fake_queue_model_fail(name.encode())

    def fail_async_copy_at(self, n: int) -> None:
        self.lib.lmcache_fake_fail_async_copy_at(n)

    def set_op_delay_us(self, us: int) -> None:
        self.lib.lmcache_fake_set_op_delay_us(us)

    def queue(self, *, enabled: Optional[bool] = None, paused: Optional[bool] = None,
              bypass: Optional[bool] = None) -> None:
        """torch_npu's task queue on or off, its thread paused, or our submits bypassing it (negative controls)."""
        if enabled is not None:
            self.lib.lmcache_fake_queue_set_enabled(int(enabled))
        if bypass is not None:
            self.lib.lmcache_fake_queue_set_bypass(int(bypass))
        if paused is not None:
            self.lib.lmcache_fake_queue_set_paused(int(paused))

    def queue_pending(self) -> int:
        return int(self.lib.lmcache_fake_queue_pending())

    def queue_task_errors(self) -> int:
        return int(self.lib.lmcache_fake_queue_task_errors())

    def model_write(self, name: str, tensor: torch.Tensor, value: int) -> None:
        """What the model's kernel writing `tensor` looks like to torch_npu: a task in the queue."""
        self.lib.lmcache_fake_queue_model_write(name.encode(), tensor.data_ptr(), value, tensor.numel())

    def drain(self) -> None:
        """Everything queued so far has run on the device (the queue and the stream are resumed first)."""
        self.lib.lmcache_fake_stream_set_paused(0)
        self.lib.lmcache_fake_queue_set_paused(0)
        self.lib.lmcache_fake_queue_drain()
        self.lib.lmcache_fake_stream_drain()

    # ---- memory -----------------------------------------------------------------------------------------------------

    def select_device(self) -> None:
        """aclrtSetDevice(0) on the calling thread (what torch.npu.set_device does)."""
        self.lib.aclrtSetDevice(0)

    def device_tensor(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over fake device memory (aclrtMalloc); freed when the tensor's storage goes."""
        return self._tensor(int(self.native.device_malloc(nbytes)), nbytes, self.native.device_free)

    def pinned_tensor(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over page-locked host memory (aclrtMallocHost)."""
        return self._tensor(int(self.native.malloc_host(nbytes)), nbytes, self.native.free_host)

    @staticmethod
    def _tensor(address: int, nbytes: int, free: Any) -> torch.Tensor:
        array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=np.uint8)
        weakref.finalize(array, free, address)  # torch.from_numpy keeps the array alive as long as the tensor
        return torch.from_numpy(array)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return bool(self.native.pointer_attributes(tensor.data_ptr())["location"] == "device")

    def runtime(self) -> NpuRuntime:
        return NpuRuntime(self.native, 0, torch.device("cpu"), self.select_device, self.is_device)

