"""`KVMover.run_sliced` with a backend that copies slice 0 ahead (CUDA's `copy_ahead`): the copies are asked for on
the caller's thread before the load's runs are cut and checked, with the layout's plan, the slice plan's plane
order and the job's objects; the launch gets what they returned, which is released once the launch is done, also
when the load is refused or its launch fails; a backend that cannot copy ahead still loads every byte."""

from __future__ import annotations

import threading
from typing import Any, Optional

import pytest
import torch

from lmcache_npu.ops import Direction
from lmcache_npu.transfer import KVMover
from lmcache_npu.transfer.slices import plan_slices

from .test_slices import Case, _AllSlicesInOneCall, announced_layers, answers, mover_of, unsliced


class _Ahead:
    """What a backend's copy_ahead returns: it only counts its releases."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def release(self) -> None:
        self.calls.append(("release", self))


class _CopiesAhead(_AllSlicesInOneCall):
    """A one-call backend that copies ahead: every call it gets, in order."""

    def __init__(self, inner: Any, calls: list[tuple[Any, ...]], ahead_fails: bool = False,
                 launch_fails: bool = False) -> None:
        super().__init__(inner, [], [])
        self.order = calls
        self.ahead_fails, self.launch_fails = ahead_fails, launch_fails

    def copy_ahead(self, plan: Any, plane_slice: Any, objects: Any) -> _Ahead:
        self.order.append(("ahead", threading.current_thread(), plan, plane_slice, list(objects)))
        if self.ahead_fails:
            raise RuntimeError("cudaMemcpyAsync: out of memory")
        return _Ahead(self.order)

    def launch_sliced(self, batch: Any, plane_slices: Any, count: int, after_kernel: Any = None,
                      ahead: Optional[_Ahead] = None) -> Any:
        self.order.append(("launch", ahead))
        if self.launch_fails:
            raise RuntimeError("device fault while enqueueing")
        return super().launch_sliced(batch, plane_slices, count, after_kernel)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The call log, with an entry each time the mover cuts and checks a batch."""
    calls: list[tuple[Any, ...]] = []
    checked = KVMover._checked_batch

    def logged(self: KVMover, lane: Any, job: Any) -> Any:
        calls.append(("checked",))
        return checked(self, lane, job)

    monkeypatch.setattr(KVMover, "_checked_batch", logged)
    return calls


def _run(case: Case, mover: KVMover, count: int) -> tuple[Any, list[Any]]:
    """A sliced load of the case's chunks in `count` slices, waited for: its progress and every command's answer."""
    slices = plan_slices(case.layout, announced_layers(case.layout), count)
    report, done, results = answers(case.chunks)
    progress = mover.run_sliced(case.moves(0), case.objects, report, slices)
    assert done.wait(120), "the load was never reported"
    return progress, results


@pytest.mark.parametrize("name,family", [("llama3-8b", "ascend"), ("deepseek-v4-flash", "ascend")])
def test_slice_zero_is_copied_ahead_of_the_checks_and_handed_to_the_launch(name: str, family: str,
                                                                         checks: list[tuple[Any, ...]]) -> None:
    case = Case(name, family, 2, seed=21)
    mover = mover_of(case.layout, "host")
    try:
        expected, _ = unsliced(case, mover, 0)
        mover.set_backend(Direction.LOAD, _CopiesAhead(mover.backends[Direction.LOAD], checks))
        checks.clear()
        case.scrub()
        progress, results = _run(case, mover, 3)
        assert all(r.ok for r in results), [r.reason for r in results]
        got = case.pages()
    finally:
        mover.close()
    kinds = [call[0] for call in checks]
    assert kinds == ["ahead", "checked", "launch", "release"], kinds
    _, thread, plan, plane_slice, objects = checks[0]
    assert thread is threading.current_thread(), "slice 0's copies were not asked for on the caller's thread"
    assert plan is case.layout.plan and plane_slice is progress.slices.plane_slices, "ahead for another plan or order"
    assert all(a is b for a, b in zip(objects, case.objects)) and len(objects) == case.chunks
    assert checks[2][1] is checks[3][1], "the launch did not get what was copied ahead, or another was released"
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the load's bytes differ from the plain load's"
    flipped = [t.clone() for t in got]  # negative control: the comparison sees one wrong byte
    flipped[-1].view(torch.uint8).view(-1)[-1] ^= 1
    assert not all(torch.equal(a, b) for a, b in zip(flipped, expected))


def test_a_load_refused_at_its_checks_releases_what_was_copied_ahead(checks: list[tuple[Any, ...]]) -> None:
    case = Case("llama3-8b", "ascend", 2, seed=22)
    case.objects = [o[:-64] for o in case.objects]  # short objects: the batch check refuses the load
    mover = mover_of(case.layout, "host")
    try:
        mover.set_backend(Direction.LOAD, _CopiesAhead(mover.backends[Direction.LOAD], checks))
        progress, results = _run(case, mover, 3)
    finally:
        mover.close()
    assert results and not any(r.ok for r in results), "a load with short objects was served"
    assert progress.failure, "the slices' waiters were not told the load failed"
    assert [call[0] for call in checks] == ["ahead", "checked", "release"], "a refused load launched, or kept its copy"


def test_a_launch_that_fails_after_copying_ahead_releases_it_once(checks: list[tuple[Any, ...]]) -> None:
    case = Case("llama3-8b", "ascend", 1, seed=23)
    mover = mover_of(case.layout, "host")
    try:
        mover.set_backend(Direction.LOAD, _CopiesAhead(mover.backends[Direction.LOAD], checks,
                                                         launch_fails=True))
        progress, results = _run(case, mover, 2)
    finally:
        mover.close()
    assert results and not any(r.ok for r in results) and "device fault" in progress.failure
    kinds = [call[0] for call in checks]
    assert kinds == ["ahead", "checked"] + ["launch"] * (1 + mover.load_retries) + ["release"], kinds
    launches = [call[1] for call in checks if call[0] == "launch"]
    assert all(a is launches[0] for a in launches) and checks[-1][1] is launches[0]


def test_a_backend_that_cannot_copy_ahead_still_loads_every_byte(checks: list[tuple[Any, ...]],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    case = Case("gemma3-27b", "ascend", 2, seed=24)
    mover = mover_of(case.layout, "host")
    try:
        expected, _ = unsliced(case, mover, 0)
        mover.set_backend(Direction.LOAD, _CopiesAhead(mover.backends[Direction.LOAD], checks,
                                                         ahead_fails=True))
        checks.clear()
        case.scrub()
        progress, results = _run(case, mover, 2)
        assert all(r.ok for r in results) and not progress.failure
        got = case.pages()
    finally:
        mover.close()
    assert [call[0] for call in checks] == ["ahead", "checked", "launch"]
    assert checks[2][1] is None, "the launch was told slice 0 was copied ahead when it was not"
    assert "could not be enqueued ahead" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the load's bytes differ from the plain load's"
