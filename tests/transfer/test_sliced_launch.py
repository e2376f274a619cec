"""`KVMover.run_sliced` on an asynchronous backend: every slice is marked once launched, before the job's end (the
lane never waits for a slice to land before launching the next), the job is reported once after all of them, and a
kernel that fails after its slice was marked fails the load. The lane prepares each slice plan object once, by
identity held weakly: a new plan is prepared even where it reuses a dead plan's id."""

from __future__ import annotations

import gc
import threading
from typing import Any, Optional

from lmcache_npu.ops import Direction, PendingTransfer, TransferStats, get_backend
from lmcache_npu.ops.plan import TransferPlan
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.transfer import KVMover, StreamKit
from lmcache_npu.transfer.mover import _Lane
from lmcache_npu.transfer.slices import plan_slices

from .test_slices import Case, announced_layers, answers


class _AsyncBackend:
    """A host backend whose launches land at once but finish only when the test lets them: like a device's."""

    def __init__(self, inner: Any, fail_finish: bool = False) -> None:
        self.inner, self.name, self.fail_finish = inner, inner.name, fail_finish
        self.release = threading.Event()
        self.launched = 0
        self.finished = 0
        self.prepared: list[TransferPlan] = []

    def prepare(self, plan: TransferPlan) -> None:
        self.prepared.append(plan)
        self.inner.prepare(plan)

    def transfer(self, batch: Any, after_kernel: Any = None) -> TransferStats:
        return self.inner.transfer(batch, after_kernel)

    def launch(self, batch: Any, after_kernel: Any = None) -> PendingTransfer:
        stats = self.inner.transfer(batch, after_kernel)
        self.launched += 1

        def finish() -> TransferStats:
            assert self.release.wait(60), "the test never released the finish"
            self.finished += 1
            if self.fail_finish:
                raise RuntimeError("kernel moved 0 of 9 work items")
            return stats

        return PendingTransfer(finish, asynchronous=True)


def _mover(case: Case, backend: _AsyncBackend) -> KVMover:
    mover = KVMover(case.layout, lambda: get_backend("host"), StreamKit, 0, 0, TierCounters())
    mover.set_backend(Direction.LOAD, backend)
    return mover


def test_slices_are_marked_before_the_job_ends_and_reported_once_after() -> None:
    case = Case("llama3-8b", "ascend", 2, seed=4)
    slices = plan_slices(case.layout, announced_layers(case.layout), 4)
    backend = _AsyncBackend(get_backend("host"))
    mover = _mover(case, backend)
    report, done, results = answers(case.chunks)
    try:
        progress = mover.run_sliced(case.moves(0), case.objects, report, slices)
        assert progress.wait_for_slice(len(slices) - 1, timeout=60), "the last slice was never marked"
        assert progress.finished and backend.launched == sum(1 for s in slices.slices if s.planes)
        assert backend.finished == 0 and not results, "the job ended before its slices were finished"
        backend.release.set()
        assert done.wait(60) and all(r.ok for r in results) and len(results) == case.chunks
        assert backend.finished == backend.launched
    finally:
        backend.release.set()
        mover.close()


def test_a_kernel_failing_after_its_slice_was_marked_fails_the_load() -> None:
    case = Case("llama3-8b", "ascend", 1, seed=5)
    slices = plan_slices(case.layout, announced_layers(case.layout), 3)
    backend = _AsyncBackend(get_backend("host"), fail_finish=True)
    backend.release.set()
    mover = _mover(case, backend)
    report, done, results = answers(case.chunks)
    try:
        progress = mover.run_sliced(case.moves(0), case.objects, report, slices)
        assert done.wait(60)
        assert not results[0].ok and "kernel moved" in results[0].reason
        assert "kernel moved" in progress.failure and not progress.wait_for_slice(0, timeout=0)
        assert backend.finished == backend.launched  # nothing launched is left unfinished
    finally:
        mover.close()


def test_the_lane_prepares_each_plan_object_once_and_a_new_one_even_with_a_dead_ones_id() -> None:
    case = Case("llama3-8b", "ascend", 1, seed=6)
    backend = _AsyncBackend(get_backend("host"))
    lane = _Lane("test", backend, StreamKit())  # type: ignore[arg-type]
    plan = case.layout.plan.plane_subset([0])
    KVMover._prepare(lane, plan)
    KVMover._prepare(lane, plan)
    assert backend.prepared == [plan]
    dead_id = id(plan)
    backend.prepared.clear()
    del plan
    gc.collect()
    reused: Optional[TransferPlan] = None
    keep = []
    for _ in range(200):  # CPython hands a freed object's memory to the next one of its size: find one reusing it
        fresh = case.layout.plan.plane_subset([0])
        if id(fresh) == dead_id:
            reused = fresh
            break
        keep.append(fresh)
    candidate = reused if reused is not None else case.layout.plan.plane_subset([0])
    KVMover._prepare(lane, candidate)
    assert backend.prepared == [candidate], "a new plan object was not prepared (its id was a dead plan's)"
