"""The node cache with tensor parallelism: two TP=2 engines, one after the other, on one node-cache service. The
MLA recipe's latent is replicated on both ranks, so with `tp_share` each rank stores half of it: the node keeps one
copy of each chunk for both ranks and both engines, and the second engine loads the first one's chunks (its own
workers map the node's per-rank segments) with the tokens the first one computed."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

from lmcache_npu.store.commands import Tier

from .compare import prompt
from .test_tp_share import MLA_IMPORTS, TP2, _each

PROMPTS = [prompt(300, 900 + i) for i in range(2)]


@pytest.fixture(autouse=True)
def _one_core_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")


@pytest.fixture
def node_cache() -> Any:
    from lmcache_npu.node.service import NodeCacheService, ServiceOptions
    from lmcache_npu.node.capacity import NodeCapacity

    path = os.path.join(tempfile.mkdtemp(prefix="lmc-tp-"), "node.sock")  # a socket path must stay short
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(128 << 20))).start()
    yield service, path
    service.close()


@MLA_IMPORTS
@pytest.mark.one_era(0, 32)  # tests/engines/conftest.py: runs once (MLA needs vLLM >= 0.29 on CPU)
def test_two_tp2_engines_share_one_copy_of_replicated_kv_through_the_node(engines, model_dirs, node_cache) -> None:
    service, path = node_cache
    model = model_dirs("deepseek-mla")
    writer = engines("deepseek-mla", model, extra_config={"node_cache": path, "node_cache_start_wait_ms": 60_000},
                     engine_args=TP2)
    computed = _each(writer, PROMPTS)
    chunk = writer.scheduler_connector.scheduler_half.chunk_tokens
    whole = 299 // chunk * chunk
    writer.close()

    (pool,) = service.pools.values()
    assert pool.geometry.world == 2
    held = pool.index.occupancy()[Tier.ARENA][0]
    assert held == len(PROMPTS) * (whole // chunk)  # one copy per chunk for both ranks

    reader = engines("deepseek-mla", model, extra_config={"node_cache": path, "node_cache_start_wait_ms": 60_000},
                     engine_args=TP2)
    loaded = _each(reader, PROMPTS)
    assert [c.cached_tokens for c in computed] == [0, 0]
    assert [c.cached_tokens for c in loaded] == [whole] * len(PROMPTS)  # the writer's chunks, through the node
    assert [c.token_ids for c in loaded] == [c.token_ids for c in computed]  # MLA: tokens (test_tp_share says why)
    assert pool.index.occupancy()[Tier.ARENA][0] == held  # the reader stored nothing twice
    stats = reader.plugin_stats()
    assert stats.get("lookup_hit_chunks", 0) == len(PROMPTS) * (whole // chunk)
    assert all(not lease.commands for lease in pool.leases.values())
