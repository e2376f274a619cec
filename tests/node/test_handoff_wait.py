"""A lookup that names a writer (a P/D hand-off's prefill engine: its engine name and its lease's public id) sees that
engine's stores in flight as pending hits, and once they committed loads their bytes; only the writer's live lease
counts: a wrong lease id, none, another engine's, or the same name's next lease leaves them misses, as for any
engine (test_uncommitted.py). Controls: the bytes comparison sees a flipped byte; a malformed writer is refused by
name and answered as a miss."""

from __future__ import annotations

import pytest

from lmcache_npu.node.messages import lease_id
from lmcache_npu.node.verbs import _writer
from lmcache_npu.store.metrics import Metric

from .harness import answer, expected_bytes, half_written, sync, wait_for

WORLD = 2


def test_the_named_writers_stores_in_flight_are_pending_hits_then_load_its_bytes(start_node) -> None:
    node, a, b, keys, stores = half_written(start_node, WORLD)
    writer = a.client.handoff_writer()
    assert writer == ("A", lease_id(a.client.lease)) and b.client.handoff_writer() != writer
    found = b.client.lookup_awaiting("d-1", keys, writer)
    assert (found.hit_chunks, found.ready_chunks) == (3, 1) and found.pending
    answer(a.client, stores[1:], [1])  # the last rank commits
    sync(a.client)
    ready = b.client.lookup_awaiting("d-1", keys, writer)
    assert (ready.hit_chunks, ready.ready_chunks) == (3, 3)
    loads = b.client.prepare_load("d-1", list(enumerate(keys)))
    b.client.take_commands()
    seen = b.read(loads)
    assert seen == {key: expected_bytes(key, WORLD) for key in keys}
    # control of the comparison: one flipped byte in A's mapping of a slot is seen
    a.workers[0].arena.slot_array(loads[2].slot)[7] ^= 0xFF
    again = b.client.lookup("d-2", keys)
    assert again.ready_chunks == 3
    flipped = b.read(b.client.prepare_load("d-2", list(enumerate(keys))))
    b.client.take_commands()
    assert flipped != {key: expected_bytes(key, WORLD) for key in keys}
    node.pool.index.check_invariants()


@pytest.mark.parametrize("who", ["wrong lease id", "another engine's lease", "no writer"])
def test_negative_control_without_the_writers_live_lease_its_stores_in_flight_are_misses(start_node, who) -> None:
    node, a, b, keys, _ = half_written(start_node, WORLD)
    writer = {"wrong lease id": ("A", "0" * 32), "another engine's lease": ("A", lease_id(b.client.lease)),
              "no writer": None}[who]
    found = b.client.lookup("d-1", keys) if writer is None else b.client.lookup_awaiting("d-1", keys, writer)
    assert (found.hit_chunks, found.ready_chunks) == (1, 1)  # chunk 0 only: A's stores in flight stay hidden
    b.client.release("d-1")
    sync(b.client)
    assert node.pool.index.counters.snapshot().get(Metric.UNCOMMITTED_MISSES) == 1


def test_the_same_engine_names_next_lease_is_another_writer(start_node) -> None:
    node, a, b, keys, _ = half_written(start_node, WORLD)
    old = a.client.handoff_writer()
    a.client.close()
    for worker in a.workers:
        worker.close()
    wait_for(lambda: "A" not in node.pool.leases, "engine A's lease to end")
    again = node.engine("A")
    stores = again.client.prepare_store("a-2", list(enumerate(keys))[1:])
    again.client.take_commands()
    assert len(stores) == 2 and again.client.handoff_writer() != old
    found = b.client.lookup_awaiting("d-1", keys, old)
    assert (found.hit_chunks, found.ready_chunks) == (1, 1)  # the old lease names no live writer


def test_a_malformed_writer_is_refused_by_name_and_answered_as_a_miss(start_node) -> None:
    node, a, b, keys, _ = half_written(start_node, WORLD)
    with pytest.raises(ValueError, match="an awaited writer must be"):
        _writer(["A"])
    with pytest.raises(ValueError, match="lease id"):
        _writer(["A", "short"])
    found = b.client.lookup_awaiting("d-1", keys, ("A", "short"))
    assert (found.hit_chunks, found.ready_chunks) == (0, 0)
    assert b.client.counters.snapshot().get(Metric.NODE_CACHE_ERROR_REPLIES) == 1
