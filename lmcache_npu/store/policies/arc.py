"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003) over the arena's ready chunks.

Two resident lists: `recent` (seen once since it entered) and `frequent` (hit again at least once), each with a
ghost list of keys it recently evicted. A re-stored or promoted chunk found in a ghost list enters `frequent` and
moves the target size of `recent` towards the list that would have kept it. A burst of one-off chunks therefore
cycles through `recent` while the shared prefixes sit in `frequent`. Written from the paper, adapted to the index:
the victim is chosen before the incoming chunk is known, so the target adapts when that chunk becomes ready.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator, Optional

from .base import Evictable, EvictionPolicy


class ArcPolicy(EvictionPolicy):
    """ARC; `target_recent` (the paper's p) is how many slots the once-seen list should hold."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._recent: OrderedDict[Hashable, None] = OrderedDict()  # T1, oldest first
        self._frequent: OrderedDict[Hashable, None] = OrderedDict()  # T2
        self._recent_ghosts: OrderedDict[Hashable, None] = OrderedDict()  # B1
        self._frequent_ghosts: OrderedDict[Hashable, None] = OrderedDict()  # B2
        self.target_recent = 0.0

    def insert(self, key: Hashable) -> None:
        if key in self:
            self.touch(key, reuse=False)
            return
        if key in self._recent_ghosts:  # evicted too early from recent: recent should be larger
            step = max(1.0, len(self._frequent_ghosts) / len(self._recent_ghosts))
            self.target_recent = min(float(self.capacity), self.target_recent + step)
            del self._recent_ghosts[key]
            self._frequent[key] = None
        elif key in self._frequent_ghosts:  # evicted too early from frequent: frequent should be larger
            step = max(1.0, len(self._recent_ghosts) / len(self._frequent_ghosts))
            self.target_recent = max(0.0, self.target_recent - step)
            del self._frequent_ghosts[key]
            self._frequent[key] = None
        else:
            self._recent[key] = None
        self._trim_ghosts()

    def touch(self, key: Hashable, reuse: bool) -> None:
        self._require_resident(key)
        if key in self._recent:
            if reuse:
                del self._recent[key]
                self._frequent[key] = None
            else:
                self._recent.move_to_end(key)
        else:
            self._frequent.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool) -> None:
        if key in self._recent:
            del self._recent[key]
            if evicted:
                self._recent_ghosts[key] = None
        elif key in self._frequent:
            del self._frequent[key]
            if evicted:
                self._frequent_ghosts[key] = None
        self._trim_ghosts()

    def victim(self, evictable: Evictable) -> Optional[Hashable]:
        first, second = self._recent, self._frequent
        if not (self._recent and len(self._recent) > self.target_recent) and self._frequent:
            first, second = second, first
        for queue in (first, second):
            for key in queue:
                if evictable(key):
                    return key
        return None

    def _trim_ghosts(self) -> None:
        """The paper's bounds: recent plus its ghosts within capacity, everything within twice capacity."""
        while self._recent_ghosts and len(self._recent) + len(self._recent_ghosts) > self.capacity:
            self._recent_ghosts.popitem(last=False)
        while len(self) + len(self._recent_ghosts) + len(self._frequent_ghosts) > 2 * self.capacity:
            ghosts = self._frequent_ghosts or self._recent_ghosts
            if not ghosts:
                break
            ghosts.popitem(last=False)

    @property
    def ghosts(self) -> int:
        return len(self._recent_ghosts) + len(self._frequent_ghosts)

    def __contains__(self, key: object) -> bool:
        return key in self._recent or key in self._frequent

    def __len__(self) -> int:
        return len(self._recent) + len(self._frequent)

    def __iter__(self) -> Iterator[Hashable]:
        first, second = list(self._recent), list(self._frequent)
        if not (self._recent and len(self._recent) > self.target_recent) and self._frequent:
            first, second = second, first
        return iter(first + second)
