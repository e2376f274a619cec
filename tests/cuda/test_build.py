"""`LMCACHE_NPU_CUDA=1 python setup.py build_ext` compiles the CUDA module on a machine with nvcc and no GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_forced_cuda_build_compiles_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "LMCACHE_NPU_CUDA": "1", "LMCACHE_NPU_CUDA_ARCHS": "90"}
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp",
         str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    built = list((tmp_path / "lib" / "lmcache_npu").glob("_cuda*.so"))
    assert built, "lmcache_npu._cuda was not produced"
