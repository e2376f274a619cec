"""What workers measure of their transfers and send to the scheduler's cost model (in the worker metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from ..commands import (ARENA_TO_DEVICE, ARENA_TO_DISK, ARENA_TO_REMOTE, DEVICE_TO_ARENA, DISK_TO_ARENA,
                        REMOTE_TO_ARENA, Route, Tier)


class Path(str, Enum):
    """A tier and direction the cost model keeps a speed for (the values name stats and gauges)."""

    LOAD = "load"  # arena -> device pages
    DISK = "disk"  # disk -> arena (a promotion)
    REMOTE = "remote"  # Mooncake -> arena (a promotion)
    STORE = "store"  # device pages -> arena
    DISK_WRITE = "disk_write"  # arena -> disk (spill, write-through)
    REMOTE_WRITE = "remote_write"  # arena -> Mooncake (put)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, route: Route) -> Optional["Path"]:
        return _PATHS.get(route)

    @classmethod
    def promotion(cls, tier: Tier) -> Optional["Path"]:
        """The path a chunk found in `tier` takes into the arena (None: it is there)."""
        return {Tier.DISK: cls.DISK, Tier.REMOTE: cls.REMOTE}.get(tier)


_PATHS = {ARENA_TO_DEVICE: Path.LOAD, DISK_TO_ARENA: Path.DISK, REMOTE_TO_ARENA: Path.REMOTE,
          DEVICE_TO_ARENA: Path.STORE, ARENA_TO_DISK: Path.DISK_WRITE, ARENA_TO_REMOTE: Path.REMOTE_WRITE}


@dataclass(frozen=True)
class TransferSample:
    """One batch of one route (the commands of one path in one submit), from submit to its last answer."""

    path: Path
    chunks: int
    bytes: int
    queued_bytes: int  # bytes of the same path still in flight when the batch was submitted (it waits behind them)
    seconds: float
    ok: bool  # every command of the batch succeeded (a failed batch says little about speed)
