"""An engine's start never waits on the node cache: with no service, or with its pool still being made, the client
starts at once (no 30 s wait, no refusal), answers every verb as a cache that holds nothing, and attaches in the
background once the service (or the pool) is there. An engine refused for want of a pool (its geometry beyond
--max-pools) serves misses the same way and attaches once a pool is idle."""

from __future__ import annotations

import os

from lmcache_npu.node import client as client_module
from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.store.index.contract import LookupResult
from lmcache_npu.store.metrics import Metric

from .harness import NAMESPACE, WEIGHTS, Engine, SlowPools, geometry, keys_of, store_config, wait_for

OTHER = "1" * 32


def test_an_engine_started_with_no_service_serves_misses_and_attaches_once_it_is_up(node_dir, start_node):
    client = NodeCacheClient(os.path.join(node_dir, "s"), "A", geometry(1), weights=WEIGHTS, connect_timeout_s=2.0, retry_s=0.05)
    keys = keys_of(0, 2)
    assert client.epoch is None
    assert client.lookup("q", keys) == LookupResult(0, 0) and client.prepare_store("s", [(0, keys[0])]) == []
    assert client.counters[Metric.NODE_CACHE_UNREACHABLE] >= 2
    node = start_node(store_config(4, 1), socket_name="s")
    try:
        wait_for(lambda: client.lookup("q", keys) is not None and client.epoch is not None, "the client to attach")
        engine = Engine(client, [node.worker("A", 0, geometry(1))])
        engine.store("w", keys)
        assert client.lookup("again", keys).ready_chunks == 2  # it hits through the node now
    finally:
        client.close()


def test_an_engine_whose_pool_is_being_made_starts_without_it_and_attaches_once_it_is_made(start_node, monkeypatch):
    node = start_node(store_config(4, 1))
    slow = SlowPools(monkeypatch, NAMESPACE)
    try:
        client = NodeCacheClient(node.path, "A", geometry(1), weights=WEIGHTS, connect_timeout_s=0.2, retry_s=0.05)
        assert slow.began.is_set() and client.epoch is None  # its attach waits for the pool in the background
        assert client.lookup("q", keys_of(0, 1)) == LookupResult(0, 0)
    finally:
        slow.release.set()
    try:
        wait_for(lambda: client.lookup("q", keys_of(0, 1)) is not None and client.epoch is not None,
                 "the client to attach once the pool is made")
        assert client.epoch == node.pool.epoch and client.num_slots == 4
    finally:
        client.close()


def test_an_engine_refused_for_want_of_a_pool_serves_misses_and_attaches_once_one_is_idle(start_node, monkeypatch):
    monkeypatch.setattr(client_module, "REFUSED_RETRY_S", 0.05, raising=False)
    node = start_node(store_config(4, 1), max_pools=1)
    old = node.engine("old", geometry(1))
    client = node.client("new", geometry(1, namespace=OTHER), retry_s=0.05)  # starts all the same
    keys = keys_of(0, 1, namespace=OTHER)
    assert client.epoch is None and client.counters[Metric.NODE_CACHE_REFUSED] == 1
    assert client.lookup("q", keys).hit_chunks == 0 and client.prepare_store("s", [(0, keys[0])]) == []
    old.client.close()
    for worker in old.workers:
        worker.close()
    wait_for(lambda: client.lookup("q", keys) is not None and client.epoch is not None, "the refused engine to attach")
    assert len(client.prepare_store("s", [(0, keys[0])])) == 1  # it stores into the node now
