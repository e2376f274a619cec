"""What every route handler of one rank shares: the rank, the arena it runs against, the thread pools, and the one
place commands are answered (`report`), where the executor's waits and `poll` find them."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Collection, Optional, Protocol, Sequence

from ...platform.threads import BoundedYieldPool
from ..arena import HostArena
from ..commands import Command, Completion, Route
from ..tier import Failure, TierResult

if TYPE_CHECKING:  # the worker sets the timer; the context only tells it
    from ..cost.timer import TransferTimer

logger = logging.getLogger(__name__)

Report = Callable[[int, TierResult], None]


class RouteHandler(Protocol):
    """Runs the commands of its routes (vLLM's `OffloadingHandler`): `submit` takes one batch (consecutive commands of
    one route; one command where the route is not batched) and answers each command once, now or later, through the
    context's `report`. It may raise only before any command of the batch started (the executor then fails them)."""

    routes: frozenset[Route]  # the (source, destination) pairs it serves
    batched: bool  # whether consecutive commands of one route go to `submit` as one batch
    tier: object  # what it moves bytes through (a tier, a mover; None: it answers why it cannot)

    def submit(self, batch: Sequence[Command]) -> None: ...

    def close(self) -> None: ...


class RouteContext:
    """One rank's shared state: completions collected for `poll`, the pools, and `arena` (swapped by `use_arena`)."""

    def __init__(self, rank: int, arena: HostArena, io_threads: int = 4, yields: bool = False) -> None:
        self.rank = rank
        self.arena = arena
        # promotions and gets: a request waits for them
        self.io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"lmcache-store-r{rank}")
        # persists, puts, remote drops: nothing waits for them, so they wait for idle cores (a bounded while)
        self.background = BoundedYieldPool(io_threads, f"lmcache-background-r{rank}", yields=yields)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.done: deque[Completion] = deque()
        self.outstanding = 0
        self.timer: Optional[TransferTimer] = None  # times each batch for the scheduler's cost model

    def report(self, cmd_id: int, result: TierResult) -> None:
        """Answers command `cmd_id` (exactly once per command)."""
        if self.timer is not None:
            self.timer.finished(cmd_id, result.ok, result.seconds)
        with self.idle:
            self.done.append(Completion(cmd_id, self.rank, result.ok, result.reason))
            self.outstanding -= 1
            self.idle.notify_all()

    def guarded(self, cmd_id: int, work: Callable[..., TierResult], *args: object) -> None:
        """Background work always answers, even when a tier raises (a bug there must not hang the index)."""
        try:
            result = work(*args)
        except Exception as exc:  # the serving path turns any tier fault into a failed command
            logger.exception("rank %d: store command %d raised", self.rank, cmd_id)
            result = TierResult.fail(Failure.ERROR, str(exc))
        self.report(cmd_id, result)

    def poll(self) -> list[Completion]:
        """Completions since the last call."""
        with self.lock:
            done = list(self.done)
            self.done.clear()
        return done

    def wait(self, ready: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Whether `ready()` (read under the lock) held within `timeout` seconds."""
        with self.idle:
            return self.idle.wait_for(ready, timeout)

    def answered(self, cmd_ids: Collection[int]) -> set[int]:
        """Which of `cmd_ids` wait for `poll` (call under the lock, as `wait`'s predicate does)."""
        return {done.cmd_id for done in self.done if done.cmd_id in cmd_ids}

    def shutdown(self) -> None:
        """Waits for the pools' work (every command they run answers first)."""
        self.io.shutdown(wait=True)
        self.background.shutdown(wait=True)
