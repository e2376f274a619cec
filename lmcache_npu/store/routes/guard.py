"""The one envelope guard of a rank (`envelope.py`): a slot's bytes leave for disk or Mooncake only sealed (object +
trailer for this key and rank), a promotion answers ok only once its bytes verify, and a slot is sealed once per
content: the guard remembers which key each slot's trailer seals and forgets it when new bytes come into the slot."""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from ..commands import Promote, Store, WorkerCommand, arena_end
from ..envelope import Sealer, seal, unseal_at, verify
from ..keys import ChunkKey
from .context import RouteContext

_SEAL_STRIPES = 64  # locks over slots: two background threads never seal one slot at once, unrelated slots never wait


class EnvelopeGuard:
    """Seals, verifies and remembers for one rank's arena (`context.arena`, which `use_arena` may swap). `sealer`
    keys the envelopes (digest only when None: no store secret)."""

    def __init__(self, context: RouteContext, sealer: Optional[Sealer] = None) -> None:
        self.context = context
        self.sealer = sealer if sealer is not None else Sealer()
        self._sealed: dict[int, ChunkKey] = {}  # slot -> the key its trailer seals (its bytes unchanged since)
        # at least one: a node cache worker starts on an arena of no slot and maps the node's later
        self._locks = [threading.Lock() for _ in range(max(1, min(_SEAL_STRIPES, context.arena.num_slots)))]

    def _lock(self, slot: int) -> threading.Lock:
        return self._locks[slot % len(self._locks)]

    def seal(self, slot: int, key: ChunkKey) -> None:
        """Writes the slot's trailer for `key` unless it already seals these bytes for it. The caller keeps the slot
        from being written meanwhile."""
        with self._lock(slot):
            if self._sealed.get(slot) == key:
                return
            seal(self.context.arena.sealed_view(slot), key, self.context.rank, self.sealer)
            self._sealed[slot] = key

    def verify(self, view: memoryview, key: ChunkKey) -> Optional[str]:
        """Why the sealed bytes `view` are not `key`'s of this rank (None: they are)."""
        return verify(view, key, self.context.rank, self.sealer)

    def verifier(self, key: ChunkKey) -> Callable[[memoryview], Optional[str]]:
        """The check a promotion of `key` runs on the bytes it read (the slot itself, or a bounce buffer first)."""
        return lambda view: self.verify(view, key)

    def remember(self, slot: int, key: ChunkKey) -> None:
        """The slot's trailer verified for `key` (a promotion, a restart's check): no later persist or put seals it."""
        with self._lock(slot):
            self._sealed[slot] = key

    def forget(self, slot: int) -> None:
        """New bytes are coming into `slot` (a store or promotion, here or in another process): its trailer no longer
        seals them, so the next spill or put of it seals again."""
        with self._lock(slot):
            self._sealed.pop(slot, None)

    def forget_written(self, batch: Sequence[WorkerCommand]) -> None:
        """Forgets the slots that `batch`'s stores (bare or as device moves) and promotions are about to write."""
        for command in map(arena_end, batch):
            if isinstance(command, (Store, Promote)):  # new bytes are coming: the old trailer seals nothing
                self.forget(command.slot)

    def unseal(self, slot: int) -> None:
        """A device is about to write `slot`: its envelope is voided, so a restart that finds the slot mid-write never
        adopts its old chunk."""
        with self._lock(slot):
            self._sealed.pop(slot, None)
            unseal_at(self.context.arena.slot_address(slot) + self.context.arena.object_bytes)
