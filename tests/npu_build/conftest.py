"""One toolchain fetch and one _npu build per test run, shared by the xdist workers (docs/npu_build.md).

The toolchain (torch / torch_npu wheels' headers and libraries) is cached in build/npu-toolchain across runs. The
build and its check results are made once per run under build/npu-build-check-tests, by whichever worker asks
first; the others wait on a file lock and reuse them (keyed by xdist's run id). The stand-in toolkit is its own
step, so a test that needs only it runs beside the build.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from build_checks.npu_build.check_npu_build import (BuildResult, check_build, configure_and_build,
                                              post_build_checks)
from build_checks.npu_build.elf_checks import CheckResult
from build_checks.npu_build.standin import assemble_standin
from build_checks.npu_build.toolchain import ROOT, Toolchain, ToolchainUnavailable, ensure_toolchain

SHARED = ROOT / "build" / "npu-build-check-tests"


@dataclass(frozen=True)
class SharedBuild:
    standin: Path
    build: BuildResult
    checks: list[CheckResult]


@pytest.fixture(scope="session")
def npu_toolchain() -> Toolchain:
    try:
        return ensure_toolchain()
    except ToolchainUnavailable as error:  # no network: nothing to build against, say so instead of failing
        pytest.skip(f"the torch / torch_npu wheels could not be fetched (network?): {error}")


def _run_id() -> str:
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"


def _load(record: dict[str, object]) -> SharedBuild:
    build = BuildResult(bool(record["ok"]), Path(str(record["build_dir"])), Path(str(record["package_dir"])),
                        str(record["log"]))
    checks = [CheckResult.from_dict(c) for c in record["checks"]]  # type: ignore[attr-defined]
    return SharedBuild(Path(str(record["standin"])), build, checks)


@contextmanager
def _once_per_run(name: str) -> Iterator[tuple[dict[str, object] | None, Path]]:
    """Under a lock: the record `name` left by this run's first worker (None: make it) and where it goes."""
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(SHARED / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record_path = SHARED / f"{name}.json"
        record = json.loads(record_path.read_text()) if record_path.exists() else None
        yield (record if record and record.get("run_id") == _run_id() else None), record_path


@pytest.fixture(scope="session")
def npu_standin(npu_toolchain: Toolchain) -> Path:
    """The stand-in CANN toolkit (real ACL headers, stub lib64), assembled once per run."""
    with _once_per_run("standin") as (record, record_path):
        if record is None:
            standin = assemble_standin(SHARED / "standin_cann", npu_toolchain)
            record = {"run_id": _run_id(), "standin": str(standin)}
            record_path.write_text(json.dumps(record))
        return Path(str(record["standin"]))


@pytest.fixture(scope="session")
def npu_build(npu_toolchain: Toolchain, npu_standin: Path) -> SharedBuild:
    """The repository's csrc/ascendc built against the stand-in CANN, with every post-build check's result."""
    with _once_per_run("build") as (record, record_path):
        if record is None:
            scratch = SHARED / "repository"
            shutil.rmtree(scratch, ignore_errors=True)
            build = configure_and_build(ROOT, scratch, npu_toolchain, npu_standin)
            built = check_build(build)
            checks = [built, *post_build_checks(build, npu_toolchain, npu_standin)] if built.passed else [built]
            record = {"run_id": _run_id(), "ok": build.ok, "build_dir": str(build.build_dir),
                      "package_dir": str(build.package_dir), "log": build.log, "standin": str(npu_standin),
                      "checks": [c.to_dict() for c in checks]}
            record_path.write_text(json.dumps(record))
        return _load(record)


def install_script_verdict(package_dir: Path, loader_path: Path) -> subprocess.CompletedProcess[str]:
    """docker/install.sh's own check of an installed _npu (readelf, ldd -r), run on a build output here."""
    script = ('set -euo pipefail; say() { echo "lmcache_npu install: $*"; }; '
              'pkg=$1; build_env=(env "LD_LIBRARY_PATH=$2"); '
              "eval \"$(sed -n '/^verify_npu_module() {/,/^}/p' \"$3\")\"; "
              'verify_npu_module "$(compgen -G "$pkg/_npu.*.so" | head -n 1)"')
    return subprocess.run(["bash", "-c", script, "verify", str(package_dir), str(loader_path),
                           str(ROOT / "docker" / "install.sh")], capture_output=True, text=True)
