"""Build of lmcache_npu's native modules.

Always: lmcache_npu._emu, the AscendC kernel sources compiled for x86 against the emulator, and
lmcache_npu._host, the transfer contract with memcpy over host memory (csrc/host).
When nvcc and a CUDA build of torch are present: lmcache_npu._cuda from csrc/cuda/*.cu.
When CANN is present (ASCEND_HOME_PATH): the AscendC kernels for SOC_VERSION via CMake
(ascendc_library) and lmcache_npu._npu, the aclrt launcher. Each optional module that is
skipped is logged with the reason.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

logging.basicConfig(level=logging.INFO, format="lmcache_npu build: %(message)s")
log = logging.getLogger("lmcache_npu.setup")

ROOT = Path(__file__).parent.resolve()
CXX_FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]


def local_includes(sources: list[str]) -> list[str]:
    """Every repository file the sources reach through `#include "..."`, recursively: an extension depends on them,
    so an edit to the kernel header or the emulator rebuilds the module instead of leaving a stale one."""
    found: set[Path] = set()
    pending = [ROOT / s for s in sources]
    while pending:
        path = pending.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(encoding="utf-8"), re.MULTILINE):
            included = (path.parent / name).resolve()
            if included.is_file() and included not in found:  # CANN's kernel_operator.h is not in the repository
                found.add(included)
                pending.append(included)
    return sorted(str(p.relative_to(ROOT)) for p in found)


EMU_SOURCES = ["csrc/bindings/emu_module.cpp", "csrc/bindings/emu_kernel_a2.cpp", "csrc/bindings/emu_kernel_310p.cpp"]


def emu_extension() -> Pybind11Extension:
    return Pybind11Extension(
        "lmcache_npu._emu",
        sources=EMU_SOURCES,
        depends=local_includes(EMU_SOURCES),
        include_dirs=["csrc", "csrc/ascendc"],
        define_macros=[("LMCACHE_NPU_EMU", "1")],
        extra_compile_args=CXX_FLAGS,
        cxx_std=17,
    )


HOST_SOURCES = ["csrc/bindings/host_module.cpp", "csrc/host/kv_transfer_host.cpp", "csrc/host/sliced_order.cpp",
                "csrc/host/slot_runs.cpp", "csrc/host/block_slots.cpp", "csrc/host/move_runs.cpp"]


def host_extension() -> Pybind11Extension:
    return Pybind11Extension(
        "lmcache_npu._host",
        sources=HOST_SOURCES,
        depends=local_includes(HOST_SOURCES),
        include_dirs=["csrc"],
        extra_compile_args=CXX_FLAGS + ["-pthread"],
        extra_link_args=["-pthread"],  # std::thread splits the items when threads > 1
        cxx_std=17,
    )


def cuda_home() -> Path | None:
    """The CUDA toolkit that holds cuda_runtime.h and libcudart (nvcc may be a wrapper script)."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda",
                  *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return Path(candidate)
    return None


def cuda_extension() -> Pybind11Extension | None:
    """Auto when nvcc and a CUDA build of torch are present; LMCACHE_NPU_CUDA=1 forces it (nvcc only), =0 skips."""
    mode = os.environ.get("LMCACHE_NPU_CUDA", "auto")
    if mode == "0":
        log.info("skipping lmcache_npu._cuda: LMCACHE_NPU_CUDA=0")
        return None
    sources = sorted(glob.glob("csrc/cuda/*.cu"))
    if shutil.which("nvcc") is None:
        if mode == "1":
            raise RuntimeError("LMCACHE_NPU_CUDA=1 but nvcc is not on PATH")
        log.info("skipping lmcache_npu._cuda: nvcc is not on PATH")
        return None
    if mode != "1":
        try:
            import torch
        except ImportError:
            log.info("skipping lmcache_npu._cuda: torch is not importable in the build environment "
                     "(install with --no-build-isolation, or force with LMCACHE_NPU_CUDA=1)")
            return None
        if not torch.version.cuda:
            log.info("skipping lmcache_npu._cuda: torch %s is not a CUDA build (force with LMCACHE_NPU_CUDA=1)",
                     torch.__version__)
            return None
    home = cuda_home()
    if home is None:
        raise RuntimeError("nvcc found but no CUDA toolkit with include/cuda_runtime.h; set CUDA_HOME")
    binding = ["csrc/bindings/cuda_module.cpp"]
    # the .cu files are compiled by BuildExt before the link; listed here, an edit to them relinks the module too
    ext = Pybind11Extension("lmcache_npu._cuda", sources=binding, include_dirs=["csrc"],
                            depends=sources + local_includes(binding + sources), extra_compile_args=CXX_FLAGS,
                            cxx_std=17)
    ext.cuda_sources = sources  # type: ignore[attr-defined]
    ext.library_dirs += [str(home / d) for d in ("lib64", "lib") if (home / d).exists()]
    ext.runtime_library_dirs += [str(home / d) for d in ("lib64", "lib") if (home / d).exists()]
    ext.libraries.append("cudart")
    log.info("building lmcache_npu._cuda with the CUDA toolkit at %s", home)
    return ext


