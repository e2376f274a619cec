"""The real torch and torch_npu bits the NPU build check compiles and links against, from PyPI wheels, cached.

Only what the check needs is unzipped: torch's headers and libc10/libtorch/libtorch_cpu/libtorch_python, and
torch_npu's headers (its C++ API and CANN's ACL headers) and libtorch_npu. They land in
build/npu-toolchain/site-packages/{torch,torch_npu}, a site-packages layout, so the _npu RUNPATH entries
$ORIGIN/../torch/lib and $ORIGIN/../torch_npu/lib can be proven as they are. The wheels are deleted once extracted.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import platform
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = ROOT / "build" / "npu-toolchain"
# what vllm-ascend v0.23.0 pins (requirements.txt: torch-npu==2.10.0.post4) on its CANN 9.1.0 / Python 3.12 image
# (research/ascend_second_look_2026-11, section 0)
TORCH_VERSION = "2.10.0"
TORCH_NPU_VERSION = "2.10.0.post4"
WHEEL_PYTHON = "3.12"  # the image's Python; both wheels exist for cp312 (headers and libraries do not depend on it)
TORCH_MEMBERS = ("torch/include/*", "torch/lib/libc10.so", "torch/lib/libtorch.so", "torch/lib/libtorch_cpu.so",
                 "torch/lib/libtorch_python.so")
TORCH_NPU_MEMBERS = ("torch_npu/include/*", "torch_npu/lib/libtorch_npu.so")


class ToolchainUnavailable(RuntimeError):
    """The wheels could not be fetched (no network, no such version for this machine)."""


@dataclass(frozen=True)
class Toolchain:
    site_packages: Path
    cxx11_abi: int

    @property
    def torch_root(self) -> Path:
        return self.site_packages / "torch"

    @property
    def torch_npu_root(self) -> Path:
        return self.site_packages / "torch_npu"

    @property
    def acl_headers(self) -> Path:
        """The wheel's copy of CANN's acl/*.h: post7 ships include/acl/, post4 only include/third_party/acl/inc/acl/."""
        include = self.torch_npu_root / "include"
        for candidate in (include / "acl", include / "third_party" / "acl" / "inc" / "acl"):
            if (candidate / "acl.h").is_file():
                return candidate
        raise FileNotFoundError(f"no acl/acl.h under {include}: not a torch_npu wheel this check knows")

    @property
    def torch_libraries(self) -> list[Path]:
        names = ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so")
        return [self.torch_root / "lib" / n for n in names] + [self.torch_npu_root / "lib" / "libtorch_npu.so"]


def _stamp(cache: Path) -> Path:
    return cache / "site-packages" / ".complete.json"


def _expected_stamp() -> dict[str, str]:
    return {"torch": TORCH_VERSION, "torch_npu": TORCH_NPU_VERSION, "machine": platform.machine()}


def cxx11_abi_of(libc10: Path) -> int:
    """torch's _GLIBCXX_USE_CXX11_ABI, read from libc10's exported names (std::__cxx11 appears only under ABI 1),
    because this torch cannot be imported: only part of its wheel is here."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(libc10)], capture_output=True, text=True, check=True)
    return int("__cxx11" in out.stdout)


def _download(wheels: Path, python: str) -> list[Path]:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--python-version", WHEEL_PYTHON, "--platform", f"manylinux_2_28_{platform.machine()}", "-d", str(wheels),
           f"torch=={TORCH_VERSION}", f"torch-npu=={TORCH_NPU_VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ToolchainUnavailable(f"pip download of torch {TORCH_VERSION} / torch-npu {TORCH_NPU_VERSION} failed: "
                                   f"{(result.stderr or result.stdout).strip()[-1500:]}")
    return sorted(wheels.glob("*.whl"))


def _extract(wheel: Path, members: tuple[str, ...], into: Path) -> None:
    """unzip where there is one (several times faster on the 900 MB torch wheel), else zipfile."""
    if shutil.which("unzip"):
        result = subprocess.run(["unzip", "-q", "-o", str(wheel), *members, "-d", str(into)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"unzip {wheel.name} failed: {result.stderr.strip()}")
        return
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if any(fnmatch.fnmatchcase(n, m) for m in members)]
        missing = [m for m in members if not any(fnmatch.fnmatchcase(n, m) for n in names)]
        if missing:
            raise RuntimeError(f"{wheel.name} has no {', '.join(missing)}")
        archive.extractall(into, names)


def ensure_toolchain(cache: Path = DEFAULT_CACHE, python: str = sys.executable) -> Toolchain:
    """The cached toolchain, fetched on first use; safe to call from several processes at once (file lock)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _stamp(cache)
        if stamp.exists():
            recorded = json.loads(stamp.read_text())
            if {k: recorded.get(k) for k in _expected_stamp()} == _expected_stamp():
                return Toolchain(stamp.parent, int(recorded["cxx11_abi"]))
        wheels = cache / "wheels"
        staging = cache / "site-packages.partial"
        shutil.rmtree(staging, ignore_errors=True)
        downloaded = _download(wheels, python)
        for wheel in downloaded:
            _extract(wheel, TORCH_NPU_MEMBERS if wheel.name.startswith("torch_npu-") else TORCH_MEMBERS, staging)
        final = cache / "site-packages"
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        shutil.rmtree(wheels, ignore_errors=True)
        abi = cxx11_abi_of(final / "torch" / "lib" / "libc10.so")
        _stamp(cache).write_text(json.dumps({**_expected_stamp(), "cxx11_abi": abi}))
        return Toolchain(final, abi)
