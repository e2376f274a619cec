"""The same checks on a real Ascend NPU: needs torch_npu, CANN and lmcache_npu._npu; skipped elsewhere."""

from __future__ import annotations


import pytest
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, select_device, skip_or_fail

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]


@pytest.fixture(scope="module")
def backend():
    from lmcache_npu.ops import BackendUnavailable, get_backend

    select_device(0)
    try:
        return get_backend("npu")
    except BackendUnavailable as exc:
        skip_or_fail(str(exc))


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-32b", "deepseek-v3", "deepseek-v3.2-c8",
                                    "deepseek-v4-flash", "gemma3-27b", "gpt-oss-120b", "qwen3-next-80b",
                                    "llama3-8b-310p"])
@pytest.mark.parametrize("chunks", [1, 16])
def test_presets_round_trip_on_npu(backend, preset: str, chunks: int) -> None:
    from lmcache_npu.tools.bench.runner import run_bench

    if preset.endswith("310p") != (backend.soc.name == "310p"):
        pytest.skip(f"{preset} is for {'310P (kernels-only)' if preset.endswith('310p') else 'A2/A3'}; this is "
                    f"{backend.soc.name}")
    report = run_bench(preset, "npu", chunks=chunks, check=True, progress=False)
    assert report.check == "ok"
