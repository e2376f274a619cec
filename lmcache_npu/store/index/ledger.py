"""The command ledger: numbers the commands the manager issues, queues them for the workers, and collects every
rank's answer, so that a command's effect is applied once, when the last rank answered."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..commands import Command, Completion
from ..tier import TierCounters
from ..metrics import Metric

logger = logging.getLogger(__name__)


@dataclass
class PendingCommand:
    command: Command
    waiting: set[int]  # ranks that have not answered
    failures: list[str] = field(default_factory=list)


class CommandLedger:
    """Command ids start at `first_id` (1) and never repeat; unknown or repeated answers are counted and ignored."""

    def __init__(self, num_ranks: int, counters: TierCounters, first_id: int = 1) -> None:
        self.num_ranks = num_ranks
        self._counters = counters
        self._pending: dict[int, PendingCommand] = {}
        self._outbox: list[Command] = []
        self._next_id = first_id

    def new_id(self) -> int:
        cmd_id = self._next_id
        self._next_id += 1
        return cmd_id

    def emit(self, command: Command) -> Command:
        """Queues `command` for every rank and waits for each one's answer."""
        self._outbox.append(command)
        self._pending[command.cmd_id] = PendingCommand(command, set(range(self.num_ranks)))
        return command

    def take(self) -> list[Command]:
        commands, self._outbox = self._outbox, []
        return commands

    def queued(self) -> tuple[Command, ...]:
        return tuple(self._outbox)

    def answer(self, completions: Iterable[Completion]) -> Iterator[tuple[Command, list[str]]]:
        """Records answers; yields (command, failures) as each command's last rank answers, in answer order (lazily:
        the caller applies one command's effect before the next answer is read)."""
        for done in completions:
            pending = self._pending.get(done.cmd_id)
            if pending is None or done.rank not in pending.waiting:
                self._counters.add(Metric.UNEXPECTED_COMPLETIONS)
                logger.warning("ignoring completion of unknown command %d from rank %d", done.cmd_id, done.rank)
                continue
            pending.waiting.discard(done.rank)
            if not done.ok:
                pending.failures.append(f"rank {done.rank}: {done.reason}")
            if not pending.waiting:
                del self._pending[done.cmd_id]
                yield pending.command, pending.failures

    def waiting_ranks(self, cmd_id: int) -> frozenset[int]:
        """The ranks that have not answered command `cmd_id` (none when it is not pending)."""
        pending = self._pending.get(cmd_id)
        return frozenset(pending.waiting) if pending is not None else frozenset()

    def is_pending(self, cmd_id: int) -> bool:
        return cmd_id in self._pending

    @property
    def next_id(self) -> int:
        """The id the next command gets: every id issued so far is below it."""
        return self._next_id

    def pending_commands(self) -> tuple[Command, ...]:
        """Commands some rank has not answered, oldest first."""
        return tuple(pending.command for pending in self._pending.values())

    def pending_ids(self) -> tuple[int, ...]:
        """Commands some rank has not answered, oldest first."""
        return tuple(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._pending)
