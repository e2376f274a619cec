"""Threads that yield to compute: the store's background work (sealing, disk write-through, remote puts) runs only on
a core the model leaves idle.

On a CPU engine the model's forward runs on every core (one OpenMP thread each) and a team waits at every barrier for
its slowest thread: a background thread that takes a core from one of them for a millisecond holds the whole forward
for that millisecond. On an accelerator host the same threads compete with the engine's scheduling thread. Linux's
SCHED_IDLE policy gives such a thread the CPU only where nothing of normal priority is runnable (its weight is 3
against 1024, so it is never starved outright); elsewhere the lowest nice value one thread can take. A thread marked
here also hashes on itself alone (`in_background`): BLAKE3's extra threads would be of normal priority again.

Work a request waits for (a promotion, a remote get, a load) keeps normal priority: it is not background work.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from enum import Enum

logger = logging.getLogger(__name__)

_local = threading.local()


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
