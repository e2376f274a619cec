"""What a worker-side storage tier reports: results that name why an operation did not happen, and counters.

Tiers never raise in the serving path: a failure is a `TierResult(ok=False, reason=...)` and a counter, and the
scheduler-side index turns it into a miss.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class TierResult:
    ok: bool
    reason: str = ""  # empty when ok; otherwise e.g. "miss", "corrupt: checksum", "disk full", "timeout"

    @classmethod
    def fail(cls, reason: str) -> "TierResult":
        return cls(False, reason)


OK = TierResult(True)


class TierCounters:
    """Thread-safe named counters (writes, misses, corrupt files removed, timeouts, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        # bumped by every add, so a per-step reader can skip counters that did not move without copying them
        self.version = 0

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._counts[name] += amount
            self.version += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def versioned_snapshot(self) -> tuple[int, dict[str, float]]:
        """The counts and the version they are as of (read together, so no add falls between them)."""
        with self._lock:
            return self.version, dict(self._counts)

    def drain(self) -> dict[str, float]:
        """The counts since the last drain, and a fresh start."""
        if not self._counts:  # most steps count nothing; an add racing this check is drained by the next call
            return {}
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
            return counts

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return self._counts[name]
