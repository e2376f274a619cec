"""What the index asks of an arena eviction policy (DESIGN §7): which ready chunk gives up its slot next.

The index owns slot states and pins; a policy only orders the ready chunks it is told about. `victim` proposes the
chunk to evict among those `evictable` says may go (pinned chunks: readers, reservations, writing never are), and the
index then calls `remove(key, evicted=True)`. A policy may reorganise itself while choosing (S3-FIFO moves chunks
between its queues) but never forgets a resident chunk on its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Hashable, Iterator, Optional, TypeVar

from ...checks import check_int

Key = TypeVar("Key", bound=Hashable)
Evictable = Callable[[Hashable], bool]


class EvictionPolicy(ABC):
    """Orders the arena's ready chunks for eviction. `capacity` is the arena's slot count (ghost lists are sized
    from it)."""

    name: str = ""

    def __init__(self, capacity: int) -> None:
        self.capacity = check_int(f"{type(self).__name__} capacity (slots)", capacity, lo=1)

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """`key` became ready in the arena (a store or a promotion completed on every rank)."""

    @abstractmethod
    def touch(self, key: Hashable, reuse: bool) -> None:
        """A ready `key` was used: `reuse` when a new request found it (a hit), False for a use the hit already
        counted (the load that follows a lookup)."""

    @abstractmethod
    def remove(self, key: Hashable, evicted: bool) -> None:
        """`key` left the arena: `evicted` when `victim` chose it (history policies remember it), False when it
        left for another reason."""

    @abstractmethod
    def victim(self, evictable: Evictable) -> Optional[Hashable]:
        """The resident chunk to evict next among those `evictable` accepts; None when there is none."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is resident (ghost entries are not)."""

    @abstractmethod
    def __len__(self) -> int:
        """Resident chunks."""

    @abstractmethod
    def __iter__(self) -> Iterator[Hashable]:
        """Resident chunks, the next victim (when nothing is pinned) first."""

    def _require_resident(self, key: Hashable) -> None:
        if key not in self:
            raise KeyError(f"{self.name} policy: chunk {key!r} is not resident in the arena")
