"""CANN's re-link of the kernel library, as the stand-in models it (findings F1, F9; docs/npu_build.md): after linking,
ascendc_library deletes the library and replays CMakeFiles/<target>.dir/link.txt split on whitespace without a shell,
so a RUNPATH CMake gives the library comes out shell-quoted, and a generator that writes no link.txt fails the build.
A tiny project (one ascendc_library, no torch) keeps each build to a second or two."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from build_checks.npu_build.check_npu_build import KERNEL_LIBRARY, RELINK_MARK
from build_checks.npu_build.elf_checks import check_no_search_path, check_search_path
from build_checks.npu_build.toolchain import ROOT

from .conftest import SharedBuild, install_script_verdict

_MISSING = [tool for tool in ("cmake", "make", "g++", "readelf") if shutil.which(tool) is None]
if _MISSING:
    pytest.skip(f"the re-link tests need {', '.join(_MISSING)} on PATH", allow_module_level=True)

RELINK = ROOT / "build_checks/npu_build/standin_cann/tools/tikcpp/ascendc_kernel_cmake/relink.py"
KERNEL = ROOT / "csrc" / "ascendc" / "kv_transfer_kernel.cpp"
# what csrc/ascendc/CMakeLists.txt gave the kernel library before the fix, and what it gives it now
BEFORE_FIX = 'BUILD_WITH_INSTALL_RPATH TRUE INSTALL_RPATH "$ORIGIN"'
AFTER_FIX = "SKIP_BUILD_RPATH TRUE"
PROBE_CMAKELISTS = """cmake_minimum_required(VERSION 3.16)
project(relink_probe LANGUAGES C CXX)
include(${ASCEND_CANN_PACKAGE_PATH}/tools/tikcpp/ascendc_kernel_cmake/ascendc.cmake)
set(CMAKE_SKIP_RPATH FALSE)
ascendc_library(probe_kernels SHARED ${KERNEL_SOURCE})
ascendc_include_directories(probe_kernels PRIVATE ${KERNEL_DIR} ${KERNEL_DIR}/..)
set_target_properties(probe_kernels PROPERTIES @PROPERTIES@)
"""


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def build_probe(where: Path, standin: Path, properties: str,
                generator: str = "Unix Makefiles") -> tuple[subprocess.CompletedProcess[str], Path]:
    """Configures and builds the probe project; the build's result and where its library lands."""
    source, build = where / "src", where / "build"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text(PROBE_CMAKELISTS.replace("@PROPERTIES@", properties))
    configure = _run(["cmake", "-G", generator, "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Debug",
                      f"-DASCEND_CANN_PACKAGE_PATH={standin}", "-DSOC_VERSION=ascend910b1",
                      f"-DASCEND_PYTHON_EXECUTABLE={sys.executable}", f"-DKERNEL_SOURCE={KERNEL}",
                      f"-DKERNEL_DIR={KERNEL.parent}"])
    assert configure.returncode == 0, configure.stdout[-2000:] + configure.stderr[-2000:]
    return _run(["cmake", "--build", str(build)]), build / "lib" / "libprobe_kernels.so"


