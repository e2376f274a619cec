"""A model's config.json becomes the same plan as the hand-written preset of that model (bytes per chunk, planes),
so `lmcache-npu doctor --model-config` shows what the connector will store."""

from __future__ import annotations

import pytest

from lmcache_npu.tools.presets import preset_layout
from lmcache_npu.tools.presets.catalog import model_from_hf_config

pytest.importorskip("vllm", reason="presets are built from vLLM's spec classes")

CONFIGS = {
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"},
    "deepseek-v3": {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128,
                    "hidden_size": 7168},
    "gemma3-27b": {"text_config": {"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                                   "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                                   "sliding_window_pattern": 6}},
    "gpt-oss-120b": {"num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                     "hidden_size": 2880, "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18},
    "qwen3-next-80b": {"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                       "hidden_size": 2048, "full_attention_interval": 4, "linear_num_key_heads": 16,
                       "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                       "linear_conv_kernel_dim": 4},
}


@pytest.mark.parametrize("preset", sorted(CONFIGS))
def test_a_config_json_makes_the_presets_plan(preset: str) -> None:
    model = model_from_hf_config(CONFIGS[preset], preset)
    from_config, _ = preset_layout(model, "ascend", num_blocks=4)
    from_preset, _ = preset_layout(preset, "ascend", num_blocks=4)
    assert from_config.bytes_per_chunk == from_preset.bytes_per_chunk
    assert [p.row_bytes for p in from_config.plan.moved_planes] == [p.row_bytes for p in from_preset.plan.moved_planes]


def test_negative_control_a_different_config_makes_a_different_plan() -> None:
    other = dict(CONFIGS["llama3-8b"], num_key_value_heads=4)
    from_config, _ = preset_layout(model_from_hf_config(other), "ascend", num_blocks=4)
    from_preset, _ = preset_layout("llama3-8b", "ascend", num_blocks=4)
    assert from_config.bytes_per_chunk != from_preset.bytes_per_chunk


def test_an_unknown_layer_type_is_named() -> None:
    bad = dict(CONFIGS["gpt-oss-120b"], layer_types=["sliding_attention", "chunked_attention"] * 18)
    with pytest.raises(ValueError, match="layer 1 has layer type 'chunked_attention'"):
        model_from_hf_config(bad, "gpt")
