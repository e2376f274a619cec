"""S3-FIFO (Yang et al., SOSP 2023) over the arena's ready chunks: three FIFO queues and a small use counter.

New chunks enter a `small` queue (a tenth of the slots); one found again (counter >= 1) by the time it reaches the
small queue's head moves to `main`, the rest leave and are remembered in `ghost`. A re-stored or promoted chunk the
ghost remembers enters `main` directly. `main` gives every chunk with uses left another lap (the counter, capped at 3,
drops by one per lap). One-off scans therefore pass through `small` only. Written from the paper; pinned chunks are
stepped over where they stand (they are in use, so they get no lap and lose no count).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator, Optional

from .base import Evictable, EvictionPolicy

MAX_USES = 3  # the paper's 2-bit counter


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO; `small_share` of the capacity is the probation queue."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_share < 1.0:
            raise ValueError(f"s3fifo small_share must be between 0 and 1 (exclusive), got {small_share!r}")
        self.small_target = max(1, int(capacity * small_share))
        self._small: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._uses: dict[Hashable, int] = {}

    def insert(self, key: Hashable) -> None:
        if key in self:
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._uses[key] = 0

    def touch(self, key: Hashable, reuse: bool) -> None:
        self._require_resident(key)
        if reuse:
            self._uses[key] = min(MAX_USES, self._uses[key] + 1)

    def remove(self, key: Hashable, evicted: bool) -> None:
        if key in self._small:
            del self._small[key]
            if evicted:
                self._ghost[key] = None
                while len(self._ghost) > self.capacity:
                    self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)
        self._uses.pop(key, None)

    def victim(self, evictable: Evictable) -> Optional[Hashable]:
        order = (self._from_small, self._from_main)
        if len(self._small) < self.small_target and self._main:
            order = (self._from_main, self._from_small)
        for take in order:
            key = take(evictable)
            if key is not None:
                return key
        return None

    def _from_small(self, evictable: Evictable) -> Optional[Hashable]:
        for key in list(self._small):
            if self._uses[key] >= 1:  # found again while on probation: it earns a place in main
                del self._small[key]
                self._main[key] = None
                self._uses[key] = 0
            elif evictable(key):
                return key
        return None

    def _from_main(self, evictable: Evictable) -> Optional[Hashable]:
        for _ in range(MAX_USES + 1):  # each lap takes one use from every unpinned chunk, so this many laps suffice
            for key in list(self._main):
                if not evictable(key):
                    continue
                if self._uses[key] == 0:
                    return key
                self._uses[key] -= 1
                self._main.move_to_end(key)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._uses

    def __len__(self) -> int:
        return len(self._uses)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._small) + list(self._main))
