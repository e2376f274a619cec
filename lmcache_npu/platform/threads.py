"""Threads that yield to compute: the store's background work (sealing, disk write-through, remote puts) runs only on
a core the model leaves idle.

On a CPU engine the model's forward runs on every core (one OpenMP thread each) and a team waits at every barrier for
its slowest thread: a background thread that takes a core from one of them for a millisecond holds the whole forward
for that millisecond. On an accelerator host the same threads compete with the engine's scheduling thread. Linux's
SCHED_IDLE policy gives such a thread the CPU only where nothing of normal priority is runnable (its weight is 3
against 1024, so it is never starved outright); elsewhere the lowest nice value one thread can take. A thread marked
here also hashes on itself alone (`in_background`): BLAKE3's extra threads would be of normal priority again.

Work a request waits for (a promotion, a remote get, a load) keeps normal priority: it is not background work.

Yielding alone can starve: on a host whose cores the engines keep busy, a SCHED_IDLE thread may not run for seconds,
and a persist it has not run keeps its arena slot pinned. So background work is bounded (`BoundedYieldPool`): a job
that has waited `YIELD_BOUND_S` for an idle core is run by a thread of normal priority instead, which takes at most
one core, and only for work that old.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from enum import Enum
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger(__name__)

_local = threading.local()
YIELD_BOUND_S = 0.1  # background work waits at most this long for an idle core before it runs at normal priority


class Yielding(str, Enum):
    """What the OS granted a thread that asked to yield to compute."""

    IDLE = "idle"  # Linux SCHED_IDLE: runs only on an otherwise idle core
    NICE = "nice"  # nice 19 for this thread alone (a kernel or sandbox that refuses SCHED_IDLE)
    NONE = "none"  # no per-thread priority on this OS (a process-wide nice would slow the model too)


def yield_to_compute() -> Yielding:
    """Lowers the calling thread's CPU priority for the rest of its life and marks it as background; returns what
    the OS granted. Never raises: a thread the OS will not lower still runs its work, at normal priority."""
    _local.background = True
    if not sys.platform.startswith("linux"):
        return Yielding.NONE
    try:  # on Linux the scheduling calls name threads: pid 0 is the calling thread, not the process
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return Yielding.IDLE
    except (OSError, AttributeError) as exc:
        logger.debug("SCHED_IDLE refused for thread %s (%s); trying nice 19", threading.current_thread().name, exc)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return Yielding.NICE
    except OSError as exc:
        logger.debug("nice 19 refused for thread %s (%s); it runs at normal priority",
                     threading.current_thread().name, exc)
        return Yielding.NONE


def in_background() -> bool:
    """Whether the calling thread yields to compute (`yield_to_compute` ran on it)."""
    return bool(getattr(_local, "background", False))


def thread_policy(native_id: int) -> str:
    """The scheduling policy of thread `native_id` of this process as the OS reports it ("idle", "other", ...), or
    "unknown" where the OS does not say; for tests and `doctor`."""
    if not sys.platform.startswith("linux"):
        return "unknown"
    try:
        policy = os.sched_getscheduler(native_id)
    except OSError:
        return "unknown"
    names = {getattr(os, name): name[len("SCHED_"):].lower()
             for name in ("SCHED_OTHER", "SCHED_IDLE", "SCHED_BATCH", "SCHED_FIFO", "SCHED_RR") if hasattr(os, name)}
    return names.get(policy, str(policy))


class BoundedYieldPool:
    """A FIFO of background jobs run by `workers` threads that yield to compute, and one thread of normal priority
    (the rescuer) that runs a job once it has waited `bound_s`, and the urgent ones (`submit_urgent`: something
    waits for them after all) at once and alone: on a saturated host the work still gets done, at most one core's
    worth. `yields` False: every thread is of normal priority, no rescuer is made and urgent jobs go first.
    `submit` and `shutdown` as a ThreadPoolExecutor's."""

    def __init__(self, workers: int, name: str, *, yields: bool = True, bound_s: Optional[float] = None) -> None:
        bound_s = YIELD_BOUND_S if bound_s is None else bound_s
        if workers < 1:
            raise ValueError(f"a bounded yield pool needs at least one worker, got {workers}")
        if not bound_s > 0:
            raise ValueError(f"the yield bound must be positive, got {bound_s}")
        self.bound_s = bound_s
        self.yields = yields
        self.workers = workers
        self._jobs: deque[tuple[float, Future, Callable[..., Any], tuple, dict]] = deque()
        self._urgent: deque[tuple[float, Future, Callable[..., Any], tuple, dict]] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._stopping = False
        self.rescued = 0  # jobs the rescuer ran: urgent ones, and those that waited the bound for an idle core
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{number}", daemon=True)
                         for number in range(workers)]
        if yields:
            self._threads.append(threading.Thread(target=self._rescue, name=f"{name}-rescuer", daemon=True))
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self._queue(self._jobs, fn, args, kwargs)

    def submit_urgent(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """A job something waits for after all (the caller says so): never left to a thread that yields, which
        could hold it for as long as the host has no idle core."""
        return self._queue(self._urgent if self.yields else self._jobs, fn, args, kwargs, first=not self.yields)

    def _queue(self, jobs: deque, fn: Callable[..., Any], args: tuple, kwargs: dict, first: bool = False) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("cannot submit to a bounded yield pool after shutdown")
            job = (time.monotonic(), future, fn, args, kwargs)
            jobs.appendleft(job) if first else jobs.append(job)
            self._ready.notify_all()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Runs what was submitted, then ends the threads (joined when `wait`)."""
        with self._lock:
            self._stopping = True
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        if self.yields:
            yield_to_compute()
        while True:
            with self._lock:
                while not self._jobs and not self._stopping:
                    self._ready.wait()
                if not self._jobs:
                    return  # stopping: the rescuer runs what is urgent
                job = self._jobs.popleft()
            _run(job)

    def _rescue(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._urgent:
                        job = self._urgent.popleft()
                        break
                    if self._jobs:
                        waited = time.monotonic() - self._jobs[0][0]
                        if waited >= self.bound_s or self._stopping:
                            job = self._jobs.popleft()
                            break
                        self._ready.wait(self.bound_s - waited)
                    elif self._stopping:
                        return
                    else:
                        self._ready.wait()
                self.rescued += not self._stopping
            _run(job)


def _run(job: tuple) -> None:
    _, future, fn, args, kwargs = job
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # the caller reads it from the future, as from a ThreadPoolExecutor's
        future.set_exception(exc)


def pin_thread(cpus: Sequence[int]) -> bool:
    """Pins the calling thread (only it: on Linux pid 0 names the thread) to `cpus`; returns whether the OS took it.
    A thread may leave the mask it inherited (an engine pinned to its cores): only the cgroup's CPUs bound it. Never
    raises: CPUs the OS refuses leave the thread where it was, with a warning."""
    name = threading.current_thread().name
    wanted = set(cpus)
    if not hasattr(os, "sched_setaffinity") or not wanted:
        logger.warning("thread %s: cannot pin to CPUs %s here; it runs on any CPU", name, sorted(wanted))
        return False
    try:
        os.sched_setaffinity(0, wanted)
    except (OSError, ValueError, OverflowError) as exc:
        logger.warning("thread %s: pinning to CPUs %s refused (%s); left unpinned", name, sorted(wanted), exc)
        return False
    got = os.sched_getaffinity(0)
    if got != wanted:  # the kernel keeps the CPUs the cgroup allows: say which
        logger.warning("thread %s: asked for CPUs %s, runs on %s", name, sorted(wanted), sorted(got))
    else:
        logger.info("thread %s pinned to CPUs %s", name, sorted(wanted))
    return True
