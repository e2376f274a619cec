"""What a worker-side storage tier reports: results that name why an operation did not happen, counters, and the
surface every tier offers (`TierStore`).

Tiers never raise in the serving path: a failure is a `TierResult.fail(Failure.X, detail)` and a counter, and the
scheduler-side index turns it into a miss.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Protocol, runtime_checkable


class Failure(str, Enum):
    """Why a tier operation did not happen; its value starts every reason text (`TierResult.reason`)."""

    MISS = "miss"  # nothing stored under the name
    CORRUPT = "corrupt"  # a file or object that cannot be this chunk; detail: which check failed
    UNTRUSTED = "untrusted"  # a link or foreign directory where a chunk belongs: refused, never followed
    IO = "io"  # the operating system failed a read or write
    DISK_FULL = "disk full"
    CLOSED = "closed"  # the tier no longer accepts writes
    QUEUE_FULL = "queue full"  # the write-behind queue holds its byte bound already
    CAPACITY = "capacity"  # the tier's configured size is used up
    CANCELLED = "cancelled"  # a delete overtook a queued write
    SUPERSEDED = "superseded"  # a newer write of the same name overtook a queued one
    UNAVAILABLE = "unavailable"  # the remote store is unreachable (its circuit is open)
    PUT = "put"  # the remote name holds other contents that could not be removed
    PUT_ERROR = "put error"  # detail: the remote client's return code
    GET_ERROR = "get error"  # detail: the remote client's return code
    REJECTED = "rejected"  # bytes read whose envelope does not verify; detail: `envelope.verify`'s reason
    ERROR = "error"  # a fault in the serving path; detail: the exception
    DEVICE = "device"  # the copy between device and arena failed
    SHARE = "share"  # the shared-host-memory path failed
    NO_DISK_TIER = "no disk tier"
    NO_REMOTE_TIER = "no remote tier"
    NO_DEVICE_MOVER = "no device mover"
    UNKNOWN_COMMAND = "unknown command"  # detail: the command's type name


# Their detail follows after a space, not a colon: the reason texts of completions and logs stay what they were.
_DETAIL_AFTER_SPACE = frozenset({Failure.PUT_ERROR, Failure.GET_ERROR, Failure.UNKNOWN_COMMAND})


@dataclass(frozen=True)
class TierResult:
    ok: bool
    kind: Optional[Failure] = None  # None exactly when ok
    detail: str = ""  # what the kind alone does not say, e.g. which check failed
    # the move's own seconds where its mover measured them (a device window, shared by the commands of one batch);
    # None: only the answer's arrival times it
    seconds: Optional[float] = None

    def __post_init__(self) -> None:
        if self.ok != (self.kind is None) or (self.kind is not None and not isinstance(self.kind, Failure)):
            raise ValueError(f"a TierResult is ok without a failure kind or failed with a Failure, got ok={self.ok} "
                             f"kind={self.kind!r}")

    @classmethod
    def fail(cls, kind: Failure, detail: str = "") -> "TierResult":
        return cls(False, kind, detail)

    @property
    def reason(self) -> str:
        """The failure as one line of text ("" when ok), e.g. "miss", "corrupt: length", "put error -600"."""
        if self.kind is None:
            return ""
        if not self.detail:
            return self.kind.value
        separator = " " if self.kind in _DETAIL_AFTER_SPACE else ": "
        return f"{self.kind.value}{separator}{self.detail}"


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

    def __contains__(self, name: object) -> bool:  # without it `in` would iterate __getitem__(0), (1), ... for ever
        with self._lock:
            return bool(self._counts.get(name))  # type: ignore[call-overload]


@runtime_checkable
class TierStore(Protocol):
    """What the executor uses of every worker-side tier alike (`DiskTier`, `MooncakeTier`): its counters (the
    executor adds "rejected" for envelopes that fail) and close. Reads, writes and deletes differ in shape (one name
    with a write-behind callback on disk, batches with envelope checks remote), so each tier's own class types them."""

    counters: TierCounters

    def close(self) -> None:
        """Finishes or abandons background work and releases what the tier holds; idempotent."""
        ...
