"""Background store work yields to compute: the executor's persist/put/drop threads and the disk tier's writers run
under Linux's SCHED_IDLE (a core the model leaves idle), the threads a waiting request needs (promotions, gets) keep
normal priority, and a yielding thread hashes on itself alone. Yielding never starves: work that waited the yield
bound is run by a rescuer of normal priority (the yielding threads are held busy here, as a saturated host would).
Negative controls: with `yields` off the same threads run at normal priority and nothing rescues, and the threaded
BLAKE3 path is taken outside a yielding thread."""

from __future__ import annotations

import os
import sys
import threading
import types

import numpy as np
import pytest

from lmcache_npu.platform import threads as threads_module
from lmcache_npu.platform.threads import BoundedYieldPool, Yielding, in_background, thread_policy, yield_to_compute
from lmcache_npu.store.metrics import Metric
from lmcache_npu.store import envelope
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.disk.tier import DiskTier
from lmcache_npu.store.routes.build import make_executor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread policies are Linux's")


@pytest.fixture
def unbounded(monkeypatch) -> None:
    """A yield bound no test reaches: whichever thread runs a job is a yielding one, however busy the host."""
    monkeypatch.setattr(threads_module, "YIELD_BOUND_S", 3600.0)


def _policy_on(pool) -> tuple[str, bool]:
    """The scheduling policy and background mark of a thread of `pool` (a ThreadPoolExecutor's `submit`)."""
    return pool.submit(lambda: (thread_policy(threading.get_native_id()), in_background())).result(timeout=10)


def _granted() -> Yielding:
    result: list[Yielding] = []
    thread = threading.Thread(target=lambda: result.append(yield_to_compute()))
    thread.start()
    thread.join()
    return result[0]


def test_a_thread_that_yields_runs_idle_and_is_marked_and_others_are_not() -> None:
    seen: list[tuple[Yielding, str, bool]] = []

    def work() -> None:
        granted = yield_to_compute()
        seen.append((granted, thread_policy(threading.get_native_id()), in_background()))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    granted, policy, marked = seen[0]
    assert marked and not in_background()  # the mark is the thread's own
    assert policy == ("idle" if granted is Yielding.IDLE else "other")
    assert thread_policy(threading.get_native_id()) == "other"  # the caller (the model's thread) is untouched


@pytest.mark.parametrize("yields", [True, False])
def test_the_executors_background_work_yields_and_its_request_work_does_not(yields: bool, unbounded) -> None:
    if yields and _granted() is not Yielding.IDLE:
        pytest.skip("this kernel or sandbox refuses SCHED_IDLE")
    executor = make_executor(0, HostArena(2, 4096, pinned=False), io_threads=1, yields=yields)
    try:
        assert _policy_on(executor.context.background) == (("idle", True) if yields else ("other", False))
        assert _policy_on(executor.context.io) == ("other", False)  # promotions and gets: a request waits for them
    finally:
        executor.close()


@pytest.mark.parametrize("yields", [True, False])
def test_the_disk_writers_yield(tmp_path, yields: bool) -> None:
    if yields and _granted() is not Yielding.IDLE:
        pytest.skip("this kernel or sandbox refuses SCHED_IDLE")
    tier = DiskTier(tmp_path, b"layout-print-16B", writer_threads=1, yields=yields)
    try:
        writer, *rescuer = tier._threads
        assert thread_policy(writer.native_id) == ("idle" if yields else "other")
        assert [thread_policy(t.native_id) for t in rescuer] == (["other"] if yields else [])
    finally:
        tier.close()


def _held(pool: BoundedYieldPool, workers: int) -> threading.Event:
    """Every yielding worker of `pool` busy until the event is set (a host with no idle core)."""
    release, started = threading.Event(), threading.Barrier(workers + 1)

    def hold() -> None:
        started.wait()
        release.wait()

    for _ in range(workers):
        pool.submit(hold)
    started.wait(timeout=10)
    return release


@pytest.mark.parametrize("yields", [True, False])
def test_work_that_no_idle_core_takes_runs_once_it_waited_the_bound(yields: bool) -> None:
    pool = BoundedYieldPool(2, "test-bounded", yields=yields, bound_s=0.05)
    release = _held(pool, 2)
    try:
        job = pool.submit(lambda: threading.current_thread().name)
        if yields:
            assert job.result(timeout=10) == "test-bounded-rescuer" and pool.rescued == 1
        else:  # the control: no rescuer, so it waits for a worker however long that takes
            assert not job.done() and not any(t.name.endswith("rescuer") for t in pool._threads)
        release.set()
        assert job.result(timeout=10).startswith("test-bounded-")
    finally:
        release.set()
        pool.shutdown()


