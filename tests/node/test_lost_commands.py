"""No command an engine was handed is lost.

- The service dies between a verb's answer and the step's `take_commands`: commands still queued are handed out as
  refused (the workers answer them as failed), commands the workers already run take their answers; neither is
  forgotten, and a new epoch is never told about them.
- A slow (not dead) service: a call times out, the client attaches again to the same epoch, keeps its commands and
  sends the answers the service has not had, so the store commits, the other engine sees it and the engine's own
  lookups are no longer pending; the releases it could not send free what the late answer to a lookup reserved.
"""

from __future__ import annotations

from lmcache_npu.node.pool import NodePool
from lmcache_npu.store.metrics import Metric

from .harness import answer, engine_holdings, keys_of, slow_next_call, store_config, sync, wait_for

WORLD = 2
QUICK = 0.02  # retry_s of the clients that must attach again within the test


def test_commands_handed_out_before_the_service_died_are_refused_or_answered_never_forgotten(start_node) -> None:
    node = start_node(store_config(6, WORLD))
    engine = node.engine("A")
    client = engine.client
    keys = keys_of(0, 3)
    engine.store("warm", keys[:2])
    (store,) = client.prepare_store("s", [(2, keys[2])])
    assert client.take_commands() == [store]  # in the workers' hands: they run it and answer
    assert client.lookup("r", keys[:2]).ready_chunks == 2
    loads = client.prepare_load("r", [(0, keys[0]), (1, keys[1])])
    assert len(loads) == 2 and client.queued_commands() == tuple(loads)  # the step's LoadPlan names them now
    node.service.close()
    assert client.lookup("q", keys).hit_chunks == 0  # the service is found gone here

    assert client.take_commands() == [] and client.take_refused() == loads  # never sent: refused, not forgotten
    assert client.in_flight == 3 and all(client.is_pending(c.cmd_id) for c in [store, *loads])
    answer(client, [store], range(WORLD))  # the old mapping's pages took the store
    answer(client, loads, range(WORLD), ok=False)  # each rank refuses the loads: vLLM recomputes them
    assert client.in_flight == 0 and client.queued_commands() == ()
    assert client.counters[Metric.UNEXPECTED_COMPLETIONS] == 0
    assert client.counters[Metric.NODE_CACHE_REFUSED_COMMANDS] == 2


def test_a_new_epoch_is_never_told_of_the_dead_ones_commands(start_node, monkeypatch) -> None:
    node = start_node(store_config(6, WORLD), socket_name="s")
    client = node.client("A", retry_s=QUICK)
    (old,) = client.prepare_store("s", [(0, keys_of(0, 1)[0])])
    client.take_commands()
    node.service.close()
    successor = start_node(store_config(6, WORLD), socket_name="s")
    told: list[int] = []
    real = NodePool.on_completions
    monkeypatch.setattr(NodePool, "on_completions",
                        lambda pool, lease, done: (told.extend(d.cmd_id for d in done), real(pool, lease, done))[1])
    wait_for(lambda: client.presence([]) is not None and client.epoch is not None, "the client to attach again")
    assert client.epoch == successor.pool.epoch and client.is_pending(old.cmd_id)
    (new,) = client.prepare_store("t", [(1, keys_of(1, 1)[0])])
    client.take_commands()
    answer(client, [old, new], range(WORLD))
    sync(client)
    assert client.in_flight == 0 and client.counters[Metric.UNEXPECTED_COMPLETIONS] == 0
    assert told == [new.cmd_id] * WORLD  # control: the new epoch's answers reach it, the dead one's never do


def test_after_a_timeout_on_a_live_service_the_store_commits_and_nothing_stays_pending(start_node,
                                                                                      monkeypatch) -> None:
    node = start_node(store_config(6, WORLD))
    a, b = node.engine("A"), node.engine("B")
    a.client.retry_s = QUICK
    epoch = a.client.epoch
    keys = keys_of(0, 2)
    stores = a.client.prepare_store("w", list(enumerate(keys)))
    a.client.take_commands()
    slowed = slow_next_call(monkeypatch, node, a.client, "presence")
    assert a.client.presence(keys_of(5, 1)) == [False]  # timed out: answered as a miss, the service counts as lost
    assert slowed and a.client.epoch is None
    answer(a.client, stores, range(WORLD))  # the workers answer while the client is away: kept for the service
    assert a.client.in_flight == 0

    wait_for(lambda: a.client.presence([]) is not None and a.client.epoch is not None, "A to attach again")
    assert a.client.epoch == epoch and a.client.counters[Metric.NODE_CACHE_RECONNECTS] == 1  # the same service
    sync(a.client)
    found = b.client.lookup("b", keys)
    assert (found.hit_chunks, found.ready_chunks) == (2, 2)  # committed: the other engine sees it
    b.client.release("b")
    own = a.client.lookup("again", keys)
    assert (own.ready_chunks, own.pending) == (2, False)  # the engine's own lookups are not pending
    a.client.release("again")
    sync(a.client)
    assert a.client.counters[Metric.NODE_CACHE_REPLAYED_COMPLETIONS] == len(stores) * WORLD
    assert not node.pool.writing and not node.pool.handed


def test_after_a_timeout_on_a_live_service_what_a_late_lookup_reserved_is_released(start_node, monkeypatch) -> None:
    node = start_node(store_config(6, WORLD))
    a = node.engine("A")
    a.client.retry_s = QUICK
    keys = keys_of(0, 2)
    a.store("w", keys)
    slowed = slow_next_call(monkeypatch, node, a.client, "lookup")
    assert a.client.lookup("r", keys).hit_chunks == 0 and slowed  # timed out: a miss, so the scheduler releases
    a.client.release("r")  # while the client is away

    def reserved() -> list[str]:
        return [held for held in engine_holdings(node.service, "A") if held.startswith("reservations")]

    wait_for(lambda: len(reserved()) == 2, "the late lookup's reservations")  # control: the service reserved both
    wait_for(lambda: a.client.presence([]) is not None and a.client.epoch is not None, "A to attach again")
    sync(a.client)
    assert reserved() == []  # the release sent on attaching again to the same epoch
