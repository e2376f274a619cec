"""A transfer lane never hangs on torch_npu's task queue (finding F2 of the second look): a task the queue drops
(released unrun after a failed task) or refuses (its queue past the error state) fails the transfer at once, a
transfer whose tail or completion event does not arrive in time fails at its deadline, and the lane takes new work
again once the late transfer has finished. Each test runs the wait on a thread with a bound, so a hang is a failure
of the test, not of the suite."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np
import pytest

from lmcache_npu.ops.npu_backend import NpuBackend

from ..ops.oracle import oracle_store, payload_mask, small_geometry
from .fake_npu import FakeNpu
from .test_npu_backend_fake import SLOTS, on_device

BOUND_S = 20  # far above any deadline set here and below the default 60 s one: a wait blocked that long is a hang


class Outcome:
    """A call run on its own thread (with the fake's device selected there): done, and what it raised."""

    def __init__(self, fake: FakeNpu, call: Callable[[], object]) -> None:
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

        def run() -> None:
            try:
                fake.select_device()
                call()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)  # a hung wait must not block the interpreter's exit
        self.thread.start()

    def finished(self, seconds: float = BOUND_S) -> bool:
        return self.done.wait(seconds)


def _setup(fake: FakeNpu, wait_timeout_ms: Optional[int] = None):  # type: ignore[no-untyped-def]
    geometry = on_device(fake, small_geometry())
    plan = geometry.plan()
    backend = NpuBackend.on_runtime(fake.runtime(), cores=3, staging_bytes=4 * plan.object_bytes,
                                    wait_timeout_ms=wait_timeout_ms)
    backend.prepare(plan)
    fake.drain()
    objects = fake.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    return geometry, plan, backend, objects


def _wait_until(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def _assert_stores_right(geometry, plan, backend: NpuBackend, objects) -> None:  # type: ignore[no-untyped-def]
    backend.store(plan, SLOTS, objects)
    expected = oracle_store(geometry, SLOTS, objects.numpy())
    mask = payload_mask(geometry)
    assert np.array_equal(objects.numpy()[:, mask], expected[:, mask])


def test_tasks_dropped_behind_a_failed_model_task_fail_the_transfer(fake_npu: FakeNpu) -> None:
    """The model's failing task makes the queue release our windows and tail unrun: the wait ends with the reason."""
    geometry, plan, backend, objects = _setup(fake_npu)
    before = len(fake_npu.device_log())
    fake_npu.queue(paused=True)
    fake_npu.model_fail("model: an aclnn op that fails")
    store = Outcome(fake_npu, lambda: backend.store(plan, SLOTS, objects))
    _wait_until(lambda: fake_npu.queue_pending() >= 3)  # the failing op, the window, the tail
    fake_npu.queue(paused=False)
    assert store.finished(), "the lane hung on tasks torch_npu dropped"
    assert isinstance(store.error, RuntimeError) and "dropped by torch_npu's task queue" in str(store.error)
    assert fake_npu.queue_dropped() >= 2 and "kernel" not in fake_npu.device_log()[before:]
    _assert_stores_right(geometry, plan, backend, objects)  # the queue runs again: so does the lane


def test_a_queue_that_drops_everything_pending_ends_the_wait(fake_npu: FakeNpu) -> None:
    _, plan, backend, objects = _setup(fake_npu)
    fake_npu.queue(paused=True)
    load = Outcome(fake_npu, lambda: backend.load(plan, SLOTS, objects))
    _wait_until(lambda: fake_npu.queue_pending() >= 2)
    assert not load.finished(0.05), "the wait must wait for the tail while it is queued (the bound sees a block)"
    assert fake_npu.queue_drop_pending() >= 2
    assert load.finished(), "the lane hung on dropped tasks"
    assert "dropped by torch_npu's task queue" in str(load.error)


def test_a_queue_that_refuses_new_tasks_fails_the_transfer_at_once(fake_npu: FakeNpu) -> None:
    geometry, plan, backend, objects = _setup(fake_npu)
    fake_npu.queue_refusing(True)
    store = Outcome(fake_npu, lambda: backend.store(plan, SLOTS, objects))
    assert store.finished(), "the lane hung on tasks torch_npu refused to queue"
    assert "dropped by torch_npu's task queue" in str(store.error)
    fake_npu.queue_refusing(False)
    _assert_stores_right(geometry, plan, backend, objects)


def test_a_stalled_queue_fails_at_the_deadline_and_the_lane_recovers(fake_npu: FakeNpu) -> None:
    geometry, plan, backend, objects = _setup(fake_npu, wait_timeout_ms=200)
    fake_npu.queue(paused=True)
    started = time.monotonic()
    store = Outcome(fake_npu, lambda: backend.store(plan, SLOTS, objects))
    assert store.finished(), "the lane hung on a stalled queue"
    assert time.monotonic() - started >= 0.2
    assert "did not run its tail task within 200 ms" in str(store.error)
    with pytest.raises(RuntimeError, match="timed out and has not finished"):  # its tasks are still queued
        backend.store(plan, SLOTS, objects)
    fake_npu.queue(paused=False)
    fake_npu.drain()  # the late transfer runs (and, failed already, skips its device work)
    _assert_stores_right(geometry, plan, backend, objects)


def test_a_hung_device_fails_at_the_deadline_and_the_lane_waits_it_out(fake_npu: FakeNpu) -> None:
    """The tail ran (queued on the stream) but the device never reaches the completion event."""
    geometry, plan, backend, objects = _setup(fake_npu, wait_timeout_ms=200)
    fake_npu.stream_paused(True)
    store = Outcome(fake_npu, lambda: backend.store(plan, SLOTS, objects))
    assert store.finished(), "the lane hung on a device that never completes"
    assert "aclrtSynchronizeEventWithTimeout" in str(store.error) and "507047" in str(store.error)
    with pytest.raises(RuntimeError, match="timed out and has not finished on the device"):
        backend.store(plan, SLOTS, objects)
    fake_npu.stream_paused(False)
    fake_npu.drain()
    _assert_stores_right(geometry, plan, backend, objects)


def test_the_wait_deadline_is_a_checked_backend_option(fake_npu: FakeNpu) -> None:
    with pytest.raises(ValueError, match="backend_options.wait_timeout_ms must be an integer"):
        NpuBackend.on_runtime(fake_npu.runtime(), wait_timeout_ms=0)
    assert NpuBackend.on_runtime(fake_npu.runtime()).wait_timeout_ms == 60_000
    with pytest.raises(ValueError, match="at least 1 ms"):
        fake_npu.native.Transfer(0)