@pytest.fixture(scope="module")
def garbled_probe(npu_standin: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The probe with the pre-fix RUNPATH properties: its build log and its library."""
    result, library = build_probe(tmp_path_factory.mktemp("before_fix"), npu_standin, BEFORE_FIX)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, library


def test_relink_replays_link_txt_split_on_whitespace_without_a_shell(tmp_path: Path) -> None:
    """Shell quoting in link.txt reaches the command literally, and it runs from the target's binary dir."""
    probe = tmp_path / "argv_probe.py"
    probe.write_text("import json, os, sys\n"
                     "open(sys.argv[1], 'w').write(json.dumps({'argv': sys.argv[2:], 'cwd': os.getcwd()}))\n")
    seen = tmp_path / "seen.json"
    link_txt = tmp_path / "CMakeFiles" / "t.dir" / "link.txt"
    link_txt.parent.mkdir(parents=True)
    link_txt.write_text(f"{sys.executable} {probe} {seen} -shared  -Wl,-rpath,\"\\$ORIGIN\" 'a b'\n\n")
    result = _run([sys.executable, str(RELINK), "--root-dir", str(tmp_path), "--target-name", "t"])
    assert result.returncode == 0, result.stderr
    recorded = json.loads(seen.read_text())
    assert recorded["argv"] == ["-shared", '-Wl,-rpath,"\\$ORIGIN"', "'a", "b'"]
    assert Path(recorded["cwd"]) == tmp_path
    assert result.stdout.startswith(RELINK_MARK)


def test_relink_without_link_txt_names_the_makefile_generator(tmp_path: Path) -> None:
    result = _run([sys.executable, str(RELINK), "--root-dir", str(tmp_path), "--target-name", "probe_kernels"])
    assert result.returncode == 1
    assert "CMakeFiles/probe_kernels.dir/link.txt does not exist" in result.stderr, result.stderr
    assert '-G "Unix Makefiles"' in result.stderr and "Traceback" not in result.stderr


def test_negative_control_a_kernel_library_runpath_comes_out_garbled(garbled_probe: tuple[str, Path]) -> None:
    """F1 reproduced: the pre-fix properties write -Wl,-rpath,"\\$ORIGIN" into link.txt; replayed without a shell,
    the RUNPATH is the literal "\\$ORIGIN", which the check names (and which the old check read as no $ORIGIN)."""
    log, library = garbled_probe
    assert RELINK_MARK in log and '-Wl,-rpath,"\\$ORIGIN"' in log, log[-2000:]
    verdict = check_no_search_path(library)
    assert not verdict.passed, verdict
    assert 'RUNPATH ["\\$ORIGIN"]' in verdict.summary and "garbled by CANN's re-link" in verdict.summary, verdict
    assert not check_search_path(library, ["$ORIGIN"]).passed


def test_a_kernel_library_without_runpath_survives_the_relink(npu_standin: Path, tmp_path: Path) -> None:
    result, library = build_probe(tmp_path, npu_standin, AFTER_FIX)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert RELINK_MARK in result.stdout
    assert check_no_search_path(library).passed


def test_the_install_script_refuses_a_garbled_kernel_library(npu_build: SharedBuild, npu_standin: Path,
                                                              garbled_probe: tuple[str, Path], tmp_path: Path) -> None:
    """The real _npu beside a kernel library with the garbled RUNPATH: install.sh fails the image, naming why."""
    npu = npu_build.build.npu_module
    assert npu is not None
    package = tmp_path / "lmcache_npu"
    package.mkdir()
    shutil.copy(npu, package / npu.name)
    shutil.copy(garbled_probe[1], package / KERNEL_LIBRARY)
    verdict = install_script_verdict(package, npu_standin / "lib64")
    assert verdict.returncode != 0, verdict.stdout + verdict.stderr
    assert f"{KERNEL_LIBRARY} has a RUNPATH garbled by CANN's re-link" in verdict.stdout, verdict.stdout


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_a_ninja_build_fails_naming_the_makefile_generator(npu_standin: Path, tmp_path: Path) -> None:
    """F9: under Ninja there is no link.txt to replay; the build fails with the stand-in's clear message."""
    result, _ = build_probe(tmp_path, npu_standin, AFTER_FIX, generator="Ninja")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "link.txt does not exist" in output and '-G "Unix Makefiles"' in output, output[-3000:]


def _cmake_commands(path: Path) -> list[list[str]]:
    """The literal string elements of every list in the file that starts with "cmake"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and node.elts[0].value == "cmake":
            found.append([e.value if isinstance(e, ast.Constant) else "<expr>" for e in node.elts])
    return found


def test_setup_configures_the_device_build_with_unix_makefiles() -> None:
    """setup.py's configure of csrc/ascendc names the generator: CMAKE_GENERATOR=Ninja would break CANN's re-link."""
    configures = [c for c in _cmake_commands(ROOT / "setup.py") if "--build" not in c]
    assert configures, "setup.py runs no cmake configure"
    for command in configures:
        assert ["-G", "Unix Makefiles"] == command[1:3], command