@pytest.mark.parametrize("yields", [True, False])
def test_an_urgent_job_is_never_left_to_a_yielding_thread(yields: bool) -> None:
    pool = BoundedYieldPool(1, "test-urgent", yields=yields, bound_s=3600.0)
    release = _held(pool, 1)
    try:
        later = pool.submit(lambda: "later")
        urgent = pool.submit_urgent(lambda: threading.current_thread().name)
        if yields:  # at once, by the rescuer, though the bound is an hour and the worker busy
            assert urgent.result(timeout=10) == "test-urgent-rescuer" and not later.done()
        else:  # the control: an ordinary pool runs it first, on its worker, once that is free
            assert not urgent.done()
            release.set()
            assert urgent.result(timeout=10) == "test-urgent-0"
        release.set()
        assert later.result(timeout=10) == "later"
    finally:
        release.set()
        pool.shutdown()


def test_a_worker_that_is_free_runs_the_job_and_results_and_errors_come_back() -> None:
    pool = BoundedYieldPool(1, "test-free", bound_s=3600.0)
    try:
        assert pool.submit(lambda: threading.current_thread().name).result(timeout=10) == "test-free-0"
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 // 0).result(timeout=10)
        assert pool.rescued == 0
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


def test_shutdown_runs_what_was_submitted() -> None:
    pool = BoundedYieldPool(1, "test-drain", bound_s=3600.0)
    release = _held(pool, 1)
    jobs = [pool.submit(lambda n=n: n) for n in range(5)]
    release.set()
    pool.shutdown(wait=True)
    assert [job.result(timeout=0) for job in jobs] == list(range(5))


@pytest.mark.parametrize("bad", [dict(workers=0), dict(bound_s=0.0)])
def test_a_pool_without_workers_or_bound_is_refused(bad: dict) -> None:
    options = {"workers": 1, "name": "x", **bad}
    with pytest.raises(ValueError, match="worker|bound"):
        BoundedYieldPool(options.pop("workers"), options.pop("name"), **options)


@pytest.mark.parametrize("yields,urgent", [(True, False), (True, True), (False, False)])
def test_a_disk_write_no_idle_core_takes_is_written_by_the_rescuer(tmp_path, monkeypatch, yields: bool,
                                                                   urgent: bool) -> None:
    """After the yield bound, or at once when urgent (the bound is then an hour)."""
    monkeypatch.setattr(threads_module, "YIELD_BOUND_S", 3600.0 if urgent else 0.05)
    release = threading.Event()
    real_write = DiskTier._write_one

    def write_one(tier, item, payload):
        if not threading.current_thread().name.endswith("rescuer"):
            release.wait()  # the yielding writer never gets a core
        return real_write(tier, item, payload)

    monkeypatch.setattr(DiskTier, "_write_one", write_one)
    tier = DiskTier(tmp_path, b"layout-print-16B", writer_threads=1, yields=yields)
    written: list[tuple[str, bool]] = []
    try:
        for name in ("held", "rescued"):
            assert tier.write_async(name, bytes([len(name)]) * 4096, urgent=urgent and name == "rescued",
                                    done=lambda result, name=name: written.append((name, result.ok))).ok
        pause = threading.Event()
        for _ in range(200 if yields else 10):  # the control: half a second in which no writer could write
            if written:
                break
            pause.wait(0.05)
        if not yields:
            assert written == [] and tier.counters[Metric.RESCUED_WRITES] == 0
            return
        assert written == [("rescued", True)] and tier.counters[Metric.RESCUED_WRITES] == 1
        assert os.path.exists(tier.file_path("rescued")) and not os.path.exists(tier.file_path("held"))
    finally:
        release.set()
        tier.close()


def test_a_yielding_thread_hashes_on_itself_alone(monkeypatch) -> None:
    asked: list[int] = []
    fake = types.ModuleType("blake3")

    class _Hash:
        def __init__(self, data, max_threads: int) -> None:
            asked.append(max_threads)

        def digest(self) -> bytes:
            return b"\0" * 32

    fake.blake3 = _Hash  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "blake3", fake)
    monkeypatch.setattr(envelope, "_BLAKE3_THREADS", 4)  # as on a host of 16 cores
    data = memoryview(np.zeros(envelope._BLAKE3_THREADED_FROM, dtype=np.uint8))
    envelope._blake3(data)  # the model's thread: BLAKE3 may use its helpers

    def background() -> None:
        yield_to_compute()
        envelope._blake3(data)

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert asked == [4, 1]
