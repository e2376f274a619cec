"""The stand-in toolkit's launch-header generator (build_checks/npu_build/standin_cann/.../launch_header.py): the
declaration CANN's ascendc_library generates from a kernel's signature, for our kernel and for others."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from build_checks.npu_build.toolchain import ROOT

SCRIPT = ROOT / "build_checks/npu_build/standin_cann/tools/tikcpp/ascendc_kernel_cmake/launch_header.py"
_spec = importlib.util.spec_from_file_location("launch_header", SCRIPT)
assert _spec and _spec.loader
launch_header = importlib.util.module_from_spec(_spec)
sys.modules["launch_header"] = launch_header  # dataclasses resolve their module by name
_spec.loader.exec_module(launch_header)

KV_TRANSFER_DECLARATION = (
    'extern "C" uint32_t aclrtlaunch_lmcache_kv_transfer(uint32_t blockDim, aclrtStream stream, void* planes, '
    "void* groups, void* runs, void* objects, void* status, uint64_t total_items, uint32_t num_planes, "
    "uint32_t num_groups, uint32_t num_runs, uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes, "
    "uint32_t zero_tile_bytes)")

OTHER_KERNEL = """
#define SCALE_KERNEL_NAME(x) x  // a function-like macro is not a name default
#ifndef MY_KERNEL
#define MY_KERNEL scale_rows /* the default name */
#endif
extern "C" __global__ __aicore__ void MY_KERNEL(__gm__ half* src, GM_ADDR dst,
                                                int32_t rows, float factor) {
}
"""


def test_the_real_kernel_gets_the_declared_launcher() -> None:
    source = (ROOT / "csrc" / "ascendc" / "kv_transfer_kernel.cpp").read_text()
    [signature] = launch_header.kernel_signatures(source)
    assert signature.launcher_declaration() == KV_TRANSFER_DECLARATION


def test_a_different_signature_and_a_macro_name() -> None:
    [signature] = launch_header.kernel_signatures(OTHER_KERNEL)
    assert signature.launcher_declaration() == (
        'extern "C" uint32_t aclrtlaunch_scale_rows(uint32_t blockDim, aclrtStream stream, void* src, void* dst, '
        "int32_t rows, float factor)")


def test_compile_definitions_rename_the_kernel_as_the_preprocessor_would() -> None:
    definitions = launch_header.parse_definitions(["LMCACHE_NPU_SOC_310P=1;MY_KERNEL=scale_rows_310p"])
    [signature] = launch_header.kernel_signatures(OTHER_KERNEL, definitions)
    assert signature.name == "scale_rows_310p" and signature.header_name == "aclrtlaunch_scale_rows_310p.h"


def test_a_kernel_without_parameters_and_one_it_cannot_read() -> None:
    [signature] = launch_header.kernel_signatures('extern "C" __global__ __aicore__ void ping(void) {}')
    expected = 'extern "C" uint32_t aclrtlaunch_ping(uint32_t blockDim, aclrtStream stream)'
    assert signature.launcher_declaration() == expected
    with pytest.raises(ValueError, match="cannot read parameter"):
        launch_header.kernel_signatures('extern "C" __global__ __aicore__ void bad(GM_ADDR) {}')


def test_the_generated_files_compile_against_each_other(tmp_path: Path) -> None:
    """Header and stub from the command line, as CMake runs it; the stub defines exactly what the header declares
    (an extern "C" mismatch would not compile). acl/acl_base.h is a two-line stand-in here: no toolchain needed."""
    (tmp_path / "kernel.cpp").write_text(OTHER_KERNEL)
    (tmp_path / "acl").mkdir()
    (tmp_path / "acl" / "acl_base.h").write_text("#include <cstdint>\ntypedef void *aclrtStream;\n")
    include_dir, stub = tmp_path / "include" / "k", tmp_path / "auto_gen" / "stub.cpp"
    rc = launch_header.main(["--include-dir", str(include_dir), "--stub-source", str(stub),
                             str(tmp_path / "kernel.cpp")])
    assert rc == 0
    header = (include_dir / "aclrtlaunch_scale_rows.h").read_text()
    assert "#define ACLRT_LAUNCH_KERNEL(kernel_func) aclrtlaunch_##kernel_func" in header
    result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", f"-I{include_dir}", str(stub)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_source_without_a_kernel_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.cpp").write_text("int x;\n")
    rc = launch_header.main(["--include-dir", str(tmp_path), "--stub-source", str(tmp_path / "s.cpp"),
                             str(tmp_path / "empty.cpp")])
    assert rc == 1
