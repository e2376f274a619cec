"""The version adapter against the installed vLLM: its copy of vLLM's sliding-window pruning rule, the failure
channel per group count, version parsing, and the per-request view of a real scheduler output."""

from __future__ import annotations

import pytest

from lmcache_npu.integration.vllm import adapter


@pytest.mark.parametrize("window,block", [(128, 16), (128, 128), (8, 8), (1024, 16), (100, 16)])
def test_the_live_window_rule_matches_vllms_sliding_window_manager(window, block):
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             sliding_window=window)
    manager = SlidingWindowManager(spec, block_pool=BlockPool(64, False, block), enable_caching=False,
                                   kv_cache_group_id=0, scheduler_block_size=block)
    for n in range(0, 4 * window + 3 * block, 7):
        skipped = manager.get_num_skipped_tokens(n) // block * block  # whole blocks are freed
        assert adapter.first_live_window_token(n, window, block) == skipped


def test_failure_channel_by_version_and_groups():
    if adapter.HAS_TRANSFER_RESULTS:
        assert adapter.failure_channel(1) == adapter.failure_channel(6) == "failed_recving"
        assert adapter.failure_channel(6) is adapter.FailureChannel.FAILED_RECVING
    else:
        assert (adapter.failure_channel(1), adapter.failure_channel(2)) == ("invalid_blocks", "none")
        assert adapter.failure_channel(2) is adapter.FailureChannel.NONE


@pytest.mark.parametrize("text,version", [("0.23.0", (0, 23, 0)), ("0.32.0+cpu", (0, 32, 0)),
                                          ("0.24.0.dev12+g1234", (0, 24, 0)), ("1.0", (1, 0, 0))])
def test_version_parsing(text, version):
    assert adapter._version(text) == version


def test_unsupported_parallel_modes_are_named():
    from types import SimpleNamespace

    config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1,
                                                             decode_context_parallel_size=1,
                                                             prefill_context_parallel_size=1, rank=0))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: lmcache_npu stores whole chunks per tensor-"):
        adapter.parallel_place(config)


@pytest.mark.parametrize("preset, family, skipped", [("gemma3-27b", "cuda", 0), ("deepseek-v4-flash", "ascend", 1)])
def test_vllm_is_told_which_groups_a_load_writes_and_that_stores_are_best_effort(make_engine, preset, family,
                                                                                 skipped):
    """vLLM >= 0.32 zeroes new blocks of the groups a load does not write; >= 0.28 recomputes a preempted request
    whose hand-off must be delivered (a cache's store need not be)."""
    from .conftest import preset_engine

    engine = preset_engine(make_engine, preset, family)
    half = engine.connector.scheduler_half
    loaded = engine.connector.get_loaded_kv_cache_group_ids(None)
    assert loaded == tuple(sorted({g.scheduler_group for g in half.groups if not g.skipped}))
    assert len(loaded) == half.num_scheduler_groups - skipped > 0
    assert engine.connector.requires_kv_delivery is False
