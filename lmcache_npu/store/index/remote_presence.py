"""What the remote store holds, as the index sees it: batch existence, and a negative cache so that a chunk whose
promotion failed on some rank is a miss for a while (the store may list an object not every rank can read, and a
lookup must not promote it again every step)."""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

from ..keys import ChunkKey
from ..tier import TierCounters
from .contract import RemoteExists
from ..metrics import Metric

logger = logging.getLogger(__name__)

# A chunk whose promotion from the remote store failed on some rank is a miss for this long, then tried again.
REMOTE_MISS_AFTER_FAILURE_S = 60.0


class RemotePresence:
    def __init__(self, exists: Optional[RemoteExists], counters: TierCounters) -> None:
        self._exists = exists
        self._counters = counters
        self._failed: dict[ChunkKey, float] = {}  # key -> until when it is a miss

    @property
    def configured(self) -> bool:
        return self._exists is not None

    def present(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch existence; a failing store answers misses (the remote tier must never break a lookup)."""
        if self._exists is None:
            return [False] * len(keys)
        try:
            present = list(self._exists(keys))
        except Exception as exc:
            self._counters.add(Metric.REMOTE_LOOKUP_ERRORS)
            logger.warning("remote existence check failed, treating as misses: %s", exc)
            return [False] * len(keys)
        present += [False] * (len(keys) - len(present))
        if self._failed:
            now = time.monotonic()
            for key, until in list(self._failed.items()):
                if until <= now:
                    del self._failed[key]
            present = [there and key not in self._failed for key, there in zip(keys, present)]
        return present

    def promotion_failed(self, key: ChunkKey) -> None:
        self._failed[key] = time.monotonic() + REMOTE_MISS_AFTER_FAILURE_S
