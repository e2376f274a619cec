"""The narrow page fence on the host: the model waits for a queued store only when the step writes a page the store
still reads (the scheduler names it); a step that writes other pages adds no wait, and the store then sees whatever
the step writes to its pages (the negative control). Waits are counted by the mover and exported as stats."""

from __future__ import annotations

import threading
from typing import Optional

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction, TransferStats
from lmcache_npu.ops.transfer_backend import AfterKernel

from . import ordering

CPU = torch.device("cpu")


class Held:
    """A store backend that copies, then waits until the test opens it: the batch stays in flight (its lane is not
    done) for as long as the test wants, decided by the test, not by timing."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.opened = threading.Event()
        self.inside = threading.Event()

    def prepare(self, plan) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        stats = self.inner.transfer(batch, after_kernel)
        self.inside.set()
        assert self.opened.wait(60), "the test never opened the held store"
        return stats


def test_a_fence_naming_the_store_holds_the_next_step_until_the_store_read_its_pages():
    assert ordering.narrow_fence(CPU, names_the_store=True) == ({5.0}, 1)


def test_a_fence_naming_other_stores_adds_no_wait_and_the_store_sees_the_next_steps_bytes():
    assert ordering.narrow_fence(CPU, names_the_store=False) == ({9.0}, 0)


def test_waits_are_counted_and_a_finished_store_is_forgotten():
    s = ordering.Setup(CPU)
    held = Held(s.mover.backends[Direction.STORE])
    s.mover.set_backend(Direction.STORE, held)
    s.fill(5)
    s.run(Direction.STORE)
    store = s.last_cmd_id
    assert held.inside.wait(60)
    # the store is still in flight (held inside its lane): a fence that names another store returns at once
    assert s.mover.release_pages([store + 1]) == 0
    assert s.mover.release_pages([]) == 0
    assert (s.mover.fence_waits, s.mover.fence_skips) == (0, 2)
    held.opened.set()
    assert s.pending.wait(60)
    s.mover.close()  # the lane is done with every batch: nothing is left to wait for
    assert s.mover.release_pages([store]) == 0
    assert s.mover.release_pages(None) == 0
    counts = s.mover.counters.drain()
    assert counts.get("fence_skips") == 2 and "fence_waits" not in counts
    assert s.stored_value() == {5.0}
    s.arena.close()


def test_a_fence_without_names_waits_for_every_store_in_flight():
    s = ordering.Setup(CPU)
    s.mover.set_backend(Direction.STORE, ordering.Delayed(s.mover.backends[Direction.STORE], s.busy))
    s.fill(5)
    s.run(Direction.STORE)
    s.run(Direction.STORE, slot=1)  # queued behind the first, whose gather starts late: both are in flight
    assert s.mover.release_pages() == 2  # None: the scheduler could not place some write
    s.fill(9)
    assert s.pending.wait(60)
    assert s.stored_value(0) == {5.0} and s.stored_value(1) == {5.0}
    assert s.mover.counters.drain().get("fence_waits") == 2
    s.close()


@settings(max_examples=25, deadline=None)
@given(batches=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True), min_size=1, max_size=4),
       named=st.sets(st.integers(1, 40), max_size=8))
def test_the_fence_waits_for_exactly_the_batches_holding_a_named_store(batches, named):
    """Batches whose lane is not done, some holding named stores: the fence waits for those and skips the rest."""
    from lmcache_npu.transfer.mover import _Job

    s = ordering.Setup(CPU)
    s.mover.close()  # no lane: the jobs below are the mover's bookkeeping only
    jobs = []
    for ids in batches:
        moves = [ordering.DeviceMove(ordering.Store(i, ordering.ChunkKey("0" * 32, bytes(8)), 0, "r", 0), s.window)
                 for i in ids]
        job = _Job(Direction.STORE, moves, [], lambda *a: None, None)
        job.kernel_done.set()  # the kernel is done (on the host its event is None); the lane still holds the batch
        jobs.append(job)
    s.mover._reading = list(jobs)
    waits = s.mover.release_pages(named)
    hit = [job for job in jobs if {m.cmd_id for m in job.moves} & named]
    assert waits == len(hit)
    assert s.mover.fence_skips == len(jobs) - len(hit)
    assert s.mover._reading == [job for job in jobs if job not in hit]
    s.arena.close()


def test_the_host_time_benchmark_runs_on_the_host_and_counts_its_waits():
    """The fence_host_time study (the lead runs it on the H100): one command, waits as the fence decides."""
    from lmcache_npu.tools.bench.studies import fence_host_time as bench

    rows = {row["fence"]: row for row in bench.run(CPU, hold_ms=5.0, repeats=2)}
    assert {case: row["waits_per_step"] for case, row in rows.items()} == {"none": 0, "named": 1, "all": 1}
