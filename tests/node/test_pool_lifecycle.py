"""Pools come and go without holding engines up: a pool being made (minutes on a large node) fails neither its first
engine, which waits `ATTACH_TIMEOUT_S` for it, nor an engine of another pool, which never waits behind it (the
review's R3, timeouts scaled down); one creation per geometry; a pool made while the service closes is closed. A pool
no engine holds is given back after `pool_idle_s`, and gives its place at once to a new geometry beyond --max-pools
(R9: a model roll-out)."""

from __future__ import annotations

import threading
import time

import pytest

from lmcache_npu.node import client as client_module
from lmcache_npu.node.client import NodeCacheUnavailable, connect
from lmcache_npu.node.messages import Attach

from .harness import NAMESPACE, WAIT_S, WEIGHTS, SlowPools, geometry, store_config, wait_for, wait_released

OTHER = "1" * 32


def attach_in_thread(path: str, attach: Attach, results: list) -> threading.Thread:
    def run() -> None:
        try:
            results.append(connect(path, attach, 5.0))
        except Exception as exc:  # the test looks at what it got
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_slow_pool_creation_fails_neither_its_first_engine_nor_an_engine_of_an_existing_pool(start_node,
                                                                                              monkeypatch):
    monkeypatch.setattr(client_module, "CALL_TIMEOUT_S", 0.5)  # R3's scale: a verb must answer within 0.5 s
    node = start_node(store_config(4, 1, pools=2), max_pools=2)
    node.client("A", geometry(1))  # the pool of A's geometry exists
    slow = SlowPools(monkeypatch, OTHER)
    firsts: list = []
    threads = [attach_in_thread(node.path, Attach(f"B{i}", geometry(1, namespace=OTHER), weights=WEIGHTS), firsts) for i in range(2)]
    try:
        assert slow.began.wait(WAIT_S)
        began = time.monotonic()
        sock, attached, _ = connect(node.path, Attach("A2", geometry(1), weights=WEIGHTS), 5.0)  # no wait behind B's creation
        assert not slow.release.is_set() and attached.epoch == node.service.pools[geometry(1)].epoch
        sock.close()
        time.sleep(max(0.0, began + 1.2 - time.monotonic()))  # B's pool takes more than twice CALL_TIMEOUT_S
    finally:
        slow.release.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(firsts) == 2 and all(isinstance(result, tuple) for result in firsts), firsts
    assert {result[1].epoch for result in firsts} == {node.service.pools[geometry(1, namespace=OTHER)].epoch}
    assert slow.made[OTHER] == 1  # one creation for the geometry, both of its first engines waited for it
    for result in firsts:
        result[0].close()


def test_a_pool_made_while_the_service_closes_is_closed_and_its_engine_refused(start_node, monkeypatch):
    node = start_node(store_config(4, 1))
    slow = SlowPools(monkeypatch, NAMESPACE)
    results: list = []
    thread = attach_in_thread(node.path, Attach("A", geometry(1), weights=WEIGHTS), results)
    try:
        assert slow.began.wait(WAIT_S)
        node.service.close()
    finally:
        slow.release.set()
    thread.join(WAIT_S)
    assert len(results) == 1 and isinstance(results[0], NodeCacheUnavailable)
    wait_for(lambda: slow.pools, "the pool's making to end")
    (pool,) = slow.pools
    wait_for(lambda: pool._closed.is_set(), "the pool made during close to be closed")
    assert not node.service.pools


def test_an_idle_pool_gives_its_place_to_a_new_geometry_beyond_max_pools(start_node):
    node = start_node(store_config(4, 1), max_pools=1)
    old = node.engine("old", geometry(1))
    new = geometry(1, namespace=OTHER)
    with pytest.raises(NodeCacheUnavailable, match=r"--max-pools 1"):  # control: the old model's engine holds it
        connect(node.path, Attach("new", new, weights=WEIGHTS), 1.0)
    old.client.close()
    for worker in old.workers:
        worker.close()
    assert wait_released(node.service, "old") == []
    sock, attached, _ = connect(node.path, Attach("new", new, weights=WEIGHTS), 1.0)  # R9: the old model's lease is gone
    assert set(node.service.pools) == {new} and attached.epoch == node.service.pools[new].epoch
    assert node.service.pools_reclaimed == 1
    sock.close()


def test_a_pool_no_engine_holds_is_given_back_after_pool_idle_s(start_node):
    node = start_node(store_config(4, 1), pool_idle_s=0.2, metrics_port=0)
    engine = node.engine("A", geometry(1))
    first_epoch = engine.client.epoch
    time.sleep(0.6)
    assert len(node.service.pools) == 1  # control: a pool an engine holds is never given back
    engine.client.close()
    for worker in engine.workers:
        worker.close()
    wait_for(lambda: not node.service.pools, "the idle pool to be given back")
    assert node.service.pools_reclaimed == 1
    assert 'lmcache_npu:node_pools_reclaimed_total{engine="node"} 1' in node.service.metrics_text()
    again = node.client("B", geometry(1))  # the geometry comes back: a new pool, a new epoch
    assert again.epoch is not None and again.epoch != first_epoch
