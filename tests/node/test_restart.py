"""The service going away never stops an engine: every verb answers as a cache that holds nothing (lookups miss,
stores are not made, a promised load is refused so vLLM recomputes, commands the step handed out but never sent are
refused), nothing raises on the one-way verbs, and the client attaches again at most once per `retry_s`, to a new
epoch whose segments a worker maps afresh."""

from __future__ import annotations

import logging
import time

import pytest

from lmcache_npu.store.commands import Completion, Tier
from lmcache_npu.store.index.contract import DiskState, LookupResult, SlotState
from lmcache_npu.store.metrics import Metric

from .harness import expected_bytes, geometry, keys_of, store_config, wait_for

WORLD = 2


def test_a_closed_service_is_a_cache_that_holds_nothing_and_the_client_never_raises_on_one_way_verbs(start_node):
    node = start_node(store_config(4, WORLD), socket_name="s")
    engine = node.engine("A")
    client = engine.client
    keys = keys_of(0, 2)
    engine.store("w", keys)
    assert client.lookup("q", keys).ready_chunks == 2  # control: the live service finds them
    unanswered = client.prepare_store("x", [(2, keys_of(5, 1)[0])])
    assert len(unanswered) == 1 and client.in_flight == 1
    node.service.close()

    assert client.lookup("q2", keys) == LookupResult(0, 0)
    assert client.epoch is None and client.in_flight == 1  # the dead service's store waits for its ranks' answers
    assert client.take_commands() == [] and client.take_refused() == unanswered  # never sent: refused
    assert client.presence(keys) == [False, False]
    assert client.prepare_store("s", [(0, keys_of(9, 1)[0])]) == []
    with pytest.raises(ValueError, match="went away between the lookup and the load"):
        client.prepare_load("q", [(0, keys[0])])
    client.release("q")
    client.on_completions([Completion(unanswered[0].cmd_id, rank, False, "refused") for rank in range(WORLD)])
    assert client.in_flight == 0  # the refused store settled here: nothing waits for the dead service
    assert client.occupancy() == {Tier.ARENA: (0, 4), Tier.DISK: (0, 0)}
    assert client.location(keys[0]) == (None, SlotState.FREE, DiskState.NONE) and client.chunks() == []
    assert client.counters[Metric.NODE_CACHE_DISCONNECTS] == 1
    assert client.counters[Metric.NODE_CACHE_UNREACHABLE] >= 5
    assert client.counters[Metric.UNEXPECTED_COMPLETIONS] == 0  # the old epoch's store took its answers


def test_a_restarted_service_is_found_again_after_retry_s_as_a_new_epoch_and_workers_map_its_segments(start_node):
    node = start_node(store_config(4, WORLD), socket_name="s")
    quick, patient = node.client("quick", retry_s=0.05), node.client("patient", retry_s=3600.0)
    old_worker = node.worker("quick", 1)
    old_epoch = quick.epoch
    keys = keys_of(0, 1)
    node.service.close()
    assert quick.lookup("q", keys).hit_chunks == 0 and patient.lookup("q", keys).hit_chunks == 0
    successor = start_node(store_config(4, WORLD), socket_name="s")  # the same path, a new service

    wait_for(lambda: quick.lookup("q", keys) is not None and quick.epoch is not None, "the client to reattach")
    assert quick.epoch != old_epoch and quick.counters[Metric.NODE_CACHE_RECONNECTS] == 1
    assert patient.lookup("q", keys) == LookupResult(0, 0)  # its next attempt is an hour away
    assert patient.epoch is None and patient.counters[Metric.NODE_CACHE_RECONNECTS] == 0

    workers = [successor.worker("quick", rank) for rank in range(WORLD)]
    assert {worker.epoch for worker in workers} == {quick.epoch}
    stores = quick.prepare_store("w", [(0, keys[0])])
    assert len(stores) == 1
    for rank, worker in enumerate(workers):
        worker.arena.slot_array(stores[0].slot)[:] = list(expected_bytes(keys[0], WORLD)[rank])
    slot = stores[0].slot
    for rank in range(WORLD):  # the new mapping is the new service's pages
        assert bytes(successor.pool.arenas[rank].slot_array(slot)) == expected_bytes(keys[0], WORLD)[rank]
    assert bytes(old_worker.arena.slot_array(slot)) != expected_bytes(keys[0], WORLD)[1]  # control: the old epoch's
    quick.on_completions([Completion(stores[0].cmd_id, rank, True) for rank in range(WORLD)])
    assert quick.lookup("again", keys).ready_chunks == 1


def test_a_successor_that_refuses_the_engine_leaves_it_serving_misses(start_node, caplog):
    caplog.set_level(logging.DEBUG, logger="lmcache_npu.node.client")
    node = start_node(store_config(4, WORLD), socket_name="s")
    client = node.client("A", retry_s=0.01)
    node.service.close()
    successor = start_node(store_config(4, WORLD, object_bytes=8192), socket_name="s", max_pools=1)
    successor.client("B", geometry(WORLD, object_bytes=8192))  # the successor's one pool is another geometry's
    for _ in range(3):
        time.sleep(0.02)  # past retry_s: each call below tries to attach again, and is refused
        assert client.lookup("q", keys_of(0, 1)) == LookupResult(0, 0)
        assert client.prepare_store("s", [(0, keys_of(1, 1)[0])]) == []
    assert client.epoch is None and client.counters[Metric.NODE_CACHE_RECONNECTS] == 0
    assert len(successor.service.pools) == 1
    assert "refused this engine" in caplog.text and "--max-pools 1" in caplog.text  # it tried, and was told why
