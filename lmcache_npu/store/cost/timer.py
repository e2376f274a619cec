"""The worker's stopwatch on its executor's commands: each batch of one path, from submit to its last answer, or,
where the mover measured the move itself (the device window of a load or a store), that: the wait behind the
model's work queued on the device is the step the cut already counts, not the transfer's.

The executor calls `started` with every submitted list and `finished` with every answer; the worker sends `take()`
to the scheduler in its per-step metadata. Both calls come from the model's thread and the io threads alike.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..commands import Command, Drop
from .samples import Path, TransferSample

_KEPT = 4096  # samples kept when nobody takes them (a bench without a scheduler): the newest win


@dataclass
class _Batch:
    path: Path
    started: float
    queued_bytes: int
    pending: set[int] = field(default_factory=set)
    chunks: int = 0
    ok: bool = True
    abandoned: bool = False  # a command of it was answered past its deadline: the batch is never timed
    moved_s: Optional[float] = None  # the mover's own measure of the move, while every answer carried one
    untimed: bool = False  # an answer carried none: the batch counts from submit to its last answer


class TransferTimer:
    """`object_bytes`: one chunk object of this rank (every command moves one)."""

    def __init__(self, object_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.object_bytes = int(object_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._batch_of: dict[int, _Batch] = {}
        self._in_flight: Counter[Path] = Counter()  # bytes per path submitted and not answered
        self._samples: deque[TransferSample] = deque(maxlen=_KEPT)

    def started(self, commands: Sequence[Command]) -> None:
        now = self._clock()
        with self._lock:
            batches: dict[Path, _Batch] = {}
            for command in commands:
                if isinstance(command, Drop):
                    continue
                path = Path.of(command.route)
                if path is None:
                    continue
                batch = batches.get(path)
                if batch is None:
                    batch = batches[path] = _Batch(path, now, self._in_flight[path])
                batch.pending.add(command.cmd_id)
                batch.chunks += 1
                self._batch_of[command.cmd_id] = batch
            for path, batch in batches.items():
                self._in_flight[path] += batch.chunks * self.object_bytes

    def finished(self, cmd_id: int, ok: bool, moved_s: Optional[float] = None) -> None:
        """Command `cmd_id` answered; `moved_s`: the move's own seconds where the mover measured them (one batch's
        commands all carry that batch's)."""
        now = self._clock()
        with self._lock:
            batch = self._batch_of.pop(cmd_id, None)
            if batch is None:  # refused before it started, or not a transfer
                return
            batch.pending.discard(cmd_id)
            batch.ok &= ok
            if moved_s is None:
                batch.untimed = True
            else:
                batch.moved_s = max(batch.moved_s or 0.0, moved_s)
            self._in_flight[batch.path] -= self.object_bytes
            if not batch.pending and not batch.abandoned:
                timed = batch.moved_s is not None and not batch.untimed  # the move alone: it queued behind nothing
                self._samples.append(TransferSample(
                    batch.path, batch.chunks, batch.chunks * self.object_bytes, 0 if timed else batch.queued_bytes,
                    batch.moved_s if timed else now - batch.started, batch.ok))

    def abandon(self, cmd_ids: Sequence[int]) -> None:
        """Commands the worker answered as failed past their deadline: no longer in flight (a queue that never
        drains would make every later transfer on the path look slow), and their batches are never timed."""
        with self._lock:
            for cmd_id in cmd_ids:
                batch = self._batch_of.pop(cmd_id, None)
                if batch is None:
                    continue
                batch.pending.discard(cmd_id)
                batch.abandoned = True
                self._in_flight[batch.path] -= self.object_bytes

    def take(self) -> list[TransferSample]:
        with self._lock:
            taken = list(self._samples)
            self._samples.clear()
            return taken
