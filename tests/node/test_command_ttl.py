"""The service's command TTL and its bookkeeping of handed-out commands: a command no answer settles (a reply the
engine never read, an engine that misbehaves) fails after the TTL, its slot freed or its pin dropped, so nothing
stays pending or hidden forever; answered commands never expire; and an answer settles only its own command, never
costing a scan of every store in flight on the node.
"""

from __future__ import annotations

import time

from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.index.contract import SlotState
from lmcache_npu.store.metrics import Metric

from .harness import answer, keys_of, slow_next_call, store_config, sync, wait_for

WORLD = 2
QUICK = 0.02  # retry_s of the clients that must attach again within the test


def test_a_command_no_one_answers_fails_after_the_ttl_and_frees_its_slot(start_node, monkeypatch) -> None:
    node = start_node(store_config(6, WORLD), command_ttl_s=5.0)
    a, b = node.engine("A"), node.engine("B")
    a.client.retry_s = QUICK
    key = keys_of(0, 1)[0]
    # a store whose reply A never read: the index hands it out after A's call timed out
    slowed = slow_next_call(monkeypatch, node, a.client, "prepare_store")
    assert a.client.prepare_store("w", [(0, key)]) == [] and slowed
    wait_for(lambda: a.client.presence([]) is not None and a.client.epoch is not None, "A to attach again")
    (cmd_id,) = node.pool.handed
    assert a.client.lookup("own", [key]).pending  # its own store in flight: pending, until the TTL
    a.client.release("own")
    assert b.client.lookup("other", [key]).hit_chunks == 0  # hidden from the other engine meanwhile
    b.client.release("other")

    wait_for(lambda: not node.pool.index.is_pending(cmd_id), "the TTL to fail the unanswered store")
    assert not node.pool.writing and not node.pool.handed and cmd_id not in node.pool.leases["A"].commands
    assert node.pool.index.location(key)[1] is SlotState.FREE
    # its slot rests in quarantine first (the expired writer's late DMA may still land), then is free again
    wait_for(lambda: node.pool.index.free_slots == 6, "the expired store's slot to leave quarantine")
    own = a.client.lookup("own-2", [key])
    assert own.hit_chunks == 0 and not own.pending  # a miss now: the engine stores it again
    a.client.release("own-2")
    sync(a.client)
    assert node.pool.index.counters[Metric.EXPIRED_COMMANDS] == 1


def test_only_unanswered_commands_expire_and_only_after_the_ttl(start_node) -> None:
    node = start_node(store_config(6, WORLD))  # the default TTL: the pump's sweeps expire nothing during the test
    engine = node.engine("A")
    answered = engine.store("w", keys_of(0, 1))
    assert engine.client.lookup("r", keys_of(0, 1)).ready_chunks == 1
    unanswered: list[Load | Store] = [*engine.client.prepare_load("r", [(0, keys_of(0, 1)[0])]),
                                      *engine.client.prepare_store("s", [(1, keys_of(1, 1)[0])])]
    engine.client.take_commands()
    sync(engine.client)
    pool = node.pool
    with node.service.lock:
        now = time.monotonic()
        assert list(pool.handed) == [c.cmd_id for c in unanswered]  # the answered store is forgotten
        assert pool.expire(now + pool.command_ttl_s - 1) == 0  # not yet
        assert pool.expire(now + pool.command_ttl_s + 1) == 2  # past the TTL: the load's pin, the store's slot
        assert not pool.handed and not pool.writing and not pool.leases["A"].commands
        views = {view.key: view for view in pool.index.chunks()}
        assert views[answered[0].key].readers == 0 and views[answered[0].key].slot_state is SlotState.READY
        assert keys_of(1, 1)[0] not in views  # the unanswered store's slot was freed
    answer(engine.client, unanswered, range(WORLD))  # late answers: of commands no longer the engine's
    sync(engine.client)
    pool.index.check_invariants()


def test_an_answer_settles_only_its_own_command_not_every_store_in_flight(start_node, monkeypatch) -> None:
    """`on_completions` looks at the answered commands only: the work of one answer does not grow with the other
    engines' stores in flight (their chunks stay hidden: the negative control that they were left alone)."""
    node = start_node(store_config(64, WORLD))
    a, b = node.engine("A"), node.engine("B")
    pool = node.pool
    asked: list[int] = []
    real = pool.index.is_pending
    monkeypatch.setattr(pool.index, "is_pending", lambda cmd_id: (asked.append(cmd_id), real(cmd_id))[1])
    work = []
    for first, others in ((0, 0), (10, 40)):
        if others:
            b.client.prepare_store("b", list(enumerate(keys_of(100, others))))
            b.client.take_commands()
        (store,) = a.client.prepare_store(f"a{first}", [(0, keys_of(first, 1)[0])])
        a.client.take_commands()
        sync(a.client)
        asked.clear()
        answer(a.client, [store], range(WORLD))
        sync(a.client)
        work.append(len(asked))
        assert set(asked) == {store.cmd_id}  # no other command was looked at
    assert work[0] == work[1] > 0
    assert len(pool.writing) == 40 and all(writer == "B" for writer, _ in pool.writing.values())
    assert a.client.lookup("x", keys_of(100, 1)).hit_chunks == 0  # still hidden from the other engine
    a.client.release("x")
