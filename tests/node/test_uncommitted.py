"""A chunk another engine is still storing is a miss for this engine, never a pending hit: the issue's rule that a
store is invisible until every rank of the writing engine committed it. Waiting on it would make this engine's
scheduler ask the node again every step for a forward pass of the other engine (~600 round trips in one smoke
run). The writing engine's own second request still sees its store in flight as pending, as the in-process index
does, and once the store committed every engine hits it."""

from __future__ import annotations

from lmcache_npu.node.pool import NodePool
from lmcache_npu.store.metrics import Metric

from .harness import answer, half_written, sync

WORLD = 2


def test_another_engines_store_in_flight_is_a_miss_and_its_own_a_pending_hit(start_node) -> None:
    node, a, b, keys, stores = half_written(start_node, WORLD)
    found = b.client.lookup("b-1", keys)
    assert (found.hit_chunks, found.ready_chunks) == (1, 1)  # chunk 0 only: not pending on A's stores
    assert b.client.presence(keys) == [True, False, False]
    b.client.release("b-1")
    own = a.client.lookup("a-2", keys)
    assert (own.hit_chunks, own.ready_chunks) == (3, 1) and own.pending  # A waits for its own stores
    a.client.release("a-2")
    sync(a.client)
    assert node.pool.index.counters.snapshot().get(Metric.UNCOMMITTED_MISSES) == 1
    answer(a.client, stores[1:], [1])  # the last rank commits: every engine hits now
    sync(a.client)
    again = b.client.lookup("b-2", keys)
    assert (again.hit_chunks, again.ready_chunks) == (3, 3)
    b.client.release("b-2")
    assert not node.pool.writing


def test_a_dead_writers_half_written_chunks_stop_hiding_once_its_lease_ends(start_node) -> None:
    node, a, b, keys, _ = half_written(start_node, WORLD)
    a.client.close()
    for worker in a.workers:
        worker.close()
    from .harness import wait_for

    wait_for(lambda: "A" not in node.pool.leases, "engine A's lease to end")
    assert not node.pool.writing  # its stores failed: nothing is in flight, nothing is hidden
    found = b.client.lookup("b-1", keys)
    assert (found.hit_chunks, found.ready_chunks) == (1, 1)  # only the committed chunk exists
    b.client.release("b-1")


def test_negative_control_a_node_that_shows_uncommitted_stores_makes_the_other_engine_wait(start_node,
                                                                                              monkeypatch) -> None:
    monkeypatch.setattr(NodePool, "visible", lambda self, lease, keys, count=True, awaited=None: keys)
    _, _, b, keys, _ = half_written(start_node, WORLD)
    found = b.client.lookup("b-1", keys)
    assert found.pending and (found.hit_chunks, found.ready_chunks) == (3, 1)  # what the rule prevents
    b.client.release("b-1")
