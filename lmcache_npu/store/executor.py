"""The worker side of the store: runs the index's commands against this rank's arena, each by the handler of its
route (source, destination: `commands.Route`), the way vLLM's OffloadingWorker dispatches by medium pair.

Commands run in the order given; a run of consecutive commands of one batched route (device moves, remote gets or
puts) goes to its handler as one batch. Before anything runs, a command of another node cache epoch, or one naming
a slot outside the arena, is refused. Every command gets exactly one `Completion`, collected by `poll()`.

The handlers (`routes/`: device, disk, remote, drop) and the one envelope guard are built by `routes.build`; this
module knows no tier. Where background work runs and how envelopes are sealed: `routes/` and docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Collection, Iterator, Optional, Sequence

from .arena import HostArena
from .commands import (ARENA_TO_DEVICE, ARENA_TO_DISK, ARENA_TO_REMOTE, DEVICE_TO_ARENA, Completion, DeviceMove, Route, SlotMove,
                       WorkerCommand)
from .envelope import Sealer
from .keys import ChunkKey
from .tier import Failure, TierResult
from .routes.context import RouteContext, RouteHandler
from .routes.guard import EnvelopeGuard

if TYPE_CHECKING:  # the worker sets the timer
    from .cost.timer import TransferTimer

logger = logging.getLogger(__name__)


class StoreExecutor:
    """One per worker process (rank): dispatches commands to `handlers` (one per route; two may not share a route),
    answers through `context`, and keeps the envelope `guard` the handlers seal with."""

    def __init__(self, context: RouteContext, guard: EnvelopeGuard, handlers: Sequence[RouteHandler]) -> None:
        self.context = context
        self.guard = guard
        self.handlers = tuple(handlers)
        self.epoch: Optional[str] = None  # the node cache epoch `arena` maps (None: a private arena), see use_arena
        self._routes: dict[Route, RouteHandler] = {}
        for handler in self.handlers:
            for route in handler.routes:
                if route in self._routes:
                    raise ValueError(f"route {route} has two handlers")
                self._routes[route] = handler
        self._closed = False
        self._submitting = 0

    # ---- what the worker reads and sets ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def arena(self) -> HostArena:
        return self.context.arena

    @property
    def timer(self) -> Optional[TransferTimer]:
        """Times each batch for the scheduler's cost model (the worker sets it)."""
        return self.context.timer

    @timer.setter
    def timer(self, timer: Optional[TransferTimer]) -> None:
        self.context.timer = timer

    # the pipeline, the node exporter and tests read (and tests swap) what a route moves bytes through: its handler's
    # `tier`, found by route so this module names no tier class (None where no handler serves the route)
    mover = property(lambda self: self._tier_of(DEVICE_TO_ARENA), lambda self, t: self._set_tier(DEVICE_TO_ARENA, t))
    disk = property(lambda self: self._tier_of(ARENA_TO_DISK), lambda self, t: self._set_tier(ARENA_TO_DISK, t))
    remote = property(lambda self: self._tier_of(ARENA_TO_REMOTE), lambda self, t: self._set_tier(ARENA_TO_REMOTE, t))

    def _tier_of(self, route: Route) -> Any:
        handler = self._routes.get(route)
        return None if handler is None else handler.tier

    def _set_tier(self, route: Route, tier: Any) -> None:
        self._routes[route].tier = tier  # a test's stand-in, or the stress test's own client per rank

    @property
    def sealer(self) -> Sealer:
        return self.guard.sealer

    @sealer.setter
    def sealer(self, sealer: Sealer) -> None:
        self.guard.sealer = sealer

    def route(self, route: Route) -> RouteHandler:
        """The handler of `route` (KeyError: none serves it)."""
        return self._routes[route]

    def use_arena(self, arena: HostArena, epoch: Optional[str]) -> None:
        """Later commands run against `arena`, the mapping of node cache epoch `epoch` (commands in flight keep the
        old mapping alive through their slot views)."""
        self.context.arena = arena
        self.epoch = epoch

    # ---- commands -------------------------------------------------------------------------------------------------

    def submit(self, commands: Sequence[WorkerCommand]) -> None:
        """Runs (or starts) every command in order; consecutive commands of one batched route go as one batch."""
        with self._accepting(commands):
            self._dispatch(self._admitted(commands))

    def submit_sliced(self, moves: Sequence[DeviceMove], slices: Any) -> Optional[Any]:
        """Loads into the forward about to run, launched slice by slice (`slices`: the mover's `SlicePlan`), admitted
        as `submit` admits. Returns the mover's `SlicedLoad` the forward waits on; None when nothing of it runs
        (every move is answered as failed)."""
        with self._accepting(moves):
            admitted = self._admitted(moves)
            if not admitted:
                return None
            try:
                return self.route(ARENA_TO_DEVICE).submit_sliced(admitted, slices)
            except Exception as exc:  # nothing of it ran or answered: fail it
                self._refused(admitted, exc)
                return None

    @contextlib.contextmanager
    def _accepting(self, commands: Sequence[WorkerCommand]) -> Iterator[None]:
        """Counts `commands` outstanding and times them; `close` waits for the submit in progress."""
        context = self.context
        with context.lock:
            if self._closed:
                raise RuntimeError("the store executor is closed")
            context.outstanding += len(commands)
            self._submitting += 1
        if context.timer is not None:
            context.timer.started(commands)
        try:
            yield
        finally:
            with context.idle:
                self._submitting -= 1
                context.idle.notify_all()

    def _admitted(self, commands: Sequence[WorkerCommand]) -> list[WorkerCommand]:
        """The commands that may run here; each refused one is answered now."""
        admitted, stale, slots = [], [], self.arena.num_slots
        for command in commands:
            if command.epoch != self.epoch:  # its slot is of another epoch's pages: another engine's chunk by now
                stale.append(command)
                self.context.report(command.cmd_id, TierResult.fail(
                    Failure.ERROR, f"issued for node cache epoch {command.epoch}, but this rank maps epoch "
                    f"{self.epoch}: never run against another epoch's pages"))
            elif not isinstance(command, (SlotMove, DeviceMove)) or 0 <= command.slot < slots:
                admitted.append(command)
            else:  # index and worker disagree on the arena (cpu_bytes or chunk size): refuse, never touch memory
                logger.error("rank %d: command %d names arena slot %d of %d", self.rank, command.cmd_id,
                             command.slot, slots)
                self.context.report(command.cmd_id, TierResult.fail(
                    Failure.ERROR, f"arena slot {command.slot} out of range (the arena has {slots}; index and "
                    f"workers disagree on cpu_bytes?)"))
        if stale:
            logger.warning("rank %d: %d command(s) of node cache epoch %s refused: this rank maps epoch %s (loads "
                           "recompute, stores are not made)", self.rank, len(stale), stale[0].epoch, self.epoch)
        return admitted

    def _dispatch(self, commands: Sequence[WorkerCommand]) -> None:
        position = 0
        while position < len(commands):
            route = commands[position].route
            handler = self._routes.get(route)
            end = position + 1
            if handler is not None and handler.batched:
                while end < len(commands) and commands[end].route == route:
                    end += 1
            batch = commands[position:end]
            self.guard.forget_written(batch)
            try:
                if handler is None:
                    raise KeyError(f"no handler serves route {route}")
                handler.submit(batch)
            except Exception as exc:  # nothing of this batch ran or answered: fail it, keep going with the rest
                self._refused(batch, exc)
            position = end

    def _refused(self, batch: Sequence[WorkerCommand], exc: Exception) -> None:
        """A handler raised before any of `batch` ran or answered: every command of it fails with the reason."""
        logger.exception("rank %d: store commands %s refused", self.rank, [c.cmd_id for c in batch])
        for failed in batch:
            self.context.report(failed.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))

    def refuse(self, commands: Sequence[WorkerCommand], reason: str) -> None:
        """Answers `commands` as failed without running them (their arena is gone: the node cache went away)."""
        with self.context.lock:
            self.context.outstanding += len(commands)
        for command in commands:
            self.context.report(command.cmd_id, TierResult.fail(Failure.ERROR, reason))

    def poll(self) -> list[Completion]:
        """Completions since the last call (to be sent to the scheduler's index)."""
        return self.context.poll()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Whether every submitted command completed within `timeout` (completions stay for `poll`)."""
        return self.context.wait(lambda: self.context.outstanding == 0, timeout)

    def wait_for_any(self, cmd_ids: Collection[int], timeout: float) -> bool:
        """Whether one of `cmd_ids` completed (and waits for `poll`) within `timeout` seconds; returns at once when
        one already has. Completions stay for `poll`."""
        if not cmd_ids:
            return False
        return self.context.wait(lambda: bool(self.context.answered(cmd_ids)), timeout)

    def wait_for_all(self, cmd_ids: Collection[int], timeout: float) -> bool:
        """Whether every one of `cmd_ids` completed (and waits for `poll`) within `timeout` seconds; returns at once
        when they all have. Completions stay for `poll`."""
        wanted = frozenset(cmd_ids)
        if not wanted:
            return True
        return self.context.wait(lambda: self.context.answered(wanted) == wanted, timeout)

    def drain(self, timeout: Optional[float] = None) -> list[Completion]:
        """Waits until every submitted command completed, then polls. Raises TimeoutError naming what is left."""
        if not self.wait_idle(timeout):
            raise TimeoutError(f"rank {self.rank}: {self.context.outstanding} store commands still running "
                               f"after {timeout} s")
        return self.poll()

    def close(self) -> None:
        """Waits for background work, then closes the handlers (the disk's flushes its write-behind queue)."""
        with self.context.lock:
            if self._closed:
                return
            self._closed = True
            self.context.idle.wait_for(lambda: self._submitting == 0)  # a submit in progress finishes first
        self.context.shutdown()
        for handler in self.handlers:
            handler.close()

    # ---- envelopes (the node cache seals and voids slots it hands over) ------------------------------------------

    def forget_seal(self, slot: int) -> None:
        """New bytes are coming into `slot` (here or in another process): the next spill or put seals again."""
        self.guard.forget(slot)

    def seal_slot(self, slot: int, key: ChunkKey) -> None:
        """Seals `slot` for `key` unless its trailer already seals these bytes (a node cache handing its arena over:
        its successor adopts only sealed slots). The caller keeps the slot from being written meanwhile."""
        self.guard.seal(slot, key)

    def unseal_slot(self, slot: int) -> None:
        """A device is about to write `slot` (the node cache hands a store out): its envelope is voided."""
        self.guard.unseal(slot)

    def mark_sealed(self, slot: int, key: ChunkKey) -> None:
        """The slot's trailer verified for `key` (a restart's check): a later persist or put need not seal it."""
        self.guard.remember(slot, key)
