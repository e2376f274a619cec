"""Which planes discovery marks replicated across the TP group, and the object order that keeps them one
contiguous tail (`TransferPlan.replicated_offset`); tp_size 1 lays the object out exactly as before."""

from __future__ import annotations

import pytest
import torch

from lmcache_npu.layout.discovery import LayoutPolicy, replicated_across_tp, replication_factor, share_group_ranks
from lmcache_npu.tools.presets import preset_layout
from lmcache_npu.layout.specs import SpecKind
from lmcache_npu.ops import GroupSpec, Plane, TransferPlan


@pytest.mark.parametrize("kind, tp, heads, expected", [
    (SpecKind.MLA, 2, None, True),
    (SpecKind.SLIDING_WINDOW_MLA, 8, 128, True),
    (SpecKind.COMPRESSOR_STATE, 4, None, True),
    (SpecKind.MLA, 1, None, False),  # one rank: nothing to share
    (SpecKind.FULL_ATTENTION, 2, 1, True),  # one KV head: every rank holds it whole
    (SpecKind.SLIDING_WINDOW, 4, 1, True),
    (SpecKind.FULL_ATTENTION, 2, 2, False),  # one head per rank: split, not replicated
    (SpecKind.FULL_ATTENTION, 4, 2, False),  # replicated in pairs only: kept whole per rank
    (SpecKind.FULL_ATTENTION, 2, None, False),  # heads unknown: never guessed
    (SpecKind.MAMBA, 2, 1, False),  # recurrent states split by heads
])
def test_replicated_kinds(kind: SpecKind, tp: int, heads, expected: bool) -> None:
    assert replicated_across_tp(kind, tp, heads) is expected


def _pages(row_bytes: int) -> torch.Tensor:
    return torch.zeros(4, 16 * row_bytes, dtype=torch.uint8)


def test_replicated_planes_form_the_objects_tail_and_tp1_is_unchanged() -> None:
    def plan(shared: bool) -> TransferPlan:
        return TransferPlan([GroupSpec(16), GroupSpec(16)],
                            [Plane(_pages(100), 0, 16, 100, name="mla", replicated=shared),
                             Plane(_pages(30), 1, 16, 30, name="heads")], 32)

    whole, split = plan(False), plan(True)
    assert whole.object_offsets == (0, 3200) and whole.replicated_offset == whole.object_bytes
    assert whole.replicated_bytes == 0
    # the replicated plane moves behind the head-split one; sizes stay, the fingerprint tells the layouts apart
    assert split.object_offsets == (960, 0) and split.replicated_offset == 960
    assert split.replicated_bytes == split.object_bytes - 960 == 3200
    assert split.object_bytes == whole.object_bytes and split.gap_free and whole.gap_free
    assert split.fingerprint != whole.fingerprint


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v4-flash"])
def test_presets_at_tp2_replicate_every_stored_group(name: str) -> None:
    layout, _ = preset_layout(name, "cuda", num_blocks=2)
    base = LayoutPolicy(chunk_tokens=layout.plan.chunk_tokens)
    assert not any(p.replicated for p in layout.plan.planes)
    from lmcache_npu.layout.discovery import discover_layout
    from lmcache_npu.tools.presets import build_preset

    preset = build_preset(name, "cuda", 2)
    import dataclasses

    shared = discover_layout(preset.kv_cache_config, preset.kv_caches, dataclasses.replace(base, tp_size=2),
                             preset.attention_backends)
    assert all(p.replicated for p in shared.plan.moved_planes)
    assert all(g.replicated for g in shared.groups if not g.skipped)
    assert shared.plan.replicated_offset == 0 and shared.plan.object_bytes == layout.plan.object_bytes
    assert shared.plan.object_offsets == layout.plan.object_offsets  # all replicated: the same bytes, in order


def test_bad_tp_policy_is_named() -> None:
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        LayoutPolicy(tp_size=0)
    with pytest.raises(ValueError, match="total_kv_heads must be >= 1"):
        LayoutPolicy(total_kv_heads=0)


@pytest.mark.parametrize("kind, tp, heads, factor", [
    (SpecKind.MLA, 8, None, 8),
    (SpecKind.FULL_ATTENTION, 8, 4, 2),  # Qwen3-235B's 4 KV heads at TP=8: ranks {0,1}, {2,3}, ... hold one head each
    (SpecKind.SLIDING_WINDOW, 16, 8, 2),
    (SpecKind.FULL_ATTENTION, 8, 1, 8),
    (SpecKind.FULL_ATTENTION, 8, 8, 1),  # one head per rank
    (SpecKind.FULL_ATTENTION, 6, 4, 1),  # heads that do not divide TP: vLLM's own split, never guessed
    (SpecKind.FULL_ATTENTION, 8, None, 1),
    (SpecKind.MAMBA, 8, 1, 1),
    (SpecKind.MLA, 1, None, 1),
])
def test_replication_factor(kind: SpecKind, tp: int, heads, factor: int) -> None:
    assert replication_factor(kind, tp, heads) == factor
    assert replicated_across_tp(kind, tp, heads) is (tp > 1 and factor == tp)


def test_share_group_is_the_gcd_of_the_replicated_groups() -> None:
    assert share_group_ranks([1, 1]) == 1
    assert share_group_ranks([8, 1]) == 8
    assert share_group_ranks([8, 2, 1]) == 2  # MLA (all 8) with GQA pairs: pairs hold both identically
    assert share_group_ranks([6, 4]) == 2


def test_gqa_with_fewer_kv_heads_than_tp_ranks_shares_within_pairs() -> None:
    import dataclasses

    from lmcache_npu.layout.discovery import discover_layout
    from lmcache_npu.tools.presets import build_preset

    preset = build_preset("llama3-8b", "cuda", 2)  # 8 KV heads
    base = LayoutPolicy(chunk_tokens=256)
    at = {tp: discover_layout(preset.kv_cache_config, preset.kv_caches,
                              dataclasses.replace(base, tp_size=tp, total_kv_heads=8), preset.attention_backends)
          for tp in (1, 8, 16, 32)}
    assert [at[tp].share_ranks for tp in (1, 8, 16, 32)] == [1, 1, 2, 4]
    for tp in (16, 32):
        assert all(p.replicated for p in at[tp].plan.moved_planes)
        assert at[tp].to_json()["share_ranks"] == tp // 8
    assert not any(p.replicated for p in at[8].plan.moved_planes)  # one head per rank: nothing identical
