"""Least recently used: the arena's eviction order before policies existed, kept bit for bit."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator, Optional

from .base import Evictable, EvictionPolicy


class LruPolicy(EvictionPolicy):
    """Every use (a hit or the load after it) makes a chunk the most recent; the oldest unpinned one goes first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable, reuse: bool) -> None:
        self._require_resident(key)
        self._order.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Evictable) -> Optional[Hashable]:
        return next((key for key in self._order if evictable(key)), None)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._order))
