"""The arena <-> disk routes. Spills seal and queue a copy of the slot before the next command (the slot may be
evicted and reused in the same step); persists queue the slot itself (the index pins it until every rank completes)
from a background thread that seals first; promotions read on an io thread and answer ok only once the bytes verify.
The write, checksum and fsync run on the disk tier's writer threads, never on the model's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence, Union

from ..commands import ARENA_TO_DISK, DISK_TO_ARENA, Persist, Promote, Spill
from ..envelope import RejectionLog
from ..metrics import Metric
from ..tier import OK, Failure, TierResult, TierStore
from .context import RouteContext
from .guard import EnvelopeGuard

if TYPE_CHECKING:  # handed in by the factory; this module never builds a tier
    from ..disk.tier import DiskTier

logger = logging.getLogger(__name__)

# persists that may pin more than 1/PINNED_SHARE of the arena's slots wait for no idle core: stores need the room
PINNED_SHARE = 8


class DiskRoute:
    """Spills, persists and disk promotions of one rank; `tier` is the `DiskTier` (None: each answers "no disk
    tier"). Closing it flushes the tier's write-behind queue."""

    routes = frozenset({ARENA_TO_DISK, DISK_TO_ARENA})
    batched = False  # each command is queued on its own
    deletes_inline = True  # a file's unlink is cheap: a drop runs on the model's thread

    def __init__(self, context: RouteContext, guard: EnvelopeGuard, disk: Optional[DiskTier]) -> None:
        self.context = context
        self.guard = guard
        self.tier = disk
        self.pinning: set[int] = set()  # persists not answered yet: each pins its arena slot until written
        self.rejections = RejectionLog("disk")

    def submit(self, batch: Sequence[Union[Spill, Persist, Promote]]) -> None:
        context = self.context
        for command in batch:
            if isinstance(command, Promote):
                context.io.submit(context.guarded, command.cmd_id, self._promote, command)
            elif isinstance(command, Spill):
                self._spill(command)
            else:  # pinned until every rank answers: writers read the slot in place, no copy
                with context.lock:
                    self.pinning.add(command.cmd_id)
                    # a yielding thread that took a persist may hold it (and its slot) while no core is idle
                    pinned = len(self.pinning) + context.background.workers
                    urgent = pinned * PINNED_SHARE > context.arena.num_slots
                submit = context.background.submit_urgent if urgent else context.background.submit
                submit(self._persist, command, urgent)

    def delete(self, name: str) -> TierResult:
        """Deletes this rank's file `name` (nothing to delete without a tier)."""
        if self.tier is not None:
            self.tier.delete(name)
        return OK

    def close(self) -> None:
        if isinstance(self.tier, TierStore):  # a fake without counters and close is the test's to close
            self.tier.close()

    def _answer(self, cmd_id: int, result: TierResult) -> None:
        with self.context.lock:
            self.pinning.discard(cmd_id)
        self.context.report(cmd_id, result)

    def _spill(self, command: Spill) -> None:
        try:  # here, on the model's thread: the slot may be reused by the very next command
            self.guard.seal(command.slot, command.key)
        except Exception as exc:  # a key the envelope cannot hold: this chunk is not spilled, the others are
            logger.exception("rank %d: sealing spill %d failed", self.context.rank, command.cmd_id)
            self._answer(command.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))
            return
        self._write(command, copy=True)

    def _persist(self, command: Persist, urgent: bool) -> None:
        """On a background thread: seal, then queue the slot itself for the disk tier's writers (they answer).
        `urgent`: persists pin so much of the arena that stores may find no room; nothing waits for an idle core."""
        try:
            self.guard.seal(command.slot, command.key)
            self._write(command, copy=False, urgent=urgent)
        except Exception as exc:  # the command must still answer exactly once
            logger.exception("rank %d: persist %d raised", self.context.rank, command.cmd_id)
            self._answer(command.cmd_id, TierResult.fail(Failure.ERROR, str(exc)))

    def _write(self, command: Union[Spill, Persist], copy: bool, urgent: bool = False) -> None:
        """Queues the slot for the tier's writer threads; their callback answers, or the refusal does at once."""
        if self.tier is None:
            self._answer(command.cmd_id, TierResult.fail(Failure.NO_DISK_TIER))
            return
        name = command.key.storage_name(self.context.rank)
        queued = self.tier.write_async(name, self.context.arena.sealed_view(command.slot),
                                       lambda result: self._answer(command.cmd_id, result), copy=copy, urgent=urgent)
        if not queued.ok:
            self._answer(command.cmd_id, queued)

    def _promote(self, command: Promote) -> TierResult:
        """On an io thread: read the file into the slot, then verify its envelope (a failure frees the slot)."""
        if self.tier is None:
            return TierResult.fail(Failure.NO_DISK_TIER)
        name = command.key.storage_name(self.context.rank)
        view = self.context.arena.sealed_view(command.slot)
        result = self.tier.read_into(name, view)
        if not result.ok:
            return result
        why = self.guard.verify(view, command.key)
        if why is not None:
            self.tier.counters.add(Metric.REJECTED)
            self.rejections.record(name, why)
            return TierResult.fail(Failure.REJECTED, why)
        self.guard.remember(command.slot, command.key)
        return OK
