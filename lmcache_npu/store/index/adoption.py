"""What a restart finds, taken into the index: chunk files every rank has on disk, and arena slots whose sealed
envelopes verified on every rank (a warm restart of the node cache kept the arena's memory, `node/rebuild.py`).

A mixin of `ChunkIndex`: the tables it changes are the index's own, and a chunk it adopts is exactly what a completed
store would have made (a ready slot in the eviction policy, its tier listener told).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable

from ..commands import Drop, Tier
from ..keys import ChunkKey
from .contract import DiskState, SlotState
from .entry import Entry


class RestartAdoption:
    """Restart verbs of `ChunkIndex` (every method runs on the index, `self` is one: its tables, `_occupy`,
    `_finish_write`, `_make_disk_room`, `_emit` and `_tell` are the index's)."""

    def adopt_disk(self, keys: Iterable[ChunkKey]) -> int:
        """Restart: chunks whose files every rank has on disk, oldest first. Returns how many were adopted
        (beyond `disk_chunks` the oldest are dropped)."""
        adopted = 0
        for key in keys:
            if self.disk_chunks == 0:
                break
            entry = self._entries.setdefault(key, Entry(key))
            if entry.disk is DiskState.NONE:
                self._make_disk_room()
                entry.disk = DiskState.PRESENT
                self._disk.add(key)
                self._tell(key, Tier.DISK, True)
                adopted += 1
        return adopted

    def drop_disk_copies(self, keys: Iterable[ChunkKey]) -> None:
        """Restart: chunks only some ranks have on disk cannot be loaded; every rank deletes its file of them."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.disk is DiskState.NONE:
                self._emit(Drop(self._ledger.new_id(), key, Tier.DISK))

    def hold_slots(self, slots: Iterable[int]) -> list[int]:
        """Sets the free ones of `slots` aside (never handed out) until `adopt_slot` or `free_held` settles each: a
        warm restart checks what they hold first. Which were held."""
        return self._slots.hold(slots)

    def adopt_slot(self, slot: int, key: ChunkKey) -> bool:
        """A held slot whose bytes verified as `key`'s on every rank becomes that chunk's ready copy; False (the slot
        is freed) when the chunk has a slot already (stored again while the restart was checking)."""
        self._slots.unhold(slot)
        entry = self._entries.get(key)
        if entry is not None and entry.slot is not None:
            self._slots.give_back(slot)
            return False
        entry = self._entries.setdefault(key, Entry(key))
        self._occupy(entry, slot)
        self._finish_write(entry, slot, True)
        return True

    def free_held(self, slots: Iterable[int], rest: bool = False) -> None:
        """Held slots that hold no chunk (their envelope did not verify) become free; with `rest` they rest in
        quarantine first (a write may still land in them)."""
        with self._slots.quarantining() if rest else nullcontext():
            for slot in slots:
                self._slots.unhold(slot)
                self._slots.give_back(slot)

    @property
    def held_slots(self) -> int:
        """Slots set aside while a restart checks them."""
        return self._slots.held_back

    def pin_for_sealing(self, key: ChunkKey, slot: int) -> bool:
        """Keeps `key`'s ready copy in `slot` from eviction and reuse while its envelope is written off the lock;
        False when it is not there, or not ready, any more."""
        entry = self._entries.get(key)
        if entry is None or entry.slot != slot or entry.slot_state is not SlotState.READY:
            return False
        entry.sealing += 1
        return True

    def unpin_sealed(self, key: ChunkKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.sealing:
            entry.sealing -= 1
            self._forget_if_empty(entry)

    def ready_chunks(self) -> list[tuple[int, ChunkKey]]:
        """(slot, key) of every chunk ready in the arena, pinned or not (what a hand-over seals)."""
        return [(entry.slot, key) for key, entry in self._entries.items()
                if entry.slot is not None and entry.slot_state is SlotState.READY]

    def pending_slots(self) -> set[int]:
        """The slots of commands some rank has not answered (a write may still land in them, or a read be running)."""
        slots = (getattr(command, "slot", None) for command in self._ledger.pending_commands())
        return {slot for slot in slots if slot is not None}

    @property
    def next_command_id(self) -> int:
        """Every command id this index issued is below this (a successor's ids start at or past it)."""
        return self._ledger.next_id
