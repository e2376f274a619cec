"""The arena's slot table: which key owns each slot, which slots are free, which are withheld (their segment left
the usable set, `limit_slots`), which are in quarantine (a dead engine's worker was writing them: a late DMA may still
land, so they are reused only after QUARANTINE_S), which are held (a restart is checking what they hold: `hold`),
and the eviction policy that orders the ready ones. It knows
nothing of pins or tiers: the index decides what may be evicted and what happens to an evicted chunk."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Hashable, Iterable, Iterator, Optional, Sequence, Union

from ..policies import EvictionPolicy

QUARANTINE_S = 1.0  # a slot given back while abandoning (`quarantining`) is reused no sooner


class SlotTable:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.num_slots = num_slots
        self.policy = policy  # the ready slots' keys, in eviction order
        self._owner: list[Optional[Hashable]] = [None] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # lowest slot handed out first
        self._usable = bytearray(b"\x01") * num_slots  # slots of live arena segments on every rank
        self._withheld: set[int] = set()  # free slots outside the usable set: never handed out
        self._quarantine: deque[tuple[float, int]] = deque()  # (free again at, slot), oldest first
        self._quarantining = False
        self._held: set[int] = set()  # free slots set aside until a restart's check of their bytes settles them

    @contextmanager
    def quarantining(self) -> Iterator[None]:
        """Slots given back inside go to quarantine (their writer may be a killed process's device)."""
        self._quarantining = True
        try:
            yield
        finally:
            self._quarantining = False

    def pop_free(self) -> Optional[int]:
        self._end_due_quarantine()
        return self._free.pop() if self._free else None

    def _end_due_quarantine(self) -> None:
        if self._quarantine and self._quarantine[0][0] <= time.monotonic():
            self._end_quarantine()

    def _end_quarantine(self) -> None:
        now, released = time.monotonic(), False
        while self._quarantine and self._quarantine[0][0] <= now:
            slot = self._quarantine.popleft()[1]
            if self._usable[slot]:
                self._free.append(slot)
                released = True
            else:
                self._withheld.add(slot)
        if released:  # lowest slot first, as at start
            self._free.sort(reverse=True)

    def hold(self, slots: Iterable[int]) -> list[int]:
        """Takes the free ones of `slots` out of the free list until `unhold` settles each (the caller then occupies
        it or gives it back); which were held."""
        wanted = set(slots).difference(self._held)
        kept = [slot for slot in self._free if slot not in wanted]
        taken = wanted.intersection(self._free)
        self._free = kept
        self._held |= taken
        return sorted(taken)

    def unhold(self, slot: int) -> None:
        if slot not in self._held:
            raise ValueError(f"slot {slot} is not held (hold() it before a restart settles it)")
        self._held.discard(slot)

    @property
    def held_back(self) -> int:
        """Slots held while a restart checks them."""
        return len(self._held)

    def occupy(self, slot: int, key: Hashable) -> None:
        self._owner[slot] = key

    def vacate(self, slot: int) -> None:
        """`slot` has no owner any more; the caller reuses it, or frees it with `give_back`."""
        self._owner[slot] = None

    def give_back(self, slot: int) -> None:
        """A vacated slot becomes free, or withheld when its segment is not usable (or quarantined first)."""
        if self._quarantining:
            self._quarantine.append((time.monotonic() + QUARANTINE_S, slot))
        elif self._usable[slot]:
            self._free.append(slot)
        else:
            self._withheld.add(slot)

    def is_usable(self, slot: int) -> bool:
        return bool(self._usable[slot])

    def withhold(self, slot: int) -> None:
        self._withheld.add(slot)

    def limit(self, usable: Union[int, Sequence[tuple[int, int]]]) -> None:
        """Hands out only slots in `usable` ([first, end) ranges, or an int n for the first n). Free slots leaving
        the set are withheld; withheld slots entering it become free at once."""
        ranges = [(0, usable)] if isinstance(usable, int) else list(usable)
        mask = bytearray(self.num_slots)
        for begin, end in ranges:
            if not 0 <= begin <= end <= self.num_slots:
                raise ValueError(f"usable slot range [{begin}, {end}) is outside the index's {self.num_slots} slots")
            mask[begin:end] = b"\x01" * (end - begin)
        self._usable = mask
        back = [slot for slot in self._withheld if mask[slot]]
        self._withheld.difference_update(back)
        leaving = [slot for slot in self._free if not mask[slot]]
        self._withheld.update(leaving)
        if back or leaving:  # lowest slot first, as at start
            self._free = sorted([slot for slot in self._free if mask[slot]] + back, reverse=True)

    @property
    def usable_count(self) -> int:
        return self._usable.count(1)  # C speed: the scheduler reports this every step

    @property
    def free_count(self) -> int:
        self._end_due_quarantine()  # a rested slot counts as free as soon as it may be handed out
        return len(self._free)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    @property
    def held(self) -> int:
        """Slots owned by a chunk (being written, ready or read), in quarantine, or held by a restart's check."""
        return self.num_slots - len(self._free) - len(self._withheld)

    def check_invariants(self, owners: dict[int, Hashable]) -> None:
        """Raises AssertionError unless `owners` (slot -> key, from the index's entries) matches this table."""
        for slot, key in owners.items():
            assert self._owner[slot] == key, f"slot {slot} is owned by {self._owner[slot]!r}, the index says {key!r}"
        quarantined = {slot for _, slot in self._quarantine}
        assert (len(owners) + len(self._free) + len(self._withheld) + len(self._quarantine) + len(self._held)
                == self.num_slots)
        assert set(self._free).isdisjoint(owners) and self._withheld.isdisjoint(owners)
        assert self._held.isdisjoint(owners) and self._held.isdisjoint(self._free) and self._held.isdisjoint(quarantined)
        assert quarantined.isdisjoint(owners) and quarantined.isdisjoint(self._free)
        assert all(self._usable[slot] for slot in self._free)
        assert not any(self._usable[slot] for slot in self._withheld)
