"""Assembles the stand-in CANN toolkit the NPU build check configures against (docs/npu_build.md).

The layout is a toolkit's: tools/tikcpp/ascendc_kernel_cmake/ascendc.cmake (our CMake interface stand-in),
include/acl/*.h (the REAL ACL headers, copied from the torch_npu wheel: a wrong ACL call must fail to compile),
include/tiling/platform/platform_ascendc.h (a stand-in), and lib64/ with stub libraries: libascendcl.so exporting
every function the real ACL headers declare, libplatform.so implementing the stand-in platform API, and empty
libraries for the rest of what the real ascendc_library puts on a consumer's link line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from build_checks.npu_build.toolchain import Toolchain

HERE = Path(__file__).resolve().parent
STANDIN_TREE = HERE / "standin_cann"
STUB_SOURCES = HERE / "stubs"
# libraries the real ascendc_library's usage requirements name besides ascendcl and platform (empty here)
EMPTY_LIBRARIES = ("tiling_api", "runtime", "register", "error_manager", "profapi", "ge_common_base", "unified_dlog",
                   "mmpa", "ascend_dump", "c_sec")

_PREPROCESSOR_LINE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.MULTILINE)
_ACL_FUNCTION = re.compile(r"\bACL_FUNC_VISIBILITY\s+[^;{}()]*?\b(\w+)\s*\(")


def acl_function_names(header_dir: Path) -> list[str]:
    """Every function declared `ACL_FUNC_VISIBILITY <ret> <name>(` in the headers (extern "C": names suffice)."""
    names: set[str] = set()
    for header in sorted(header_dir.rglob("*.h")):
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header.read_text(errors="replace"), flags=re.DOTALL)
        names.update(_ACL_FUNCTION.findall(_PREPROCESSOR_LINE.sub("", text)))
    return sorted(names)


def acl_stub_source(names: list[str]) -> str:
    lines = ["/* Generated: the stand-in libascendcl.so, one symbol per ACL function the real headers declare. */"]
    lines += [f'__attribute__((visibility("default"))) void {name}(void) {{}}' for name in names]
    return "\n".join(lines) + "\n"


def _compile_shared(source: Path, output: Path, flags: list[str]) -> None:
    compiler = "gcc" if source.suffix == ".c" else "g++"
    cmd = [compiler, "-shared", "-fPIC", "-O0", *flags, str(source), "-o", str(output), f"-Wl,-soname,{output.name}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"stand-in CANN: building {output.name} failed:\n{result.stderr[-3000:]}")


def assemble_standin(destination: Path, toolchain: Toolchain) -> Path:
    """A fresh stand-in toolkit at `destination` (its ASCEND_CANN_PACKAGE_PATH)."""
    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(STANDIN_TREE, destination, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(toolchain.acl_headers, destination / "include" / "acl")
    lib64 = destination / "lib64"
    generated = destination / "stub_sources"
    lib64.mkdir()
    generated.mkdir()
    acl_source = generated / "ascendcl_stub.c"
    acl_source.write_text(acl_stub_source(acl_function_names(destination / "include" / "acl")))
    _compile_shared(acl_source, lib64 / "libascendcl.so", [])
    _compile_shared(STUB_SOURCES / "platform_ascendc_stub.cpp", lib64 / "libplatform.so",
                    ["-std=c++17", f"-I{destination / 'include'}"])
    for name in EMPTY_LIBRARIES:
        source = generated / f"{name}_stub.c"
        source.write_text(f"/* Generated: stand-in lib{name}.so, empty. */\n"
                          f"__attribute__((visibility(\"default\"))) int lmcache_npu_standin_{name};\n")
        _compile_shared(source, lib64 / f"lib{name}.so", [])
    return destination
