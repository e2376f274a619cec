"""The _npu build against CANN's CMake rules, on x86 (build_checks/npu_build, docs/npu_build.md): the real build passes
every check, and each check fails on the defect it exists for (negative controls)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from build_checks.npu_build.check_npu_build import KERNEL_LIBRARY, RELINK_MARK, SOC_VERSION, configure_and_build
from build_checks.npu_build.elf_checks import (check_needed_resolve, check_no_search_path, check_search_path,
                                        check_symbols_resolve)
from build_checks.npu_build.header_check import (CompileCommand, compile_syntax_only, object_arguments,
                                          target_compile_commands)
from build_checks.npu_build.standin import acl_function_names
from build_checks.npu_build.toolchain import ROOT, Toolchain

from .conftest import SharedBuild, install_script_verdict

_MISSING = [tool for tool in ("cmake", "g++", "gcc", "readelf", "nm", "ldd", "c++filt")
            if shutil.which(tool) is None]
if _MISSING:
    pytest.skip(f"the NPU build check needs {', '.join(_MISSING)} on PATH", allow_module_level=True)

DATA = Path(__file__).parent / "data"


def _providers(shared: SharedBuild, toolchain: Toolchain) -> list[Path]:
    kernels = shared.build.kernel_library
    assert kernels is not None
    return [*toolchain.torch_libraries, *sorted((shared.standin / "lib64").glob("*.so")), kernels]


def _command_for(shared: SharedBuild, source_name: str) -> CompileCommand:
    commands = {c.source.name: c for c in target_compile_commands(shared.build.build_dir)}
    return commands[source_name]


def test_the_real_build_passes_every_check(npu_build: SharedBuild) -> None:
    failed = [f"{c.name}: {c.summary}\n" + "\n".join(c.details) for c in npu_build.checks if not c.passed]
    assert not failed, "\n\n".join(failed)
    names = [c.name for c in npu_build.checks]
    assert any(n.startswith("runpath _npu") for n in names) and "real-header compile" in names
    for name in (f"relink {KERNEL_LIBRARY}", f"runpath {KERNEL_LIBRARY}", "built SoC"):
        assert name in names


def test_the_checked_kernel_library_is_the_relinked_one(npu_build: SharedBuild) -> None:
    """CANN's POST_BUILD deleted the library and replayed link.txt; the file the checks read is what that wrote."""
    kernels = npu_build.build.kernel_library
    assert kernels is not None
    replayed = [line for line in npu_build.build.log.splitlines() if line.strip().startswith(RELINK_MARK)]
    assert any(f"-o {kernels} " in f"{line} " for line in replayed), replayed
    assert check_no_search_path(kernels).passed


def test_the_check_configures_with_the_makefile_generator(npu_build: SharedBuild) -> None:
    """CANN's re-link needs link.txt, which only a Makefile generator writes: -G is explicit, whatever
    CMAKE_GENERATOR says in the environment."""
    configure = next(line for line in npu_build.build.log.splitlines() if line.startswith("$ cmake -G"))
    assert configure.startswith("$ cmake -G Unix Makefiles "), configure
    cache = (npu_build.build.build_dir / "CMakeCache.txt").read_text()
    assert "CMAKE_GENERATOR:INTERNAL=Unix Makefiles" in cache


def test_npu_carries_the_soc_it_was_built_for(npu_build: SharedBuild) -> None:
    """F8: the SOC_VERSION the kernels were built for is compiled into _npu (npu_module.cpp reads the macro)."""
    npu = npu_build.build.npu_module
    assert npu is not None
    built = next(c for c in npu_build.checks if c.name == "built SoC")
    assert built.passed and f'LMCACHE_NPU_BUILT_SOC="{SOC_VERSION}"' in built.summary, built
    assert SOC_VERSION.encode() in npu.read_bytes()


def test_every_npu_source_is_compiled(npu_build: SharedBuild) -> None:
    """The binding and each csrc/npu/*.cpp, found by the CMake glob (a new file joins without a CMake edit)."""
    compiled = {c.source.resolve() for c in target_compile_commands(npu_build.build.build_dir)}
    expected = {(ROOT / "csrc" / "bindings" / "npu_module.cpp").resolve(),
                *(p.resolve() for p in (ROOT / "csrc" / "npu").glob("*.cpp"))}
    assert compiled == expected


def test_the_generated_launch_header_is_the_kernel_signature(npu_build: SharedBuild) -> None:
    header = npu_build.build.build_dir / "include" / "lmcache_npu_kernels" / "aclrtlaunch_lmcache_kv_transfer.h"
    text = header.read_text()
    assert ('extern "C" uint32_t aclrtlaunch_lmcache_kv_transfer(uint32_t blockDim, aclrtStream stream, void* planes, '
            "void* groups, void* runs, void* objects, void* status, uint64_t total_items,") in text


def test_the_install_script_accepts_the_real_build(npu_build: SharedBuild) -> None:
    result = install_script_verdict(npu_build.build.package_dir, npu_build.standin / "lib64")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "its libraries and symbols resolve" in result.stdout


