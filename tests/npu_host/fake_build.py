"""Builds lmcache_npu's native NPU code against the fake device (tests/npu_host/fake): the module `_npu_fake` from the
same sources as `_npu` (csrc/bindings/npu_module.cpp, csrc/npu/*.cpp but the torch_npu task queue), with ACL's real
headers (from the torch-npu wheel `make check-npu-build` fetches), the stand-in toolkit's `platform_ascendc.h`, the
launch header generated from the kernel's signature as `ascendc_library` would, and a fake `libascend_hal`. Cached
under build/npu-fake/<hash of sources and flags>."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake"
REAL_SOURCES = [ROOT / "csrc/bindings/npu_module.cpp", *sorted(p for p in (ROOT / "csrc/npu").glob("*.cpp")
                                                               if p.name != "task_queue_torch_npu.cpp")]
FAKE_SOURCES = [FAKE / "fake_acl.cpp", FAKE / "fake_task_queue.cpp", FAKE / "fake_launch.cpp",
                FAKE / "fake_controls.cpp", ROOT / "csrc/bindings/emu_kernel_a2.cpp"]
MODULE_NAME = "_npu_fake"
BUILT_SOC = "ascend910b1"  # what csrc/ascendc/CMakeLists.txt compiles in from SOC_VERSION


@dataclass(frozen=True)
class FakeBuild:
    module: Path  # the _npu_fake extension
    hal: Path  # the fake libascend_hal the module dlopens


def _inputs(headers: list[Path]) -> list[Path]:
    """Every file whose change must rebuild: the sources, our headers, the kernel and emulator sources."""
    ours = [*REAL_SOURCES, *FAKE_SOURCES, FAKE / "fake_hal.cpp", Path(__file__)]
    for folder in (ROOT / "csrc", FAKE):
        ours += sorted(p for p in folder.rglob("*") if p.suffix in (".h", ".cpp") and p.is_file())
    for folder in headers:
        ours += sorted(p for p in folder.rglob("*.h") if p.is_file())
    return sorted(set(ours))


def _digest(paths: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path).encode())
        h.update(path.read_bytes())
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:16]


def _compile(cxx: str, source: Path, output: Path, flags: list[str]) -> None:
    result = subprocess.run([cxx, *flags, "-c", str(source), "-o", str(output)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiling {source.relative_to(ROOT)} for the fake NPU failed:\n{result.stderr[-4000:]}")


STANDIN_INCLUDE = ROOT / "build_checks/npu_build/standin_cann/include"
LAUNCH_HEADER_TOOL = ROOT / "build_checks/npu_build/standin_cann/tools/tikcpp/ascendc_kernel_cmake/launch_header.py"
KERNEL_SOURCE = ROOT / "csrc/ascendc/kv_transfer_kernel.cpp"


def launch_header(into: Path) -> Path:
    """`aclrtlaunch_<kernel>.h` for the kernel source, written by the stand-in toolkit's generator into `into`."""
    spec = importlib.util.spec_from_file_location("lmcache_npu_launch_header", LAUNCH_HEADER_TOOL)
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = generator  # dataclasses look their module up by name
    spec.loader.exec_module(generator)
    (signature,) = generator.kernel_signatures(KERNEL_SOURCE.read_text())
    into.mkdir(parents=True, exist_ok=True)
    path = into / signature.header_name
    text = generator.header_text(signature)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return into


def build_fake_npu(acl_include: Path, out_root: Optional[Path] = None) -> FakeBuild:
    """Compiles (or reuses) the fake-device module. `acl_include` holds `acl/acl.h` (the real headers)."""
    import pybind11

    cxx = os.environ.get("CXX", "g++")
    out_root = out_root or ROOT / "build" / "npu-fake"
    generated = launch_header(out_root / "include")
    hal_flags = ["-std=c++17", "-O1", "-fPIC", "-shared"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    base = ["-std=c++17", "-O1", "-g0", "-fPIC", "-pthread", "-DLMCACHE_NPU_EMU=1",
            f"-DLMCACHE_NPU_MODULE_NAME={MODULE_NAME}", f'-DLMCACHE_NPU_BUILT_SOC="{BUILT_SOC}"',
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc/ascendc'}",
            f"-I{ROOT / 'csrc/npu'}", f"-I{FAKE}", f"-I{acl_include}", f"-I{STANDIN_INCLUDE}", f"-I{generated}"]
    digest = _digest(_inputs([acl_include, STANDIN_INCLUDE, generated]), base + [cxx, sys.version])
    folder = out_root / digest
    hal = folder / "libfake_ascend_hal.so"
    module = folder / f"{MODULE_NAME}{suffix}"
    if module.exists() and hal.exists():
        return FakeBuild(module, hal)
    scratch = out_root / f"{digest}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    hal_result = subprocess.run([cxx, *hal_flags, str(FAKE / "fake_hal.cpp"), "-o", str(scratch / hal.name)],
                                capture_output=True, text=True)
    if hal_result.returncode != 0:
        raise RuntimeError(f"compiling the fake libascend_hal failed:\n{hal_result.stderr[-4000:]}")
    flags = base + [f'-DLMCACHE_NPU_HAL_LIBRARY="{hal}"']  # the final path: the module dlopens it from there
    objects = [scratch / f"{i:02d}-{source.stem}.o" for i, source in enumerate(REAL_SOURCES + FAKE_SOURCES)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for future in [pool.submit(_compile, cxx, source, obj, flags)
                       for source, obj in zip(REAL_SOURCES + FAKE_SOURCES, objects)]:
            future.result()
    link = subprocess.run([cxx, "-shared", "-pthread", *map(str, objects), "-ldl", "-o", str(scratch / module.name)],
                          capture_output=True, text=True)
    if link.returncode != 0:
        raise RuntimeError(f"linking the fake NPU module failed:\n{link.stderr[-4000:]}")
    for obj in objects:
        obj.unlink()
    try:
        scratch.rename(folder)  # atomic: a concurrent build (xdist) that finished first wins
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
    return FakeBuild(module, hal)
