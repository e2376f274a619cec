"""The disk catalogue: which chunks have a disk copy (being written or present), in least recently used order, and
which one gives way when the disk tier is full. The order is `policies.LruPolicy`, the arena's LRU; the index keeps
the copies' states and readers."""

from __future__ import annotations

from typing import Callable, Hashable, Optional

from ..policies import LruPolicy


class DiskCatalog:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # chunks; 0: no disk tier
        self._order: Optional[LruPolicy] = LruPolicy(capacity) if capacity else None

    def add(self, key: Hashable) -> None:
        assert self._order is not None, "the index has no disk tier"
        self._order.insert(key)

    def touch(self, key: Hashable) -> None:
        """A copy was read (promoted): it becomes the most recent."""
        if self._order is not None and key in self._order:
            self._order.touch(key, reuse=True)

    def discard(self, key: Hashable) -> None:
        if self._order is not None:
            self._order.remove(key, evicted=False)

    def full(self) -> bool:
        return len(self) >= self.capacity

    def victim(self, droppable: Callable[[Hashable], bool]) -> Optional[Hashable]:
        """The least recently used copy `droppable` accepts (copies being read are not); None when none is."""
        return self._order.victim(droppable) if self._order is not None else None

    def __contains__(self, key: object) -> bool:
        return self._order is not None and key in self._order

    def __len__(self) -> int:
        return len(self._order) if self._order is not None else 0
