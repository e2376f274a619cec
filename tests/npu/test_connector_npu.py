"""The connector inside vLLM-Ascend: vllm-ascend's own spec classes size the pages as our presets do, and every
Ascend preset runs the connector scenario of tests/integration (vLLM's real Scheduler, a simulated model writing
and checking every row) with its KV caches on the NPU and the AscendC kernel moving the bytes. On 310P this drives
the kernels and the connector directly (no vllm-ascend model runner): vllm-ascend refuses every KV connector on 310P
at start-up, so 310P is kernels-only and this is not a claim that `vllm serve` with the plugin runs there."""

from __future__ import annotations


import pytest
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, NEEDS_VLLM_ASCEND, select_device, skip_or_fail

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_VLLM_ASCEND, NEEDS_NPU_MODULE]
ASCEND_PRESETS = ["llama3-8b", "qwen3-32b", "deepseek-v3", "deepseek-v3.2-c8", "deepseek-v4-flash", "gemma3-27b",
                  "gpt-oss-120b", "qwen3-next-80b", "llama3-8b-310p"]


@pytest.fixture(scope="module")
def soc() -> str:
    from lmcache_npu.ops import BackendUnavailable, get_backend

    select_device(0)
    try:
        return get_backend("npu").soc.name
    except BackendUnavailable as exc:
        skip_or_fail(str(exc))


def test_vllm_ascends_spec_classes_size_pages_as_the_stand_ins_do() -> None:
    from lmcache_npu.tools.presets.ascend import _stand_in_classes, ascend_spec_classes

    real, stand_in = ascend_spec_classes(), _stand_in_classes()
    assert [c.__module__.split(".")[0] for c in real] == ["vllm_ascend", "vllm_ascend"], \
        "vllm_ascend imports but its spec classes did not: the presets would use the stand-ins"
    import torch

    mla = dict(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    for kwargs in (mla, {**mla, "head_size": 128, "scale_dim": 1, "scale_dtype": torch.float16},
                   {**mla, "cache_sparse_li_c8": True, "sparse_head_dim": (512, 64, 128)}):
        assert real[0](**kwargs).page_size_bytes == stand_in[0](**kwargs).page_size_bytes, kwargs
    swa = dict(block_size=128, num_kv_heads=1, head_size=512, dtype=torch.bfloat16, sliding_window=128)
    assert real[1](**swa).real_page_size_bytes == stand_in[1](**swa).real_page_size_bytes


@pytest.mark.parametrize("preset", ASCEND_PRESETS)
def test_prefix_is_loaded_exactly_on_the_npu(soc: str, preset: str) -> None:
    from ..integration.conftest import PRESET_ENGINES, prefix_is_loaded_exactly
    from ..integration.engine import Engine, EngineSpec

    if preset.endswith("310p") != (soc == "310p"):
        pytest.skip(f"{preset} is for {'310P (kernels-only)' if preset.endswith('310p') else 'A2/A3'}; this is {soc}")
    settings = {**PRESET_ENGINES[(preset, "ascend")]}
    settings.pop("extra_config", None)  # SoC options are the emulator's; the NPU reports its own
    engine = Engine(EngineSpec(preset=preset, family="ascend", backend="npu", device="npu:0", **settings))
    try:
        prefix_is_loaded_exactly(engine)
    finally:
        engine.close()
