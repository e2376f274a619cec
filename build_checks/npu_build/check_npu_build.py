"""make check-npu-build: the _npu build with CANN's CMake rules, proven on x86 without CANN (docs/npu_build.md).

Steps: (a) the real torch / torch_npu headers and libraries from their wheels (cached in build/npu-toolchain);
the stand-in CANN toolkit (real ACL headers, stub libraries); (b) csrc/ascendc configured (Unix Makefiles, as CANN's
re-link needs) and built against it, the kernel library re-linked from link.txt without a shell as CANN does;
(c) RUNPATH $ORIGIN on _npu, none on the kernel library, and every NEEDED of both (as re-linked) resolved with only
the toolkit's lib64 on LD_LIBRARY_PATH; (d) every undefined symbol of _npu exported by a library it will load;
(e) every _npu source compiled with -fsyntax-only against the real ACL, torch_npu and torch headers; (f) the SoC
compiled into _npu; (g) a table, non-zero exit on failure.

    .venv/bin/python build_checks/npu_build/check_npu_build.py [--source-root DIR] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from build_checks.npu_build.elf_checks import (CheckResult, check_needed_resolve, check_no_search_path,  # noqa: E402
                                        check_search_path, check_symbols_resolve)
from build_checks.npu_build.header_check import (CompileCommand, check_real_headers,  # noqa: E402
                                          target_compile_commands)
from build_checks.npu_build.standin import assemble_standin  # noqa: E402
from build_checks.npu_build.toolchain import ROOT, Toolchain, ToolchainUnavailable, ensure_toolchain  # noqa: E402

DEFAULT_SCRATCH = ROOT / "build" / "npu-build-check"
SOC_VERSION = "ascend910b1"
KERNEL_LIBRARY = "liblmcache_npu_kernels.so"
NPU_RUNPATH = ["$ORIGIN", "$ORIGIN/../torch/lib", "$ORIGIN/../torch_npu/lib"]
# CANN re-links the kernel library from link.txt, which only the Makefile generators write (not Ninja)
CMAKE_GENERATOR = ("-G", "Unix Makefiles")
BUILT_SOC_MACRO = "LMCACHE_NPU_BUILT_SOC"
RELINK_MARK = "stand-in CANN relink:"  # what the stand-in's relink.py prints before each replayed command


@dataclass(frozen=True)
class BuildResult:
    ok: bool
    build_dir: Path
    package_dir: Path
    log: str

    @property
    def npu_module(self) -> Path | None:
        return next(iter(sorted(self.package_dir.glob("_npu*.so"))), None)

    @property
    def kernel_library(self) -> Path | None:
        path = self.package_dir / KERNEL_LIBRARY
        return path if path.exists() else None


def pybind11_cmake_dir(python: str = sys.executable) -> str:
    result = subprocess.run([python, "-c", "import pybind11; print(pybind11.get_cmake_dir())"], capture_output=True,
                            text=True, check=True)
    return result.stdout.strip()


def site_packages_layout(scratch: Path, toolchain: Toolchain) -> Path:
    """<scratch>/site-packages with lmcache_npu/ (the build's output) beside links to torch and torch_npu, as pip
    installs them: the RUNPATH entries $ORIGIN/../torch{,_npu}/lib are then checked for real."""
    site = scratch / "site-packages"
    (site / "lmcache_npu").mkdir(parents=True, exist_ok=True)
    for name, target in (("torch", toolchain.torch_root), ("torch_npu", toolchain.torch_npu_root)):
        link = site / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target.resolve(), target_is_directory=True)
    return site / "lmcache_npu"


def configure_and_build(source_root: Path, scratch: Path, toolchain: Toolchain, standin: Path,
                        python: str = sys.executable, build_type: str = "Release") -> BuildResult:
    """cmake + build of <source_root>/csrc/ascendc against the stand-in toolkit, as setup.py drives it on CANN."""
    build_dir = scratch / "cmake-build"
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    package_dir = site_packages_layout(scratch, toolchain)
    configure = ["cmake", *CMAKE_GENERATOR, "-S", str(source_root / "csrc" / "ascendc"), "-B", str(build_dir),
                 f"-DASCEND_CANN_PACKAGE_PATH={standin}", f"-DSOC_VERSION={SOC_VERSION}",
                 f"-DCMAKE_BUILD_TYPE={build_type}",
                 f"-DTORCH_ROOT={toolchain.torch_root}", f"-DTORCH_NPU_ROOT={toolchain.torch_npu_root}",
                 f"-DLMCACHE_NPU_CXX11_ABI={toolchain.cxx11_abi}", f"-DPython3_EXECUTABLE={python}",
                 f"-DASCEND_PYTHON_EXECUTABLE={python}", f"-Dpybind11_DIR={pybind11_cmake_dir(python)}",
                 f"-DLMCACHE_NPU_OUTPUT_DIR={package_dir}", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]
    build = ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)]
    log = []
    for cmd in (configure, build):
        result = subprocess.run(cmd, capture_output=True, text=True)
        log.append(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}")
        if result.returncode != 0:
            return BuildResult(False, build_dir, package_dir, "\n".join(log))
    return BuildResult(True, build_dir, package_dir, "\n".join(log))


def check_build(build: BuildResult) -> CheckResult:
    if not build.ok:
        tail = [line for line in build.log.splitlines() if line.strip()][-40:]
        return CheckResult("cmake build", False, "configure or build failed", tail)
    built = [p.name for p in (build.npu_module, build.kernel_library) if p is not None]
    if len(built) != 2:
        return CheckResult("cmake build", False, f"built only {built or 'nothing'} in {build.package_dir}")
    return CheckResult("cmake build", True, f"{', '.join(built)} in {build.package_dir.parent.name}/lmcache_npu")


def check_relinked(build: BuildResult) -> CheckResult:
    """The kernel library the later checks read is the one CANN's POST_BUILD re-link wrote (build log)."""
    replayed = [line.strip() for line in build.log.splitlines()
                if line.strip().startswith(RELINK_MARK) and f"/{KERNEL_LIBRARY} " in f"{line} "]
    if not replayed:
        return CheckResult(f"relink {KERNEL_LIBRARY}", False, "the build log shows no re-link from link.txt",
                           ["the stand-in ascendc.cmake must delete and re-link the library (relink.py)"])
    return CheckResult(f"relink {KERNEL_LIBRARY}", True, "deleted and re-linked from link.txt, no shell", replayed)


def _reads_macro(commands: list[CompileCommand]) -> list[str]:
    """The sources (and the headers beside them) that mention the built-SoC macro."""
    files = {c.source for c in commands} | {h for c in commands for h in c.source.parent.glob("*.h")}
    return sorted(f.name for f in files if BUILT_SOC_MACRO in f.read_text(errors="replace"))


def check_built_soc(npu: Path, commands: list[CompileCommand], soc: str = SOC_VERSION) -> CheckResult:
    """Every _npu source is compiled with LMCACHE_NPU_BUILT_SOC="<SOC_VERSION>"; once a source reads it, the string
    is in the module (so _npu can name the SoC its kernels were built for)."""
    define = f'-D{BUILT_SOC_MACRO}="{soc}"'
    missing = [c.source.name for c in commands if define not in c.arguments]
    if not commands or missing:
        return CheckResult("built SoC", False, f"{define} missing from {', '.join(missing) or 'every source'}")
    readers = _reads_macro(commands)
    if readers and soc.encode() not in npu.read_bytes():
        return CheckResult("built SoC", False, f'"{soc}" is not in {npu.name} though {", ".join(readers)} read it')
    where = f'"{soc}" in {npu.name}' if readers else "no source reads it yet"
    return CheckResult("built SoC", True, f"{define} on {len(commands)} sources; {where}")


def post_build_steps(build: BuildResult, toolchain: Toolchain, standin: Path) -> list[Callable[[], CheckResult]]:
    """(b) the re-link, (c) RUNPATH and NEEDED, (d) symbols, (e) real headers, (f) the SoC, for a build that produced
    both libraries."""
    npu, kernels = build.npu_module, build.kernel_library
    assert npu is not None and kernels is not None
    loader_path = [standin / "lib64"]  # what CANN's set_env.sh provides; torch's dirs must come from the RUNPATH
    providers = [*toolchain.torch_libraries, *sorted((standin / "lib64").glob("*.so")), kernels]
    commands = target_compile_commands(build.build_dir)
    return [lambda: check_relinked(build),
            lambda: check_search_path(npu, NPU_RUNPATH), lambda: check_no_search_path(kernels),
            lambda: check_needed_resolve(npu, loader_path), lambda: check_needed_resolve(kernels, loader_path),
            lambda: check_symbols_resolve(npu, providers), lambda: check_symbols_resolve(kernels, providers),
            lambda: check_real_headers(commands, toolchain, standin), lambda: check_built_soc(npu, commands)]


def post_build_checks(build: BuildResult, toolchain: Toolchain, standin: Path) -> list[CheckResult]:
    return [step() for step in post_build_steps(build, toolchain, standin)]


def timed(results: list[tuple[CheckResult, float]], step: Callable[[], CheckResult]) -> CheckResult:
    """Runs a step and records its result with its seconds."""
    start = time.monotonic()
    result = step()
    results.append((result, time.monotonic() - start))
    return result


def run_all(source_root: Path, scratch: Path) -> list[tuple[CheckResult, float]]:
    results: list[tuple[CheckResult, float]] = []
    start = time.monotonic()
    try:
        toolchain = ensure_toolchain()
    except ToolchainUnavailable as error:
        return [(CheckResult("toolchain", False, str(error)), time.monotonic() - start)]
    results.append((CheckResult("toolchain", True, f"torch + torch_npu headers/libs, CXX11 ABI "
                                f"{toolchain.cxx11_abi}, in {toolchain.site_packages}"), time.monotonic() - start))
    standin_dir = scratch / "standin_cann"
    timed(results, lambda: CheckResult("stand-in CANN", assemble_standin(standin_dir, toolchain).exists(),
                                       f"real ACL headers + stub lib64 at {standin_dir}"))
    build_start = time.monotonic()
    build = configure_and_build(source_root, scratch, toolchain, standin_dir)
    build_result = check_build(build)
    results.append((build_result, time.monotonic() - build_start))
    if build_result.passed:
        for step in post_build_steps(build, toolchain, standin_dir):
            timed(results, step)
    return results


def print_table(results: list[tuple[CheckResult, float]]) -> None:
    width = max(len(r.name) for r, _ in results)
    for result, seconds in results:
        print(f"{result.name:<{width}}  {'PASS' if result.passed else 'FAIL'}  {seconds:6.1f}s  {result.summary}")
    for result, _ in results:
        if not result.passed and result.details:
            print(f"\n--- {result.name} ---")
            print("\n".join(result.details))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the _npu build against CANN's CMake rules, on x86 (stand-in CANN)")
    parser.add_argument("--source-root", type=Path, default=ROOT, help="tree holding csrc/ (default: this one)")
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help="work directory (emptied first)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    shutil.rmtree(args.scratch, ignore_errors=True)
    args.scratch.mkdir(parents=True)
    start = time.monotonic()
    results = run_all(args.source_root.resolve(), args.scratch.resolve())
    print_table(results)
    failed = [r.name for r, _ in results if not r.passed]
    print(f"\ncheck-npu-build: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'} "
          f"({time.monotonic() - start:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r, _ in results], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
