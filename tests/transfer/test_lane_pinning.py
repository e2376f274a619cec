"""`transfer_cpus`: the store key that pins the worker's transfer lanes (issue 41's CPU-engine runs keep the copies off
the model's core): parsed and refused like every key, and the lanes' threads really run on those CPUs only."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lmcache_npu.config import load_config
from lmcache_npu.platform.threads import pin_thread
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.transfer import KVMover, StreamKit
from lmcache_npu.ops import get_backend

from .ordering import BLOCK, BLOCKS, CHUNK, LAYERS

ALLOWED = sorted(os.sched_getaffinity(0))


def test_transfer_cpus_default_to_no_pinning_and_parse_as_a_tuple() -> None:
    assert StoreConfig().transfer_cpus is None
    assert load_config({"transfer_cpus": [1, 0]}).store.transfer_cpus == (1, 0)
    assert load_config({"transfer_cpus": None}).store.transfer_cpus is None


@pytest.mark.parametrize("value", [[], "1", [1, 1], [-1], [True], [1.5], 3])
def test_a_bad_cpu_list_is_refused_naming_the_key(value) -> None:
    with pytest.raises(ValueError, match="transfer_cpus"):
        load_config({"transfer_cpus": value})


def test_transfer_cpus_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_NPU_TRANSFER_CPUS", "[0]")
    assert load_config({}).store.transfer_cpus == (0,)
    monkeypatch.setenv("LMCACHE_NPU_TRANSFER_CPUS", "null")
    assert load_config({}).store.transfer_cpus is None


def test_transfer_cpus_are_the_engines_own_with_a_node_cache() -> None:
    config = load_config({"node_cache": "/run/x.sock", "transfer_cpus": [0]})  # not a node cache key: accepted
    assert config.store.transfer_cpus == (0,)


def _affinity_on_a_thread(cpus) -> tuple[bool, set[int]]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append((pin_thread(cpus), os.sched_getaffinity(0))))
    thread.start()
    thread.join()
    return out[0]


def test_pin_thread_pins_the_calling_thread_only() -> None:
    before = os.sched_getaffinity(0)
    assert _affinity_on_a_thread([ALLOWED[-1]]) == (True, {ALLOWED[-1]})
    assert os.sched_getaffinity(0) == before  # the caller's own thread is untouched


def test_a_cpu_outside_the_process_leaves_the_thread_unpinned(caplog) -> None:
    pinned, mask = _affinity_on_a_thread([max(ALLOWED) + 1000])
    assert not pinned and mask == os.sched_getaffinity(0)
    assert "left unpinned" in caplog.text


def test_the_movers_lanes_run_on_the_transfer_cpus() -> None:
    from types import SimpleNamespace

    from lmcache_npu.layout.discovery import LayoutPolicy, discover_layout
    from .ordering import FullAttentionSpec as Spec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=Spec())])
    caches = {n: torch.zeros((BLOCKS, 2, BLOCK, 8, 128), dtype=torch.bfloat16) for n in names}
    layout = discover_layout(config, caches, LayoutPolicy(chunk_tokens=CHUNK))
    cpu = ALLOWED[-1]
    mover = KVMover(layout, lambda: get_backend("emu"), lambda: StreamKit.for_device(torch.device("cpu")), 0, 0,
                    TierCounters(), cpus=[cpu])
    try:
        lanes = list(mover._lanes.values())
        for _ in range(200):  # the lanes pin themselves as their loop starts
            if all(os.sched_getaffinity(lane.thread.native_id) == {cpu} for lane in lanes):
                break
            threading.Event().wait(0.01)
        assert [os.sched_getaffinity(lane.thread.native_id) for lane in lanes] == [{cpu}, {cpu}]
    finally:
        mover.close()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_a_lane_leaves_the_cores_its_engine_pinned_it_to() -> None:
    """The tools pin the engine's thread first (tools/cores.py); a lane it starts inherits that mask and must still
    reach its own core."""
    engine, lane = ALLOWED[0], ALLOWED[-1]
    out: list = []

    def engine_thread() -> None:
        os.sched_setaffinity(0, {engine})
        out.append(_affinity_on_a_thread([lane]))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert out == [(True, {lane})]
