"""Build of lmcache_npu's native modules.

Always: lmcache_npu._emu, the AscendC kernel sources compiled for x86 against the emulator.
When nvcc and a CUDA build of torch are present: lmcache_npu._cuda from csrc/cuda/*.cu.
When CANN is present (ASCEND_HOME_PATH): the AscendC kernels for SOC_VERSION via CMake
(ascendc_library) and lmcache_npu._npu, the aclrt launcher. Each optional module that is
skipped is logged with the reason.
"""

from __future__ import annotations

import glob
import logging
import os
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


def emu_extension() -> Pybind11Extension:
    return Pybind11Extension(
        "lmcache_npu._emu",
        sources=[
            "csrc/bindings/emu_module.cpp",
            "csrc/bindings/emu_kernel_a2.cpp",
            "csrc/bindings/emu_kernel_310p.cpp",
        ],
        include_dirs=["csrc", "csrc/ascendc"],
        define_macros=[("LMCACHE_NPU_EMU", "1")],
        extra_compile_args=CXX_FLAGS,
        cxx_std=17,
    )


def cuda_extension() -> Pybind11Extension | None:
    sources = sorted(glob.glob("csrc/cuda/*.cu"))
    if not sources:
        log.info("skipping lmcache_npu._cuda: csrc/cuda has no kernel sources")
        return None
    if shutil.which("nvcc") is None:
        log.info("skipping lmcache_npu._cuda: nvcc is not on PATH")
        return None
    try:
        import torch
    except ImportError:
        log.info("skipping lmcache_npu._cuda: torch is not importable in the build environment "
                 "(install with --no-build-isolation)")
        return None
    if not torch.version.cuda:
        log.info("skipping lmcache_npu._cuda: torch %s is not a CUDA build", torch.__version__)
        return None
    bindings = sorted(glob.glob("csrc/bindings/cuda_*.cpp"))
    ext = Pybind11Extension("lmcache_npu._cuda", sources=bindings, include_dirs=["csrc"],
                            extra_compile_args=CXX_FLAGS, cxx_std=17)
    ext.cuda_sources = sources  # type: ignore[attr-defined]
    cuda_home = Path(shutil.which("nvcc")).resolve().parent.parent  # type: ignore[arg-type]
    ext.library_dirs.append(str(cuda_home / "lib64"))
    ext.libraries.append("cudart")
    return ext


def cann_home() -> Path | None:
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        log.info("skipping the AscendC device build and lmcache_npu._npu: ASCEND_HOME_PATH is not set (no CANN)")
        return None
    return Path(home)


def soc_version() -> str | None:
    soc = os.environ.get("SOC_VERSION")
    if soc:
        return soc
    if shutil.which("npu-smi") is None:
        return None
    out = subprocess.run(["npu-smi", "info", "-t", "board", "-i", "0", "-c", "0"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Chip Name", "NPU Name") and value.strip():
            name = value.strip()
            return name if name.lower().startswith("ascend") else f"Ascend{name}"
    return None


class BuildExt(build_ext):
    """Compiles .cu sources with nvcc and runs the CANN CMake build when available."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        cuda_sources = getattr(ext, "cuda_sources", [])
        if cuda_sources:
            objects_dir = Path(self.build_temp) / "cuda"
            objects_dir.mkdir(parents=True, exist_ok=True)
            for src in cuda_sources:
                obj = objects_dir / (Path(src).stem + ".o")
                cmd = ["nvcc", "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Icsrc",
                       "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
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
        build_dir = Path(self.build_temp) / "ascendc"
        build_dir.mkdir(parents=True, exist_ok=True)
        package_dir = Path(self.get_ext_fullpath("lmcache_npu._emu")).parent
        import pybind11

        cmake = ["cmake", str(ROOT / "csrc" / "ascendc"), f"-DSOC_VERSION={soc}",
                 f"-DASCEND_CANN_PACKAGE_PATH={home}", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                 f"-DLMCACHE_NPU_OUTPUT_DIR={package_dir.resolve()}"]
        log.info("%s", " ".join(cmake))
        subprocess.check_call(cmake, cwd=build_dir)
        subprocess.check_call(["cmake", "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=build_dir)


extensions = [emu_extension()]
cuda = cuda_extension()
if cuda is not None:
    extensions.append(cuda)

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