def cann_home() -> Path | None:
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        log.info("skipping the AscendC device build and lmcache_npu._npu: ASCEND_HOME_PATH is not set (no CANN)")
        return None
    return Path(home)


def soc_version() -> str | None:
    """$SOC_VERSION, else the SoC npu-smi reports (A3: Chip Name + "_" + NPU Name), by the one rule doctor also uses:
    lmcache_npu/platform/npu_smi.py, loaded by path because the package (and torch) cannot be imported here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_lmcache_npu_build_npu_smi",
                                                  ROOT / "lmcache_npu" / "platform" / "npu_smi.py")
    assert spec is not None and spec.loader is not None
    npu_smi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(npu_smi)
    return npu_smi.soc_version()


def torch_cmake_args() -> list[str] | None:
    """-DTORCH_ROOT, -DTORCH_NPU_ROOT and -DLMCACHE_NPU_CXX11_ABI for the _npu build (a torch_npu extension), found
    without importing torch_npu, which needs the driver (absent in `docker build`): the package directories from
    find_spec, which reads the import path only; the ABI from torch with its backend autoload (torch_npu) off.
    None when torch or torch_npu is not installed."""
    roots = []
    for package, variable in (("torch", "TORCH_ROOT"), ("torch_npu", "TORCH_NPU_ROOT")):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            log.info("skipping the AscendC device build and lmcache_npu._npu: %s is not installed", package)
            return None
        roots.append(f"-D{variable}={spec.submodule_search_locations[0]}")
    abi = subprocess.run([sys.executable, "-c", "import torch; print(int(torch.compiled_with_cxx11_abi()))"],
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, capture_output=True, text=True,
                         check=True).stdout.strip()
    return [*roots, f"-DLMCACHE_NPU_CXX11_ABI={abi}"]


class BuildExt(build_ext):
    """Compiles .cu sources with nvcc and runs the CANN CMake build when available."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        cuda_sources = getattr(ext, "cuda_sources", [])
        if cuda_sources:
            objects_dir = Path(self.build_temp) / "cuda"
            objects_dir.mkdir(parents=True, exist_ok=True)
            for src in cuda_sources:
                obj = objects_dir / (Path(src).stem + ".o")
                archs = os.environ.get("LMCACHE_NPU_CUDA_ARCHS", "80;90").split(";")
                cmd = ["nvcc", "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Icsrc", "-lineinfo",
                       *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
                       "-c", src, "-o", str(obj)]
                log.info("%s", " ".join(cmd))
                subprocess.check_call(cmd, cwd=ROOT)
                ext.extra_objects.append(str(obj))
        super().build_extension(ext)

    def run(self):  # type: ignore[no-untyped-def]
        super().run()
        home = cann_home()
        if home is None:
            return
        soc = soc_version()
        if soc is None:
            log.info("skipping the AscendC device build: set SOC_VERSION (e.g. Ascend910B1, Ascend310P3); "
                     "npu-smi did not report a chip")
            return
        torch_args = torch_cmake_args()
        if torch_args is None:
            return
        build_dir = Path(self.build_temp) / "ascendc"
        build_dir.mkdir(parents=True, exist_ok=True)
        package_dir = Path(self.get_ext_fullpath("lmcache_npu._emu")).parent
        import pybind11

        # Unix Makefiles whatever CMAKE_GENERATOR says: CANN's ascendc_library re-links the kernel library from
        # CMakeFiles/<target>.dir/link.txt, which the Makefile generators alone write (Ninja: FileNotFoundError).
        cmake = ["cmake", "-G", "Unix Makefiles", str(ROOT / "csrc" / "ascendc"), f"-DSOC_VERSION={soc}",
                 f"-DASCEND_CANN_PACKAGE_PATH={home}", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                 f"-DLMCACHE_NPU_OUTPUT_DIR={package_dir.resolve()}", *torch_args]
        log.info("%s", " ".join(cmake))
        subprocess.check_call(cmake, cwd=build_dir)
        subprocess.check_call(["cmake", "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=build_dir)


extensions = [emu_extension(), host_extension()]
cuda = cuda_extension()
if cuda is not None:
    extensions.append(cuda)

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
