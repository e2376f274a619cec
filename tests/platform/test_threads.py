"""Background store work yields to compute: the executor's persist/put/drop threads and the disk tier's writers run
under Linux's SCHED_IDLE (a core the model leaves idle), the threads a waiting request needs (promotions, gets) keep
normal priority, and a yielding thread hashes on itself alone. Negative controls: with `yields` off the same threads
run at normal priority, and the threaded BLAKE3 path is taken outside a yielding thread."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from lmcache_npu.platform.threads import Yielding, in_background, thread_policy, yield_to_compute
from lmcache_npu.store import envelope
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.disk.tier import DiskTier
from lmcache_npu.store.executor import StoreExecutor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread policies are Linux's")


def _policy_on(pool) -> tuple[str, bool]:
    """The scheduling policy and background mark of a thread of `pool` (a ThreadPoolExecutor)."""
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
def test_the_executors_background_work_yields_and_its_request_work_does_not(yields: bool) -> None:
    if yields and _granted() is not Yielding.IDLE:
        pytest.skip("this kernel or sandbox refuses SCHED_IDLE")
    executor = StoreExecutor(0, HostArena(2, 4096, pinned=False), io_threads=1, yields=yields)
    try:
        assert _policy_on(executor._background) == (("idle", True) if yields else ("other", False))
        assert _policy_on(executor._io) == ("other", False)  # promotions and gets: a request waits for them
    finally:
        executor.close()


@pytest.mark.parametrize("yields", [True, False])
def test_the_disk_writers_yield(tmp_path, yields: bool) -> None:
    if yields and _granted() is not Yielding.IDLE:
        pytest.skip("this kernel or sandbox refuses SCHED_IDLE")
    tier = DiskTier(tmp_path, b"layout-print-16B", writer_threads=1, yields=yields)
    try:
        (writer,) = tier._threads
        assert thread_policy(writer.native_id) == ("idle" if yields else "other")
    finally:
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
