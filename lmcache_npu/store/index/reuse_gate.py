"""The reuse gate, per slow tier (`remote_admit_hits`, `disk_admit_hits`; N >= 1): a chunk reaches the tier only once
lookups of N later requests asked for it, counted per key in a bounded table that outlives the chunk's slot (0 lets
every chunk in). It also tells the index which lookups are a request's first ask, so that a request polling while
its chunks are promoted counts once for the eviction policy too."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ..commands import Tier
from ..keys import ChunkKey

# the table remembers this many keys per arena slot and disk chunk (at least SEEN_MIN): enough to see a chunk come
# back after it left the arena and the disk
SEEN_PER_SLOT = 2
SEEN_MIN = 1024


class ReuseGate:
    def __init__(self, tracked_chunks: int, remote_admit_hits: int, disk_admit_hits: int) -> None:
        self._hits = {Tier.REMOTE: remote_admit_hits, Tier.DISK: disk_admit_hits}
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> requests that looked it up, oldest first
        self.capacity = max(SEEN_MIN, SEEN_PER_SLOT * tracked_chunks)
        self._counted: dict[str, set[ChunkKey]] = {}  # per request: keys its lookups already counted

    def count(self, request_id: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Counts this request once per key; True where this lookup is the request's first ask."""
        counted = self._counted.setdefault(request_id, set())
        first = []
        for key in keys:
            new = key not in counted
            first.append(new)
            if new:
                counted.add(key)
                self._seen[key] = self._seen.pop(key, 0) + 1  # re-inserted: the table forgets the longest unasked
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return first

    def forget(self, request_id: str) -> None:
        self._counted.pop(request_id, None)

    def reuses(self, key: ChunkKey) -> int:
        """How many requests after the first looked `key` up, as far as the bounded table remembers."""
        return max(0, self._seen.get(key, 0) - 1)

    def gates(self, tier: Tier) -> bool:
        """Whether `tier` admits only reused chunks."""
        return self._hits[tier] > 0

    def admits(self, key: ChunkKey, tier: Tier) -> bool:
        return self._hits[tier] == 0 or self.reuses(key) >= self._hits[tier]

    def __len__(self) -> int:
        return len(self._seen)
