"""Engines sharing a node cache cannot take it from each other. While another engine holds a lease, an engine's
requests reserve and load at most `lease_slot_share` of the pool (the review's R8: one engine's reservations left
no slot for another's stores); alone it may use all of it. A request's reservations that no lookup renewed for
`reservation_ttl_s` are released (a hung engine pins nothing for ever). Leases are the service's, not the engines'
names: a scheduler is issued a token its workers present, and a second live scheduler under the same name is
refused instead of merging into the first's lease (the review's R4: a dead engine's store stayed pending while the
other lived). Names and request ids holding the scope separator are refused (L8)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from lmcache_npu.node import wire
from lmcache_npu.node.client import NodeCacheUnavailable, connect
from lmcache_npu.node.messages import Attach, Attached, Refused
from lmcache_npu.node.pool import NodePool
from lmcache_npu.store.index.contract import SlotState
from lmcache_npu.store.metrics import Metric

from .harness import WAIT_S, WEIGHTS, answer, engine_holdings, geometry, keys_of, store_config, sync, wait_for

ONE_RANK = geometry(world=1)


# ---- per-lease caps (M2) ---------------------------------------------------------------------------------------------

def test_one_engines_reservations_leave_slots_for_another(start_node):
    node = start_node(store_config(8, 1), lease_slot_share=0.25)
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 8))  # the pool is full of ready chunks
    greedy, other = node.engine("greedy", ONE_RANK), node.engine("other", ONE_RANK)
    found = greedy.client.lookup("all", keys_of(0, 8))  # reserves what it may until its load
    assert (found.hit_chunks, found.ready_chunks) == (2, 2)  # a quarter of 8 slots: the hit ends at the cap
    assert greedy.client.counters[Metric.LEASE_CAP_MISSES] == 1 and node.pool.index.holders.held_by("greedy") == 2
    stores = other.store("mine", keys_of(100, 6))
    assert len(stores) == 6  # every slot greedy does not hold is still the pool's to give
    assert greedy.client.lookup("all", keys_of(0, 2)).ready_chunks == 2  # what it reserved is still its own
    node.pool.index.check_invariants()


def test_negative_control_without_the_cap_one_engine_takes_every_slot(start_node):
    node = start_node(store_config(8, 1), lease_slot_share=1.0)
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 8))
    greedy, other = node.engine("greedy", ONE_RANK), node.engine("other", ONE_RANK)
    assert greedy.client.lookup("all", keys_of(0, 8)).ready_chunks == 8
    assert other.client.prepare_store("mine", list(enumerate(keys_of(100, 6)))) == []  # the review's R8


def test_an_engine_alone_may_hold_the_whole_pool_and_is_capped_once_another_attaches(start_node):
    node = start_node(store_config(8, 1), lease_slot_share=0.25)
    alone = node.engine("alone", ONE_RANK)
    alone.store("warm", keys_of(0, 8))
    assert alone.client.lookup("all", keys_of(0, 8)).ready_chunks == 8
    alone.client.release("all")
    node.engine("second", ONE_RANK)
    assert alone.client.lookup("again", keys_of(0, 8)).ready_chunks == 2


def test_loads_count_against_the_cap_until_every_rank_answered(start_node):
    node = start_node(store_config(8, 1), lease_slot_share=0.25)
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 8))
    engine = node.engine("E", ONE_RANK)
    assert engine.client.lookup("a", keys_of(0, 2)).ready_chunks == 2
    loads = engine.client.prepare_load("a", list(enumerate(keys_of(0, 2))))
    engine.client.release("a")
    engine.client.take_commands()
    sync(engine.client)
    assert node.pool.index.holders.held_by("E") == 2  # pinned by its loads now
    assert engine.client.lookup("b", keys_of(2, 2)).hit_chunks == 0  # the cap is spent on the loads
    engine.client.release("b")
    answer(engine.client, loads, [0])
    sync(engine.client)
    assert node.pool.index.holders.held_by("E") == 0
    assert engine.client.lookup("b", keys_of(2, 2)).ready_chunks == 2


def test_reservations_no_lookup_renews_are_released_after_their_ttl(start_node, caplog):
    node = start_node(store_config(8, 1), reservation_ttl_s=0.3)
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 4))
    hung = node.engine("hung", ONE_RANK)
    assert hung.client.lookup("stuck", keys_of(0, 4)).ready_chunks == 4
    assert hung.client.lookup("fresh", keys_of(0, 1)).ready_chunks == 1
    deadline = time.monotonic() + WAIT_S
    with caplog.at_level(logging.WARNING, logger="lmcache_npu.node.pool"):
        while [line for line in engine_holdings(node.service, "hung") if "stuck" in line]:
            assert time.monotonic() < deadline, "the unrenewed reservations were never released"
            hung.client.lookup("fresh", keys_of(0, 1))  # "fresh" is looked up again and again; "stuck" never is
            time.sleep(0.05)
    held = engine_holdings(node.service, "hung")
    assert not [line for line in held if "stuck" in line] and [line for line in held if "fresh" in line]
    assert node.pool.index.counters.snapshot()[Metric.RESERVATIONS_EXPIRED] == 1
    assert "engine hung: 1 request(s) held reservations for more than 0 s without a lookup" in caplog.text
    loads = hung.client.prepare_load("stuck", list(enumerate(keys_of(0, 4))))  # still ready: still loadable
    assert len(loads) == 4


# ---- service-issued lease tokens (M10) -------------------------------------------------------------------------------

def test_a_second_live_scheduler_under_one_name_is_refused_and_a_dead_engines_store_settles(start_node):
    node = start_node(store_config(8, 1))
    first = node.engine("dup", ONE_RANK)
    assert first.client.lease and first.workers[0].lease == first.client.lease
    stores = first.client.prepare_store("w", list(enumerate(keys_of(0, 2))))
    first.client.take_commands()
    impostor_worker = node.worker("dup", 0, ONE_RANK)  # the other engine's workers attach first, with no token
    assert impostor_worker.lease == ""
    impostor = node.client("dup", ONE_RANK)  # refused: it starts unattached, the reason said (and asked again later)
    assert impostor.epoch is None and "engine name 'dup' is held by a live engine" in impostor._refusal
    impostor.close()
    first.client.close()
    first.workers[0].close()  # the first engine is gone; the impostor's unbound worker does not keep its lease
    wait_for(lambda: not any(node.pool.index.is_pending(c.cmd_id) for c in stores), "the dead engine's stores")
    assert not [v for v in node.pool.index.chunks() if v.slot_state is SlotState.WRITING]
    assert node.pool.leases["dup"].token == "" and node.pool.leases["dup"].connections  # the worker waits
    second = node.client("dup", ONE_RANK)  # now its scheduler may claim the name, and its worker join
    assert second.lease and second.lease != first.client.lease
    assert not impostor_worker.join("forged") and not node.pool.leases["dup"].bound  # a token is not a name
    assert impostor_worker.join(second.lease) and node.pool.leases["dup"].bound
    assert len(node.engine("reader", ONE_RANK).store("r", keys_of(0, 2))) == 2  # no slot is stuck WRITING


def test_negative_control_without_tokens_the_names_merge_and_the_store_stays_pending(start_node, monkeypatch):
    original = NodePool.lease

    def merging(self, engine, connection, events=False, limits=None, *, rank=None, token=""):
        return original(self, engine, connection, events, limits, rank=0 if rank is None else rank, token="")

    monkeypatch.setattr(NodePool, "lease", merging)  # every scheduler is let in under any name: the old service
    node = start_node(store_config(8, 1))
    first = node.engine("dup", ONE_RANK)
    stores = first.client.prepare_store("w", list(enumerate(keys_of(0, 2))))
    first.client.take_commands()
    survivor = node.engine("dup", ONE_RANK)
    first.client.close()
    first.workers[0].close()
    sync(survivor.client)
    assert all(node.pool.index.is_pending(c.cmd_id) for c in stores)  # the review's R4: never abandoned
    assert survivor.client.lookup("q", keys_of(0, 2)).pending  # and the survivor waits on it


def test_a_scheduler_attaching_again_with_its_token_keeps_its_lease(start_node):
    node = start_node(store_config(8, 1))
    engine = node.engine("E", ONE_RANK)
    token = engine.client.lease
    sock, attached, _ = connect(node.path, Attach("E", ONE_RANK, lease=token, weights=WEIGHTS), 5.0)  # a reconnect
    try:
        assert isinstance(attached, Attached) and attached.lease == token
        assert node.pool.leases["E"].scheduler is not None and node.pool.leases["E"].token == token
    finally:
        sock.close()
    with pytest.raises(NodeCacheUnavailable, match="held by a live engine"):  # control: a wrong token is refused
        connect(node.path, Attach("E", ONE_RANK, lease="0" * 32, weights=WEIGHTS), 5.0)


def test_a_lease_ends_when_its_scheduler_and_bound_workers_are_gone_not_before(start_node):
    node = start_node(store_config(8, 1))
    client = node.client("E", ONE_RANK)
    bound = node.worker("E", 0, ONE_RANK, lease=client.lease)
    unbound = node.worker("E", 0, ONE_RANK)
    assert bound.lease == client.lease and unbound.lease == ""
    client.close()
    wait_for(lambda: node.pool.leases["E"].scheduler is None, "the scheduler to leave")
    assert node.pool.leases["E"].token == client.lease  # the bound worker holds it
    bound.close()
    wait_for(lambda: node.pool.leases["E"].token == "", "the lease to end")
    assert node.pool.leases["E"].connections  # the unbound worker stays, in a lease of its own
    assert node.pool.index.counters.snapshot()[Metric.LEASES_ENDED] == 1


# ---- names (L8) ------------------------------------------------------------------------------------------------------

def test_names_and_request_ids_holding_the_scope_separator_are_refused(start_node):
    node = start_node(store_config(8, 1))
    refused = node.client("A\x1fB", ONE_RANK)
    assert refused.epoch is None and "an engine name must be 1-256 characters without" in refused._refusal
    refused.close()
    engine = node.engine("A", ONE_RANK)
    strict = node.client("A-strict", ONE_RANK, strict=True)  # the service's refusal raised, as tests want it
    with pytest.raises(ValueError, match="a request id may not hold"):
        strict.lookup("x\x1fy", keys_of(0, 1))
    assert engine.client.lookup("x\x1fy", keys_of(0, 1)).hit_chunks == 0  # an engine's is a counted miss
    assert engine.client.counters[Metric.NODE_CACHE_ERROR_REPLIES] == 1
    assert engine.client.lookup("xy", keys_of(0, 1)).hit_chunks == 0  # control


def test_a_refused_scheduler_is_told_what_to_change(start_node):
    node = start_node(store_config(8, 1))
    node.client("E", ONE_RANK)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(node.path)
        wire.send(sock, Attach("E", ONE_RANK, weights=WEIGHTS))
        reply, fds = wire.receive_with_fds(sock)
    assert isinstance(reply, Refused) and "kv_transfer_config.engine_id" in reply.reason and not fds
