"""What the scheduler-side index tells every worker to do, and what workers report back.

Plain, picklable dataclasses: they travel in vLLM's connector metadata (scheduler → workers) and worker metadata
(workers → scheduler). Every rank runs the same command list in order against its own identical arena; each
rank answers every command with one `Completion`. A command is done when all ranks answered.

A command of the node cache names the epoch (the service's run and pool) whose slots it names: a worker runs it only
against its mapping of that epoch, and refuses it otherwise (the slot may hold another engine's chunk by then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Optional, Union

# a load or store a worker waits for no longer (answered as failed then: the load recomputes, the store is dropped);
# a node cache's command TTL must be longer, so a live engine's workers always answer first
COMMAND_DEADLINE_S = 120.0
# the node cache service fails a device command no answer settled for this long (its slot freed, its pin dropped)
COMMAND_TTL_S = 600.0

from .keys import ChunkKey


class Tier(str, Enum):
    """Where a chunk is held. The values are the names metrics, KV events and `lmcache-npu status` use, and a tier
    formats as its value (`f"promotions_{tier}"` is "promotions_disk" on every Python)."""

    ARENA = "cpu"
    DISK = "disk"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Medium(str, Enum):
    """An end of a byte move: the device's KV pages or one of the tiers (same names as `Tier`), or `GONE` (a drop)."""

    DEVICE = "device"
    ARENA = "cpu"
    DISK = "disk"
    REMOTE = "remote"
    GONE = "gone"  # a drop's destination: the copy is deleted

    @classmethod
    def of(cls, tier: Tier) -> "Medium":
        return cls(tier.value)


# (source, destination) of a command's bytes: the executor dispatches on it, as vLLM's OffloadingWorker does
Route = tuple[Medium, Medium]
DEVICE_TO_ARENA: Route = (Medium.DEVICE, Medium.ARENA)
ARENA_TO_DEVICE: Route = (Medium.ARENA, Medium.DEVICE)
ARENA_TO_DISK: Route = (Medium.ARENA, Medium.DISK)
DISK_TO_ARENA: Route = (Medium.DISK, Medium.ARENA)
ARENA_TO_REMOTE: Route = (Medium.ARENA, Medium.REMOTE)
REMOTE_TO_ARENA: Route = (Medium.REMOTE, Medium.ARENA)
DISK_DROP: Route = (Medium.DISK, Medium.GONE)
REMOTE_DROP: Route = (Medium.REMOTE, Medium.GONE)


@dataclass(frozen=True)
class SlotMove:
    """A byte move of the chunk `key` through arena `slot`; each kind names its route (a class constant, but for
    `Promote`, whose source varies)."""

    cmd_id: int
    key: ChunkKey
    slot: int
    route: ClassVar[Route]
    epoch: Optional[str] = field(default=None, kw_only=True)  # the node cache epoch of `slot` (None: a private arena)


@dataclass(frozen=True)
class Store(SlotMove):
    """Device → arena: write the chunk `key` (the request's chunk number `chunk_index`) into `slot`."""

    request_id: str
    chunk_index: int
    route: ClassVar[Route] = DEVICE_TO_ARENA


@dataclass(frozen=True)
class Load(SlotMove):
    """Arena → device: read the chunk `key` from `slot` into the request's chunk number `chunk_index`."""

    request_id: str
    chunk_index: int
    route: ClassVar[Route] = ARENA_TO_DEVICE


@dataclass(frozen=True)
class Spill(SlotMove):
    """Arena → disk, write-behind: the slot may be reused by the very next command (the disk tier copies first)."""

    route: ClassVar[Route] = ARENA_TO_DISK


@dataclass(frozen=True)
class Promote(SlotMove):
    """Disk or remote → arena `slot`, in the background; the chunk is loadable once every rank has completed."""

    source: Tier

    @property  # type: ignore[override]
    def route(self) -> Route:
        return (Medium.of(self.source), Medium.ARENA)


@dataclass(frozen=True)
class Put(SlotMove):
    """Arena `slot` → remote store; the slot stays pinned until every rank has completed."""

    route: ClassVar[Route] = ARENA_TO_REMOTE


@dataclass(frozen=True)
class Persist(SlotMove):
    """Arena `slot` → disk, in the background; the slot stays pinned (like Put) until every rank has completed."""

    route: ClassVar[Route] = ARENA_TO_DISK


@dataclass(frozen=True)
class Drop:
    """Delete the chunk's copy in `tier` (disk LRU, or a copy found corrupt on some rank)."""

    cmd_id: int
    key: ChunkKey
    tier: Tier
    epoch: Optional[str] = field(default=None, kw_only=True)  # as SlotMove's

    @property
    def route(self) -> Route:
        return self.route_from(self.tier)

    @staticmethod
    def route_from(tier: Tier) -> Route:
        """The route of a drop of `tier`'s copy: from that tier to nowhere."""
        return (Medium.of(tier), Medium.GONE)


@dataclass(frozen=True)
class BlockWindow:
    """Part of one request's block table: per scheduler group, the ids of logical blocks starting at `first_block`
    (vLLM's null block 0 marks a block it freed or never allocated)."""

    first_block: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DeviceMove:
    """One byte move between the device's KV pages and an arena slot, both ends in one object (vLLM's `(src, dst)`
    transfer spec): `command` is the arena end (slot, key, the request's chunk number), `window` the device end (the
    request's blocks that chunk's rows live in). A load leaves the rows before `first_token` alone (vLLM's own prefix
    cache computed them) and from `end_token` on (a hit ending inside a chunk: a P/D hand-off), and reads end-state
    rows only into the chunk ending at `end_token`; a store `without_end_state` writes zeros for them, and a store
    with an `end_token` (a prompt's partial last chunk) writes zeros for the rows from it on."""

    command: Union[Store, Load]
    window: BlockWindow
    first_token: int = 0
    end_token: int = 0
    without_end_state: bool = False

    @property
    def cmd_id(self) -> int:
        return self.command.cmd_id

    @property
    def key(self) -> ChunkKey:
        return self.command.key

    @property
    def slot(self) -> int:
        return self.command.slot

    @property
    def epoch(self) -> Optional[str]:
        return self.command.epoch

    @property
    def route(self) -> Route:
        return self.command.route

    @property
    def request_id(self) -> str:
        return self.command.request_id

    @property
    def chunk_index(self) -> int:
        return self.command.chunk_index

    @property
    def is_store(self) -> bool:
        return isinstance(self.command, Store)


def arena_end(command: Union["Command", DeviceMove]) -> "Command":
    """The index's command behind `command` (a device move's arena end; any other command is its own)."""
    return command.command if isinstance(command, DeviceMove) else command


Command = Union[Store, Load, Spill, Promote, Put, Persist, Drop]
Transfer = Union[Store, Load, Spill, Promote, Put, Persist]  # the commands that move bytes (every command has a `route`)
# what a worker's executor runs: the index's tier commands, and device moves (a Store/Load with its device end)
WorkerCommand = Union[Command, DeviceMove]


@dataclass(frozen=True)
class Completion:
    """One rank's answer to one command; `reason` says why when not ok (e.g. "miss", "corrupt: checksum")."""

    cmd_id: int
    rank: int
    ok: bool
    reason: str = ""
