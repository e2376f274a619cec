"""What the remote store holds, as the index sees it: batch existence, and a negative cache so that a chunk whose
promotion failed on some rank is a miss for a while (the store may list an object not every rank can read, and a
lookup must not promote it again every step).

The node cache asks before it takes its lock (`prefetch`, an RPC of up to a second): the next `present` of that
thread answers the keys it asked about from those answers and asks only for the others."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from ..keys import ChunkKey
from ..tier import TierCounters
from .contract import RemoteExists
from ..metrics import Metric

logger = logging.getLogger(__name__)

# A chunk whose promotion from the remote store failed on some rank is a miss for this long, then tried again.
REMOTE_MISS_AFTER_FAILURE_S = 60.0
PREFETCH_TTL_S = 1.0  # a prefetched answer no call took by then is dropped (it was asked for the verb at hand)


class RemotePresence:
    def __init__(self, exists: Optional[RemoteExists], counters: TierCounters) -> None:
        self._exists = exists
        self._counters = counters
        self._failed: dict[ChunkKey, float] = {}  # key -> until when it is a miss
        self._asked = threading.local()  # .answers: this thread's (when, {key: present}) prefetched, or None

    @property
    def configured(self) -> bool:
        return self._exists is not None

    def prefetch(self, keys: Sequence[ChunkKey]) -> None:
        """Asks about `keys` now; the next `present` of this thread takes its answers for them from here."""
        if not keys or self._exists is None:
            self._asked.answers = None
            return
        self._asked.answers = (time.monotonic(), dict(zip(keys, self._ask(keys))))

    def prefetch_from_first(self, keys: Sequence[ChunkKey], held: Callable[[ChunkKey], bool]) -> None:
        """`prefetch` of the keys from the first one no local tier holds (`held`) on: what a lookup asks."""
        if self._exists is None:
            return
        position = next((position for position, key in enumerate(keys) if not held(key)), len(keys))
        self.prefetch(keys[position:])

    def _ask(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """The store's answer for each key; a failing store answers misses (it must never break a lookup)."""
        assert self._exists is not None
        try:
            present = list(self._exists(keys))
        except Exception as exc:
            self._counters.add(Metric.REMOTE_LOOKUP_ERRORS)
            logger.warning("remote existence check failed, treating as misses: %s", exc)
            return [False] * len(keys)
        return present + [False] * (len(keys) - len(present))

    def present(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch existence (what this thread prefetched, the store for the rest)."""
        if self._exists is None:
            return [False] * len(keys)
        asked, self._asked.answers = getattr(self._asked, "answers", None), None
        if asked is None or time.monotonic() - asked[0] > PREFETCH_TTL_S:
            present = self._ask(keys)
        else:
            answers = asked[1]
            unknown = [key for key in keys if key not in answers]
            if unknown:  # a chunk evicted since the prefetch: asked now, under the caller's lock
                answers.update(zip(unknown, self._ask(unknown)))
            present = [answers[key] for key in keys]
        if self._failed:
            now = time.monotonic()
            for key, until in list(self._failed.items()):
                if until <= now:
                    del self._failed[key]
            present = [there and key not in self._failed for key, there in zip(keys, present)]
        return present

    def peek(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`present`, its answers left for this thread's next `present` (a locate before a lookup asks once)."""
        present = self.present(keys)
        if self._exists is not None:
            self._asked.answers = (time.monotonic(), dict(zip(keys, present)))
        return present

    def promotion_failed(self, key: ChunkKey) -> None:
        self._failed[key] = time.monotonic() + REMOTE_MISS_AFTER_FAILURE_S
