"""DeepSeek presets served with MTP speculative decoding (`catalog.with_mtp`): the MTP layers' KV is registered as
the engine registers it, discovered into planes, stored with the rest, and round-trips byte for byte."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lmcache_npu.tools.presets import build_preset, get_model, preset_layout  # noqa: E402
from lmcache_npu.tools.presets.catalog import MODELS, with_mtp  # noqa: E402

from .test_presets import _round_trip  # noqa: E402

MTP_CASES = [("deepseek-v3", "ascend"), ("deepseek-v3", "cuda"), ("deepseek-v3.2-c8", "ascend"),
             ("deepseek-v4-flash", "ascend")]


def _mtp_layer(name: str) -> str:
    return "mtp.0.self_attn.swa_cache" if "v4" in name else "model.layers.61.self_attn.attn"


@pytest.mark.parametrize("name,family", MTP_CASES)
def test_mtp_planes_are_stored_with_the_rest(name: str, family: str) -> None:
    layout, preset = preset_layout(with_mtp(MODELS[name]), family, num_blocks=4)
    plain, _ = preset_layout(name, family, num_blocks=4)
    mtp = _mtp_layer(name)
    planes = [p for p in layout.plan.planes if p.name.split(":", 1)[0] == mtp]
    assert planes, f"no plane of {mtp}"
    group = next(g for g in layout.groups if mtp in g.layers)
    assert not group.skipped
    extra = layout.bytes_per_chunk - plain.bytes_per_chunk
    rows = group.rows_per_chunk
    assert extra == sum(p.row_bytes for p in planes) * rows, "the MTP layer adds exactly its own rows to a chunk"
    assert not any(p.name.split(":", 1)[0] == mtp for p in plain.plan.planes)


def test_v3_mtp_layer_joins_the_mla_group_unflagged() -> None:
    """vLLM 0.23 flags no group for DeepSeek-V3 MTP (its coordinator then drops the last block of every group)."""
    preset = build_preset(with_mtp(MODELS["deepseek-v3"]), "ascend", max_layers=2)
    (group,) = preset.kv_cache_config.kv_cache_groups
    assert group.layer_names[-1] == "model.layers.61.self_attn.attn"
    assert not group.is_eagle_group


def test_v4_mtp_group_is_the_eagle_group() -> None:
    """vLLM's DeepSeek-V4 rule: the group holding the last layer (the MTP layer's SWA cache) is flagged."""
    preset = build_preset(with_mtp(MODELS["deepseek-v4-flash"]), "ascend")
    flagged = [g for g in preset.kv_cache_config.kv_cache_groups if g.is_eagle_group]
    assert len(flagged) == 1 and "mtp.0.self_attn.swa_cache" in flagged[0].layer_names
    plain = build_preset("deepseek-v4-flash", "ascend")
    assert not any(g.is_eagle_group for g in plain.kv_cache_config.kv_cache_groups)  # negative control


def test_trimming_keeps_the_mtp_layers() -> None:
    model = get_model(with_mtp(MODELS["deepseek-v3"], 2), "ascend", max_layers=3)
    names = [n for n, _ in model.layers]
    assert names == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 61, 62)]


@pytest.mark.parametrize("model", ["llama3-8b", "gemma3-27b"])
def test_mtp_is_refused_where_it_is_not_modelled(model: str) -> None:
    with pytest.raises(ValueError, match="DeepSeek"):
        with_mtp(MODELS[model])


def test_mtp_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already has"):
        with_mtp(MODELS["deepseek-v4-flash-a5"])
    with pytest.raises(ValueError, match="not a DeepSeek MLA model without MTP"):
        with_mtp(with_mtp(MODELS["deepseek-v3"]))


@pytest.mark.parametrize("backend", ["emu", "torch"])
@pytest.mark.parametrize("name,family", MTP_CASES)
def test_mtp_round_trip(name: str, family: str, backend: str) -> None:
    _round_trip(with_mtp(MODELS[name]), family, backend)
