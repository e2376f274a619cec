"""The `tp_share` key and the decision it drives (`integration/vllm/tp_share.py`): sharing needs TP > 1, the key
not `off`, and a TP process group in this process; otherwise discovery marks nothing replicated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmcache_npu.config import ConnectorConfig
from lmcache_npu.integration.vllm import tp_share
from lmcache_npu.platform.npu_budget import HCCL_SHARE_BUFFER_MB
from lmcache_npu.layout.discovery import LayoutPolicy


def _vllm(tp: int, heads: int = 1) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads))


def test_the_key_takes_auto_or_off_only() -> None:
    assert ConnectorConfig().tp_share == "auto"
    assert ConnectorConfig(tp_share="off").tp_share == "off"
    with pytest.raises(ValueError, match="tp_share must be one of auto, off, got 'on'"):
        ConnectorConfig(tp_share="on")


def test_policy_follows_mode_tp_and_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_share, "exchange_available", lambda: True)
    assert tp_share.tp_policy(_vllm(2, 1), "auto") == (2, 1)
    assert tp_share.tp_policy(_vllm(2, 1), "off") == (1, None)
    assert tp_share.tp_policy(_vllm(1, 1), "auto") == (1, None)
    policy = tp_share.with_tp(LayoutPolicy(chunk_tokens=64), _vllm(4, 8), "auto")
    assert (policy.tp_size, policy.total_kv_heads, policy.chunk_tokens) == (4, 8, 64)
    monkeypatch.setattr(tp_share, "exchange_available", lambda: False)  # ranks simulated in one process
    assert tp_share.tp_policy(_vllm(2, 1), "auto") == (1, None)


def test_no_exchange_outside_torch_distributed() -> None:
    assert tp_share.exchange_available() is False  # this test process never initialised a process group


def test_tp_groups_fall_back_to_tp_innermost_ranges() -> None:
    assert tp_share._tp_groups(4, 2, SimpleNamespace()) == [[0, 1], [2, 3]]
    assert tp_share._tp_groups(4, 2, SimpleNamespace(group_ranks=[[0, 2], [1, 3]])) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="world size 3 is not a multiple of tensor_parallel_size 2"):
        tp_share._tp_groups(3, 2, SimpleNamespace())


def test_the_exchange_key_and_where_auto_puts_the_shares() -> None:
    import torch

    assert ConnectorConfig().tp_share_exchange == "auto"
    with pytest.raises(ValueError, match="tp_share_exchange must be one of auto, device, host, got 'nccl'"):
        ConnectorConfig(tp_share_exchange="nccl")
    # auto: the device fabric where the KV cache is on a device, gloo in host memory on CPU engines
    assert tp_share.device_collective("auto", torch.device("cuda", 0)) == "nccl"
    assert tp_share.device_collective("auto", SimpleNamespace(type="npu")) == "hccl"  # no torch_npu here
    assert tp_share.device_collective("auto", torch.device("cpu")) is None
    assert tp_share.device_collective("host", torch.device("cuda", 0)) is None
    assert tp_share.device_collective("device", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="tp_share_exchange: device needs the KV cache on NPU or CUDA; it is on cpu"):
        tp_share.device_collective("device", torch.device("cpu"))


def test_share_groups_are_consecutive_ranks_of_each_tp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(world_size=4))
    # two TP groups of 4 (TP innermost), 2 KV heads: ranks 0,1 hold head 0 and 2,3 head 1 in each
    assert tp_share._share_groups(4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp_share._share_groups(4, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setattr(parallel_state, "get_tp_group",
                        lambda: SimpleNamespace(world_size=4, group_ranks=[[0, 2, 4, 6], [1, 3, 5, 7]]))
    assert tp_share._share_groups(4, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]  # vLLM's own TP order, then pairs
    with pytest.raises(ValueError, match="share groups of 3 ranks do not divide a TP group of 4"):
        tp_share._share_groups(4, 3)
    with pytest.raises(ValueError, match="vLLM's TP group has 4 ranks, the config says 2"):
        tp_share._share_groups(2, 2)
    plan = SimpleNamespace(object_bytes=4096, replicated_offset=1024, replicated_bytes=3072)
    layout = tp_share.share_layout(plan, 3, 2)
    assert (layout.rank, layout.size) == (1, 2)  # TP rank 3 is the second of its pair
    assert tp_share.share_layout(plan, 3, 1) is None


def test_an_hccl_share_group_is_made_with_a_small_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each HCCL communicator takes 2 x hccl_buffer_size of device memory (200 MB by default) after vLLM sized its KV
    cache: the share groups ask for HCCL_SHARE_BUFFER_MB; other backends keep their defaults."""
    import sys
    import types

    class Options:
        hccl_config: dict = {}

    fake = types.ModuleType("torch_npu")
    fake._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(  # type: ignore[attr-defined]
        ProcessGroupHCCL=types.SimpleNamespace(Options=Options)))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    options = tp_share.group_options("hccl")
    assert isinstance(options, Options) and options.hccl_config == {"hccl_buffer_size": HCCL_SHARE_BUFFER_MB}
    assert HCCL_SHARE_BUFFER_MB < 200
    assert tp_share.group_options("nccl") is None and tp_share.group_options("gloo") is None

    made: list[dict] = []
    monkeypatch.setattr(tp_share, "_share_groups", lambda tp, share: [[0, 1]])
    import torch.distributed as dist

    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: made.append(kwargs) or object())
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    tp_share._group_over_shares(2, 2, "hccl")
    assert made and made[0]["pg_options"].hccl_config == {"hccl_buffer_size": HCCL_SHARE_BUFFER_MB}
