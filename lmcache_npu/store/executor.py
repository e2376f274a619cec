"""The worker side of the store: runs the index's commands against this rank's arena and tiers.

Commands run in the order given, each by the handler of its route (source, destination: `commands.Route`), the way
vLLM's OffloadingWorker dispatches by medium pair; consecutive device moves, and consecutive remote gets or puts, go
as one batch. Spills copy the slot into the disk tier's write-behind queue before the next command, so a slot evicted
and reused in the same step is safe. Persists queue the slot itself (no copy: the index pins it until every rank
completes) for the disk tier's writer threads. Promotions and puts run on threads of their own (the slot is writing
or pinned in the index until every rank completes). Stores and loads move bytes between the device and the arena:
they go to a `DeviceMover` (the connector's transfer backend; a fake in tests). Every command gets exactly one
`Completion`, collected by `poll()`.

Background work yields to compute (`platform/threads.py`, with `yields`): persists (sealing, the disk tier's queue),
puts and remote drops run on threads the OS schedules only where the model leaves a core idle, so they never take a
core from a forward; promotions and gets, which a waiting request needs, run on io threads of normal priority.

Envelopes (`envelope.py`): a slot's bytes leave for disk or Mooncake only sealed (object + trailer for this key and
rank). Spills seal here, before the copy (the slot is reused by the next command); persists and puts seal on the
background threads. A slot is sealed once per content: the executor remembers which key each slot's trailer seals,
forgetting it when a Store or a Promote writes the slot. Every promotion verifies the envelope before it answers ok;
one that does not verify fails ("rejected: <why>"), so the index frees the slot and the chunk is never loaded nor
persisted.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Collection, Optional, Protocol, Sequence, Union

import torch

from ..platform.threads import BoundedYieldPool
from .arena import HostArena
from .cost.timer import TransferTimer
from .commands import (ARENA_TO_DEVICE, ARENA_TO_DISK, ARENA_TO_REMOTE, DEVICE_TO_ARENA, DISK_TO_ARENA,
                       REMOTE_TO_ARENA, Command, Completion, Drop, Load, Persist, Promote, Put, Route, Spill, Store,
                       Tier, Transfer)
from .envelope import RejectionLog, Sealer, seal, unseal_at, verify
from .keys import ChunkKey
from .tier import OK, Failure, TierResult, TierStore
from .metrics import Metric

if TYPE_CHECKING:  # the executor is handed the tiers; the factory builds them
    from .disk.tier import DiskTier
    from .mooncake import MooncakeTier

logger = logging.getLogger(__name__)

Report = Callable[[int, TierResult], None]
RouteHandler = Callable[[Sequence[Transfer]], None]
# routes whose consecutive commands go as one batch (one device transfer, one remote round trip)
_BATCHED = frozenset({DEVICE_TO_ARENA, ARENA_TO_DEVICE, REMOTE_TO_ARENA, ARENA_TO_REMOTE})
# persists that may pin more than 1/PINNED_SHARE of the arena's slots wait for no idle core: stores need the room
PINNED_SHARE = 8
_SEAL_STRIPES = 64  # locks over slots: two background threads never seal one slot at once, unrelated slots never wait


class DeviceMover(Protocol):
    """Moves chunk objects between the device's paged KV cache and arena slots (one batch per call). It may raise
    only before any copy started (then the batch fails and its slots are freed); afterwards it must report."""

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        """Store: device → objects[i]; Load: objects[i] → device. Calls `report(cmd_id, result)` once per command,
        now or later (an asynchronous copy reports when its event completes)."""
        ...


class StoreExecutor:
    """One per worker process (rank). `disk` is a `DiskTier`, `remote` a `MooncakeTier`; either may be None.
    `sealer` seals and verifies envelopes (digest only when None: no store secret). `yields`: persists, puts and
    remote drops run on threads that yield to compute (the factory passes the `yield_to_compute` key)."""

    def __init__(self, rank: int, arena: HostArena, mover: Optional[DeviceMover] = None,
                 disk: Optional[DiskTier] = None, remote: Optional[MooncakeTier] = None, io_threads: int = 4,
                 sealer: Optional[Sealer] = None, yields: bool = False) -> None:
        self.rank = rank
        self.arena = arena
        self.epoch: Optional[str] = None  # the node cache epoch `arena` maps (None: a private arena), see use_arena
        self.mover = mover
        self.disk = disk
        self.remote = remote
        self.sealer = sealer if sealer is not None else Sealer()
        self._sealed: dict[int, ChunkKey] = {}  # slot -> the key its trailer seals (its bytes unchanged since)
        # at least one: a node cache worker starts on an arena of no slot and maps the node's later
        self._seal_locks = [threading.Lock() for _ in range(max(1, min(_SEAL_STRIPES, arena.num_slots)))]
        self._disk_rejections = RejectionLog("disk")
        self._remote_rejections = RejectionLog("mooncake")
        # promotions and gets: a request waits for them
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"lmcache-store-r{rank}")
        # persists, puts, remote drops: nothing waits for them, so they wait for idle cores (a bounded while)
        self._background = BoundedYieldPool(io_threads, f"lmcache-background-r{rank}", yields=yields)
        self._lock = threading.Lock()
        self._done: deque[Completion] = deque()
        self._outstanding = 0
        self._pinning: set[int] = set()  # persists not answered yet: each pins its arena slot until written
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._submitting = 0
        self.timer: Optional[TransferTimer] = None  # times each batch for the scheduler's cost model (the worker sets it)
        # one handler per (source, destination); a batch is a run of consecutive commands of one batched route
        self._handlers: dict[Route, RouteHandler] = {
            DEVICE_TO_ARENA: self._run_device, ARENA_TO_DEVICE: self._run_device,
            REMOTE_TO_ARENA: lambda batch: self._io.submit(self._run_remote, batch, True),
            ARENA_TO_REMOTE: lambda batch: self._background.submit(self._run_remote, batch, False),
            DISK_TO_ARENA: self._promote_from_disk_async, ARENA_TO_DISK: self._write_to_disk_async,
        }
        if remote is not None:
            registered = [remote.register(address, nbytes) for address, nbytes in arena.registration_ranges()]
            if not arena.contiguous:  # segments the device runtime allocates later get their own registration
                arena.add_live_listener(remote.register)
            if not all(registered):
                logger.info("rank %d: the arena is not registered with the remote store; puts and gets copy", rank)

    def submit(self, commands: Sequence[Command]) -> None:
        """Runs (or starts) every command in order; consecutive device moves and remote moves go as one batch."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the store executor is closed")
            self._outstanding += len(commands)
            self._submitting += 1
        if self.timer is not None:
            self.timer.started(commands)
        try:
            self._submit(commands)
        finally:
            with self._idle:
                self._submitting -= 1
                self._idle.notify_all()

    def use_arena(self, arena: HostArena, epoch: Optional[str]) -> None:
        """Later commands run against `arena`, the mapping of node cache epoch `epoch` (commands in flight keep the
        old mapping alive through their slot views)."""
        self.arena = arena
        self.epoch = epoch

    def _submit(self, commands: Sequence[Command]) -> None:
        valid, stale = [], []
        for command in commands:
            slot = getattr(command, "slot", 0)
            if command.epoch != self.epoch:  # its slot is of another epoch's pages: another engine's chunk by now
                stale.append(command)
                self._report(command.cmd_id, TierResult.fail(
                    Failure.ERROR, f"issued for node cache epoch {command.epoch}, but this rank maps epoch "
                    f"{self.epoch}: never run against another epoch's pages"))
            elif 0 <= slot < self.arena.num_slots:
                valid.append(command)
            else:  # index and worker disagree on the arena (cpu_bytes or chunk size): refuse, never touch memory
                logger.error("rank %d: command %d names arena slot %d of %d", self.rank, command.cmd_id, slot,
                             self.arena.num_slots)
                self._report(command.cmd_id, TierResult.fail(
                    Failure.ERROR, f"arena slot {slot} out of range (the arena has {self.arena.num_slots}; index and "
                    f"workers disagree on cpu_bytes?)"))
        if stale:
            logger.warning("rank %d: %d command(s) of node cache epoch %s refused: this rank maps epoch %s (loads "
                           "recompute, stores are not made)", self.rank, len(stale), stale[0].epoch, self.epoch)
        commands = valid
        position = 0
        while position < len(commands):
            command = commands[position]
            route = None if isinstance(command, Drop) else command.route
            end = position + 1
            if route in _BATCHED:
                while end < len(commands) and not isinstance(commands[end], Drop) and commands[end].route == route:
                    end += 1
            batch = commands[position:end]
            for written in batch:
                if isinstance(written, (Store, Promote)):  # new bytes are coming: the old trailer seals nothing
                    self.forget_seal(written.slot)
            try:
                if isinstance(command, Drop):
                    self._drop(command)
                else:
                    self._handlers[command.route](batch)  # type: ignore[arg-type]
            except Exception as exc:  # nothing of this batch ran or answered: fail it, keep going with the rest
                logger.exception("rank %d: store commands %s refused", self.rank, [c.cmd_id for c in batch])
                for failed in batch:
                    self._report(failed.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))
            position = end

    def refuse(self, commands: Sequence[Command], reason: str) -> None:
        """Answers `commands` as failed without running them (their arena is gone: the node cache went away)."""
        with self._lock:
            self._outstanding += len(commands)
        for command in commands:
            self._report(command.cmd_id, TierResult.fail(Failure.ERROR, reason))

    def poll(self) -> list[Completion]:
        """Completions since the last call (to be sent to the scheduler's index)."""
        with self._lock:
            done = list(self._done)
            self._done.clear()
        return done

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Whether every submitted command completed within `timeout` (completions stay for `poll`)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def wait_for_any(self, cmd_ids: Collection[int], timeout: float) -> bool:
        """Whether one of `cmd_ids` completed (and waits for `poll`) within `timeout` seconds; returns at once when
        one already has. Completions stay for `poll`."""
        if not cmd_ids:
            return False
        with self._idle:
            return self._idle.wait_for(lambda: any(done.cmd_id in cmd_ids for done in self._done), timeout)

    def wait_for_all(self, cmd_ids: Collection[int], timeout: float) -> bool:
        """Whether every one of `cmd_ids` completed (and waits for `poll`) within `timeout` seconds; returns at once
        when they all have. Completions stay for `poll`."""
        wanted = frozenset(cmd_ids)
        if not wanted:
            return True
        with self._idle:
            return self._idle.wait_for(lambda: wanted <= {done.cmd_id for done in self._done}, timeout)

    def drain(self, timeout: Optional[float] = None) -> list[Completion]:
        """Waits until every submitted command completed, then polls. Raises TimeoutError naming what is left."""
        if not self.wait_idle(timeout):
            raise TimeoutError(f"rank {self.rank}: {self._outstanding} store commands still running "
                               f"after {timeout} s")
        return self.poll()

    def close(self) -> None:
        """Waits for background work, then closes the tiers (flushing the disk tier's write-behind queue)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._submitting == 0)  # a submit in progress finishes first
        self._io.shutdown(wait=True)
        self._background.shutdown(wait=True)
        for tier in (self.disk, self.remote):
            if isinstance(tier, TierStore):
                tier.close()

    # ---- running commands ---------------------------------------------------------------------------------------

    def _report(self, cmd_id: int, result: TierResult) -> None:
        if self.timer is not None:
            self.timer.finished(cmd_id, result.ok)
        with self._idle:
            self._pinning.discard(cmd_id)
            self._done.append(Completion(cmd_id, self.rank, result.ok, result.reason))
            self._outstanding -= 1
            self._idle.notify_all()

    # ---- envelopes ------------------------------------------------------------------------------------------------

    def forget_seal(self, slot: int) -> None:
        """New bytes are coming into `slot` (a store or promotion, here or in another process): its trailer no longer
        seals them, so the next spill or put of it seals again."""
        with self._seal_locks[slot % len(self._seal_locks)]:
            self._sealed.pop(slot, None)

    def seal_slot(self, slot: int, key: ChunkKey) -> None:
        """Seals `slot` for `key` unless its trailer already seals these bytes (a node cache handing its arena over:
        its successor adopts only sealed slots). The caller keeps the slot from being written meanwhile."""
        self._seal(slot, key)

    def unseal_slot(self, slot: int) -> None:
        """A device is about to write `slot` (the node cache hands a store out): its envelope is voided, so a
        restart that finds the slot mid-write never adopts its old chunk."""
        with self._seal_locks[slot % len(self._seal_locks)]:
            self._sealed.pop(slot, None)
            unseal_at(self.arena.slot_address(slot) + self.arena.object_bytes)

    def _seal(self, slot: int, key: ChunkKey) -> None:
        """Writes the slot's trailer for `key` unless it already seals these bytes for it."""
        with self._seal_locks[slot % len(self._seal_locks)]:
            if self._sealed.get(slot) == key:
                return
            seal(self.arena.sealed_view(slot), key, self.rank, self.sealer)
            self._sealed[slot] = key

    def _verified(self, key: ChunkKey) -> Callable[[memoryview], Optional[str]]:
        """The check a promotion of `key` runs on the bytes it read (the slot itself, or a bounce buffer first)."""
        return lambda view: verify(view, key, self.rank, self.sealer)

    def mark_sealed(self, slot: int, key: ChunkKey) -> None:
        """The slot's trailer verified for `key` (a promotion, a restart's check): a later persist or put need not
        seal it again."""
        with self._seal_locks[slot % len(self._seal_locks)]:
            self._sealed[slot] = key

    def _write_to_disk_async(self, batch: Sequence[Union[Spill, Persist]]) -> None:
        for command in batch:
            if isinstance(command, Spill):
                self._spill(command)
            else:  # pinned until every rank answers: writers read the slot in place, no copy
                with self._lock:
                    self._pinning.add(command.cmd_id)
                    # a yielding thread that took a persist may hold it (and its slot) while no core is idle
                    urgent = (len(self._pinning) + self._background.workers) * PINNED_SHARE > self.arena.num_slots
                submit = self._background.submit_urgent if urgent else self._background.submit
                submit(self._persist, command, urgent)

    def _promote_from_disk_async(self, batch: Sequence[Promote]) -> None:
        for command in batch:
            self._io.submit(self._guarded, command.cmd_id, self._promote_from_disk, command)

    def _spill(self, command: Spill) -> None:
        try:  # here, on the model's thread: the slot may be reused by the very next command
            self._seal(command.slot, command.key)
        except Exception as exc:  # a key the envelope cannot hold: this chunk is not spilled, the others are
            logger.exception("rank %d: sealing spill %d failed", self.rank, command.cmd_id)
            self._report(command.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))
            return
        self._write_to_disk(command, copy=True)

    def _guarded(self, cmd_id: int, work: Callable[..., TierResult], *args: object) -> None:
        """Background work always answers, even when a tier raises (a bug there must not hang the index)."""
        try:
            result = work(*args)
        except Exception as exc:  # the serving path turns any tier fault into a failed command
            logger.exception("rank %d: store command %d raised", self.rank, cmd_id)
            result = TierResult.fail(Failure.ERROR, str(exc))
        self._report(cmd_id, result)

    def _persist(self, command: Persist, urgent: bool) -> None:
        """On a background thread: seal, then queue the slot itself for the disk tier's writers (they answer).
        `urgent`: persists pin so much of the arena that stores may find no room; nothing waits for an idle core."""
        try:
            self._seal(command.slot, command.key)
            self._write_to_disk(command, copy=False, urgent=urgent)
        except Exception as exc:  # the command must still answer exactly once
            logger.exception("rank %d: persist %d raised", self.rank, command.cmd_id)
            self._report(command.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))

    def _write_to_disk(self, command: Union[Spill, Persist], copy: bool, urgent: bool = False) -> None:
        """Queues the slot for the disk tier's writer threads (the write, checksum and fsync never run here, on the
        model's thread); `done` answers the command, or the refusal does at once."""
        if self.disk is None:
            self._report(command.cmd_id, TierResult.fail(Failure.NO_DISK_TIER))
            return
        name = command.key.storage_name(self.rank)
        queued = self.disk.write_async(name, self.arena.sealed_view(command.slot),
                                       lambda result: self._report(command.cmd_id, result), copy=copy, urgent=urgent)
        if not queued.ok:
            self._report(command.cmd_id, queued)

    def _drop(self, command: Drop) -> None:
        name = command.key.storage_name(self.rank)
        if command.tier is Tier.DISK:
            if self.disk is not None:
                self.disk.delete(name)
            self._report(command.cmd_id, OK)
        elif self.remote is None:
            self._report(command.cmd_id, OK)
        else:
            self._background.submit(self._guarded, command.cmd_id, self._drop_remote, name)

    def _drop_remote(self, name: str) -> TierResult:
        self.remote.delete([name])
        return OK

    def _promote_from_disk(self, command: Promote) -> TierResult:
        if self.disk is None:
            return TierResult.fail(Failure.NO_DISK_TIER)
        name = command.key.storage_name(self.rank)
        view = self.arena.sealed_view(command.slot)
        result = self.disk.read_into(name, view)
        if not result.ok:
            return result
        why = verify(view, command.key, self.rank, self.sealer)
        if why is not None:
            self.disk.counters.add(Metric.REJECTED)
            self._disk_rejections.record(name, why)
            return TierResult.fail(Failure.REJECTED, why)
        self.mark_sealed(command.slot, command.key)
        return OK

    def _run_remote(self, batch: Sequence[Union[Promote, Put]], get: bool) -> None:
        """On an io thread, one batch of remote gets (promotions into the arena); on a background thread, one of puts."""
        try:
            if self.remote is None:
                results = [TierResult.fail(Failure.NO_REMOTE_TIER)] * len(batch)
            else:
                names = [c.key.storage_name(self.rank) for c in batch]
                views = [self.arena.sealed_view(c.slot) for c in batch]
                checks = [self._verified(c.key) for c in batch]
                if get:
                    results = list(self.remote.get_into(names, views, verify=checks))
                else:
                    for command in batch:  # here, on a background thread, never on the model's
                        self._seal(command.slot, command.key)
                    results = list(self.remote.put(names, views, verify=checks))
                if len(results) != len(batch):
                    raise RuntimeError(f"remote tier answered {len(results)} results for {len(batch)} chunks")
                if get:
                    for name, command, result in zip(names, batch, results):
                        if result.ok:
                            self.mark_sealed(command.slot, command.key)
                        elif result.kind is Failure.REJECTED:  # the tier counted it
                            self._remote_rejections.record(name, result.detail)
        except Exception as exc:  # the serving path turns any tier fault into failed commands
            logger.exception("rank %d: remote batch of %d raised", self.rank, len(batch))
            results = [TierResult.fail(Failure.ERROR, str(exc))] * len(batch)
        for command, result in zip(batch, results):
            self._report(command.cmd_id, result)

    def _run_device(self, batch: Sequence[Union[Store, Load]]) -> None:
        if self.mover is None:
            for command in batch:
                self._report(command.cmd_id, TierResult.fail(Failure.NO_DEVICE_MOVER))
            return
        objects = [self.arena.slot(c.slot) for c in batch]
        unanswered = {c.cmd_id for c in batch}

        def report_once(cmd_id: int, result: TierResult) -> None:
            with self._lock:
                if cmd_id not in unanswered:
                    return
                unanswered.discard(cmd_id)
            self._report(cmd_id, result)

        try:
            self.mover.run(batch, objects, report_once)
        except Exception as exc:  # a refused transfer fails its commands; the index frees their slots
            logger.exception("rank %d: device %s of %d chunks raised", self.rank,
                             "store" if isinstance(batch[0], Store) else "load", len(batch))
            for command in batch:
                report_once(command.cmd_id, TierResult.fail(Failure.DEVICE, str(exc)))
