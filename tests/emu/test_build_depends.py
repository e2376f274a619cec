"""setup.py declares every repository header an extension includes, so an edit to the kernel header or the emulator
rebuilds `_emu` (setuptools rebuilds when a source or a `depends` entry is newer than the module) instead of leaving a
stale module that still passes."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _extensions(monkeypatch: pytest.MonkeyPatch, cuda: str) -> dict:
    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.setenv("LMCACHE_NPU_CUDA", cuda)
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="lmcache_npu_setup")
    return {ext.name: ext for ext in captured["ext_modules"]}


def test_the_emulator_module_depends_on_the_kernel_and_emulator_headers(monkeypatch) -> None:
    emu = _extensions(monkeypatch, "0")["lmcache_npu._emu"]
    assert set(emu.depends) == {"csrc/ascendc/kv_transfer.h", "csrc/ascendc/kv_transfer_kernel.cpp",
                                "csrc/ascendc/emu/ascendc_emu.h", "csrc/ascendc/emu/emu_runtime.h",
                                "csrc/common/transfer_plan.h", "csrc/bindings/kernel_entry.h"}
    assert "csrc/cuda/kv_transfer_cuda.h" not in emu.depends  # only what it includes


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH (the CUDA module is not configured)")
def test_the_cuda_module_depends_on_its_kernel_sources_and_headers(monkeypatch) -> None:
    cuda = _extensions(monkeypatch, "1")["lmcache_npu._cuda"]
    assert {"csrc/cuda/kv_transfer.cu", "csrc/cuda/kv_transfer_cuda.h", "csrc/common/transfer_plan.h"} <= set(
        cuda.depends)
    assert not any("ascendc" in path for path in cuda.depends)
