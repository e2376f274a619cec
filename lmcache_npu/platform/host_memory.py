"""How host memory becomes DMA-able for an accelerator: registering memory we mapped, or letting the device runtime
allocate it, and the order in which an arena tries those ways.

Two kinds of path:
* a `HostRegistrar` registers a range the arena mapped itself (cudaHostRegister, aclrtHostRegister,
  mlock + halHostRegister): the arena keeps its mmap segments, hugepages and NUMA placement;
* a `HostAllocator` hands out memory that is DMA-able by construction (aclrtMallocHost): a segment's pages then come
  from the device runtime instead of our mmap.

`SegmentPinning` tries its paths in order on the arena's first segment and keeps the first that works for every later
segment, so a host learns its path once, at start, and says which; when none works the arena refuses to start with
every path's reason, never mid-serving.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class HostRegistrar(Protocol):
    """Makes a range of host memory we mapped addressable by one accelerator's DMA engines."""

    name: str

    def bind_thread(self) -> None:
        """Makes the calling (background) thread's current device the arena's device."""

    def register(self, address: int, nbytes: int) -> int:
        """Registers [address, address + nbytes); returns the device's address of it; raises on failure."""

    def unregister(self, address: int, nbytes: int) -> None:
        """Undoes `register` of that range."""


@runtime_checkable
class HostAllocator(Protocol):
    """Allocates host memory the accelerator's DMA engines reach by construction."""

    name: str

    def bind_thread(self) -> None:
        """Makes the calling (background) thread's current device the arena's device."""

    def allocate(self, nbytes: int) -> int:
        """`nbytes` of page-aligned, DMA-able host memory; its address; raises on failure."""

    def free(self, address: int) -> None:
        """Gives back memory `allocate` returned."""


HostMemoryPath = Union[HostRegistrar, HostAllocator]


def allocates(path: HostMemoryPath) -> bool:
    """Whether `path` supplies a segment's memory itself (else it registers memory the arena mapped)."""
    return hasattr(path, "allocate")


@dataclass
class SegmentPinning:
    """The paths an arena's segments may take to become DMA-able, in the order to try them. `left_out` names paths
    the host's facts ruled out, with the reason (reported beside the ones tried)."""

    paths: Sequence[HostMemoryPath]
    left_out: Sequence[tuple[str, str]] = ()
    chosen: Optional[HostMemoryPath] = None
    tried: list[tuple[str, str]] = field(default_factory=list)  # (path, why it failed on the first segment)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.paths:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.left_out) or "no path was given"
            raise MemoryError(f"no way to make host memory DMA-able on this host ({reasons})")

    def candidates(self) -> list[HostMemoryPath]:
        """The chosen path once there is one, else every path in order."""
        with self._lock:
            return [self.chosen] if self.chosen is not None else list(self.paths)

    def settle(self, path: HostMemoryPath) -> None:
        """`path` worked: every later segment takes it."""
        with self._lock:
            if self.chosen is None:
                self.chosen = path
                logger.info("host arena: segments are made DMA-able with %s%s", path.name, self._history())

    def failed(self, path: HostMemoryPath, reason: str) -> None:
        """`path` failed before any path was chosen: the next one is tried."""
        with self._lock:
            if self.chosen is None:
                self.tried.append((path.name, reason))
                logger.warning("host arena: %s failed on the first segment (%s); trying the next way", path.name,
                               reason)

    def describe(self) -> str:
        """One line: what was chosen (or the order to try), what failed, what the facts left out."""
        with self._lock:
            head = self.chosen.name if self.chosen is not None else " -> ".join(p.name for p in self.paths)
            return head + self._history()

    def _history(self) -> str:
        parts = [f"{name} failed: {why}" for name, why in self.tried]
        parts += [f"{name} left out: {why}" for name, why in self.left_out]
        return f" ({'; '.join(parts)})" if parts else ""
