"""How a transfer backend is chosen: the registry of backend names and the dispatch to their classes (the
interface is in transfer_backend.py, the device staging helpers in device_staging.py)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..platform.npu_runtime import npu_available
from .transfer_backend import BackendUnavailable, TransferBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "emu", "host", "cuda", "npu", "auto")

def _cuda_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("lmcache_npu._cuda") is not None


def backend_class(name: str) -> type[TransferBackend]:
    """The class behind a backend name (not "auto"); importing it loads no native module."""
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend
    if name == "emu":
        from .emu_backend import EmuBackend

        return EmuBackend
    if name == "host":
        from .host_backend import HostBackend

        return HostBackend
    if name == "npu":
        from .npu_backend import NpuBackend

        return NpuBackend
    if name == "cuda":
        from .cuda.backend import CudaBackend

        return CudaBackend
    raise ValueError(f"unknown transfer backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")


def backend_for_device(device_type: str, requested: str = "auto") -> str:
    """The backend that moves KV pages held on `device_type`: `requested` if it can, else a ValueError; "auto" picks
    the device's own kernels (on the host: memcpy (host) when built, else the AscendC source under the emulator (emu),
    else torch)."""
    if requested == "auto":
        if device_type in ("npu", "cuda"):
            return device_type
        if device_type == "cpu":
            for name in ("host", "emu"):
                if importlib.util.find_spec(f"lmcache_npu._{name}") is not None:
                    return name
            return "torch"
        raise ValueError(f"no transfer backend moves {device_type} memory")
    backend_class(requested)  # an unknown name fails here, naming the choices
    host_only = requested in ("emu", "host") and device_type != "cpu"
    if host_only or (requested in ("cuda", "npu") and device_type != requested):
        raise ValueError(f"backend {requested!r} cannot move {device_type} memory; use backend 'auto'")
    return requested


def auto_backend_name() -> str:
    """The backend this machine runs best: npu > cuda > host > emu > torch."""
    if npu_available():
        return backend_for_device("npu")
    if _cuda_available():
        return backend_for_device("cuda")
    return backend_for_device("cpu")


def get_backend(name: str = "auto", **options: object) -> TransferBackend:
    """Returns a backend by name: torch, emu, host, npu, cuda or auto (npu > cuda > host > emu > torch)."""
    if name == "auto":
        name = auto_backend_name()
        logger.info("auto-selected the %s transfer backend", name)
    cls = backend_class(name)
    if name == "cuda" and not _cuda_available():
        raise BackendUnavailable(
            "the cuda backend needs lmcache_npu._cuda (built at install time when nvcc and a CUDA build of "
            "torch are present, or with LMCACHE_NPU_CUDA=1) and a visible CUDA device"
        )
    return cls(**options)  # type: ignore[arg-type]
