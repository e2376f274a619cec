"""The kernel source against the real open AscendC headers (build_checks/check_ascendc_headers.sh), where an operator
has them: ASC_DEVKIT, ASC_TOOLS and STUB_FUN_DIR (see the script). Skipped with the script's reason elsewhere. A
deliberately wrong kernel must fail the same check."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build_checks" / "check_ascendc_headers.sh"
SKIPPED = 77


def _check(source: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if source is not None:
        env["KERNEL_SOURCE"] = str(source)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode == SKIPPED:
        pytest.skip(result.stdout.strip())
    return result


def test_the_kernel_is_clean_against_the_real_headers() -> None:
    result = _check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") >= 2  # A2 and 310P


def test_negative_control_a_misspelt_member_fails(tmp_path: Path) -> None:
    broken = tmp_path / "broken_kernel.cpp"
    broken.write_text('#include "kv_transfer.h"\n'
                      "void Broken() { AscendC::DataCopyParams params; params.blockCnt = 1; params.blockCount = 2; }\n")
    result = _check(broken)
    assert result.returncode == 1, result.stdout
    assert "FAIL" in result.stdout and "blockCount" in result.stdout


def test_without_the_headers_the_script_says_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ASC_DEVKIT", "ASC_TOOLS", "STUB_FUN_DIR")}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == SKIPPED
    assert "ASC_DEVKIT" in result.stdout and "STUB_FUN_DIR" in result.stdout
