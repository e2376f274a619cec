"""The worker pipeline (transfer/pipeline.py), as the connector's worker half and the benches build it: an arena sized
by the store config, the tiers it names, the namespace of the model and the layout; a chunk stored from the pages
and loaded into pages the model overwrote since holds the stored bytes (the overwrite is the control: the check sees
it); closing stops the lanes before the executor."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from lmcache_npu.layout.discovery import LayoutPolicy, discover_layout
from lmcache_npu.ops import get_backend
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.keys import ChunkKey, namespace_of
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.transfer import BlockWindow, DeviceMove
from lmcache_npu.transfer.pipeline import WorkerPipeline, build_worker_pipeline
from lmcache_npu.transfer.share_mover import ShareExchange, SharedMover
from lmcache_npu.transfer.shares import ShareLayout

from . import ordering

MODEL = b"m" * 16


def cpu_pipeline(store: StoreConfig) -> tuple[WorkerPipeline, dict[str, torch.Tensor]]:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(ordering.LAYERS)]
    config = SimpleNamespace(num_blocks=ordering.BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        SimpleNamespace(layer_names=names, kv_cache_spec=ordering.FullAttentionSpec())])
    generator = torch.Generator().manual_seed(7)
    caches = {n: torch.randn((ordering.BLOCKS, 2, ordering.BLOCK, 8, 128), generator=generator).to(torch.bfloat16)
              for n in names}
    layout = discover_layout(config, caches, LayoutPolicy(chunk_tokens=ordering.CHUNK))
    return build_worker_pipeline(layout, store, 0, lambda: get_backend("torch"), TierCounters(),
                                 model_identity=MODEL), caches


def test_the_arena_tiers_and_namespace_follow_the_store_config(tmp_path) -> None:
    probe, _ = cpu_pipeline(StoreConfig(cpu_bytes=1 << 24, pinned=False, hugepages="off"))
    plan = probe.mover.layout.plan
    probe.close()
    assert probe.remote is None and probe.disk is None  # no tier the config does not name
    store = StoreConfig(cpu_bytes=3 * slot_bytes_for(plan.object_bytes) + 1, pinned=False, hugepages="off",
                        disk_path=str(tmp_path), disk_bytes=64 << 20)
    pipeline, _ = cpu_pipeline(store)
    try:
        assert pipeline.arena.num_slots == 3 and pipeline.object_bytes == plan.object_bytes
        assert pipeline.layout_fingerprint == plan.fingerprint
        assert pipeline.namespace == namespace_of(MODEL, plan.fingerprint)
        assert pipeline.disk is not None and pipeline.remote is None
        assert pipeline.executor.mover is pipeline.mover  # no share exchange without replicated planes
    finally:
        pipeline.close()


def test_a_stored_chunk_loads_back_over_pages_the_model_overwrote() -> None:
    pipeline, caches = cpu_pipeline(StoreConfig(cpu_bytes=1 << 24, pinned=False, hugepages="off"))
    try:
        window = BlockWindow((0,), (tuple(range(1, 1 + ordering.CHUNK // ordering.BLOCK)),))
        key = ChunkKey("0" * 32, b"chunk-0")
        before = {n: c.clone() for n, c in caches.items()}
        pipeline.executor.submit([DeviceMove(Store(1, key, 0, "r", 0), window)])
        assert pipeline.executor.wait_idle(30)
        pipeline.mover.release_pages()
        for cache in caches.values():
            cache.normal_()  # the model writes the pages again
        assert any(not torch.equal(caches[n], before[n]) for n in caches)  # the comparison below can fail
        pipeline.executor.submit([DeviceMove(Load(2, key, 0, "r", 0), window, 0, ordering.CHUNK)])
        assert pipeline.executor.wait_idle(30)
        assert all(c.ok for c in pipeline.executor.poll())
        rows = slice(1, 1 + ordering.CHUNK // ordering.BLOCK)
        assert all(torch.equal(caches[n][rows], before[n][rows]) for n in caches)
    finally:
        pipeline.close()


def test_close_stops_the_lanes_then_the_executor() -> None:
    pipeline, _ = cpu_pipeline(StoreConfig(cpu_bytes=1 << 24, pinned=False, hugepages="off"))
    closed: list[str] = []
    for name, part in (("lanes", pipeline.mover), ("executor", pipeline.executor)):
        close = part.close
        part.close = lambda name=name, close=close: (closed.append(name), close())  # type: ignore[method-assign]
    pipeline.close()
    assert closed == ["lanes", "executor"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("lmcache-npu-", "lmcache-store-r0"))]


def test_a_rank_storing_shares_keys_and_sizes_them_and_makes_the_exchange_after_the_lanes() -> None:
    probe, _ = cpu_pipeline(StoreConfig(cpu_bytes=1 << 24, pinned=False, hugepages="off"))
    layout = probe.mover.layout
    probe.close()
    shares = ShareLayout(layout.plan.object_bytes, 0, 1, 2)  # every plane replicated, this rank's half of them
    lanes_up: list[bool] = []

    def make_exchange() -> ShareExchange:
        lanes_up.append(any(t.name == "lmcache-npu-load-r0" for t in threading.enumerate()))
        return ShareExchange(None)

    pipeline = build_worker_pipeline(layout, StoreConfig(cpu_bytes=1 << 24, pinned=False, hugepages="off"), 0,
                                     lambda: get_backend("torch"), TierCounters(), model_identity=MODEL,
                                     shared=(shares, make_exchange))
    try:
        assert lanes_up == [True]
        assert pipeline.object_bytes == shares.object_bytes < layout.plan.object_bytes
        assert pipeline.layout_fingerprint == shares.fingerprint(layout.plan.fingerprint) != layout.plan.fingerprint
        assert pipeline.namespace == namespace_of(MODEL, pipeline.layout_fingerprint)
        assert isinstance(pipeline.executor.mover, SharedMover) and pipeline.executor.mover.inner is pipeline.mover
    finally:
        pipeline.close()