def test_negative_control_the_old_cmakelists_fails_the_runpath_check(npu_toolchain: Toolchain, npu_standin: Path,
                                                                      tmp_path: Path) -> None:
    """CANN's CMAKE_SKIP_RPATH TRUE silently drops the pre-fix BUILD_RPATH: it builds, and _npu cannot find the
    kernel library beside it. (Debug: no -O3/LTO, which have nothing to do with the RUNPATH, to keep CI fast.)"""
    tree = tmp_path / "tree"
    (tree / "csrc" / "ascendc").mkdir(parents=True)
    (tree / "csrc" / "bindings").mkdir()
    shutil.copy(DATA / "CMakeLists.before_runpath_fix.txt", tree / "csrc" / "ascendc" / "CMakeLists.txt")
    shutil.copy(ROOT / "csrc" / "ascendc" / "kv_transfer_kernel.cpp", tree / "csrc" / "ascendc")
    shutil.copy(DATA / "minimal_npu_module.cpp", tree / "csrc" / "bindings" / "npu_module.cpp")
    build = configure_and_build(tree, tmp_path / "scratch", npu_toolchain, npu_standin, build_type="Debug")
    assert build.ok, build.log[-3000:]
    npu, kernels = build.npu_module, build.kernel_library
    assert npu is not None and kernels is not None
    runpath = check_search_path(npu, ["$ORIGIN"])
    assert not runpath.passed and "no RUNPATH/RPATH" in runpath.summary, runpath
    assert check_no_search_path(kernels).passed  # dropped by CMAKE_SKIP_RPATH too, and the kernel library needs none
    needed = check_needed_resolve(npu, [npu_standin / "lib64"])
    assert not needed.passed and "liblmcache_npu_kernels.so" in needed.summary, needed
    verdict = install_script_verdict(build.package_dir, npu_standin / "lib64")  # the image's check says so too
    assert verdict.returncode != 0 and "has no RUNPATH $ORIGIN" in verdict.stdout, verdict.stdout + verdict.stderr


def _break_first_acl_call(source: str, acl_functions: set[str]) -> tuple[str, str]:
    """The source with one extra argument given to its first call of a real ACL function; and that function."""
    for match in re.finditer(r"\b(acl\w+)\s*\(", source):
        if match.group(1) in acl_functions:
            rest = source[match.end():]
            extra = "0" if rest.lstrip().startswith(")") else "0, "
            return source[:match.end()] + extra + rest, match.group(1)
    raise AssertionError("no ACL call found in the source")


def test_negative_control_a_wrong_acl_call_fails_the_real_header_compile(npu_build: SharedBuild,
                                                                          npu_toolchain: Toolchain,
                                                                          tmp_path: Path) -> None:
    original = ROOT / "csrc" / "bindings" / "npu_module.cpp"
    command = _command_for(npu_build, original.name)
    broken_text, function = _break_first_acl_call(original.read_text(),
                                                  set(acl_function_names(npu_toolchain.acl_headers)))
    broken = tmp_path / original.name
    broken.write_text(broken_text)
    beside_original = ("-iquote", str(original.parent))  # its "../npu/x.h" includes resolve as from csrc/bindings
    result = compile_syntax_only(command, broken, beside_original)
    errors = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("."))
    assert result.returncode != 0, "a wrong ACL call compiled"
    # the error is the signature mismatch at that call, not anything else about the copy
    assert re.search(rf"(too many arguments to function|no matching function for call to)[^\n]*\b{function}\b",
                     errors), errors[-3000:]


def _shared_library(command: CompileCommand, source: Path, tmp_path: Path) -> Path:
    obj, library = tmp_path / f"{source.stem}.o", tmp_path / f"lib{source.stem}.so"
    for cmd in (object_arguments(command, source, obj), ["g++", "-shared", str(obj), "-o", str(library)]):
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
    return library


def test_negative_control_the_symbol_check_flags_what_torch_npu_does_not_export(npu_build: SharedBuild,
                                                                                  npu_toolchain: Toolchain,
                                                                                  tmp_path: Path) -> None:
    """OptionsManager::GetTaskQueueEnable() is declared in torch_npu's headers but not exported by libtorch_npu:
    it compiles and links (a shared object may leave symbols undefined) and would fail only at import."""
    command = _command_for(npu_build, "npu_module.cpp")
    bad, good = tmp_path / "not_exported.cpp", tmp_path / "exported.cpp"
    # same header; isACLGlobalLogOn is its one C10_NPU_API member in 2.10.0.post4 (post7 also exports GetRankId)
    for path, call in ((bad, "GetTaskQueueEnable()"), (good, "isACLGlobalLogOn(ACL_INFO)")):
        path.write_text('#include "torch_npu/csrc/core/npu/register/OptionsManager.h"\n'
                        'extern "C" __attribute__((visibility("default"))) long Probe() {\n'
                        f"  return static_cast<long>(c10_npu::option::OptionsManager::{call});\n}}\n")
    providers = _providers(npu_build, npu_toolchain)
    flagged = check_symbols_resolve(_shared_library(command, bad, tmp_path), providers)
    assert not flagged.passed, flagged
    assert "c10_npu::option::OptionsManager::GetTaskQueueEnable()" in flagged.summary, flagged
    clean = check_symbols_resolve(_shared_library(command, good, tmp_path), providers)
    assert clean.passed, clean
