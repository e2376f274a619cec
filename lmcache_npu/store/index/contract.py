"""What a scheduler half asks of the node's chunk manager (DESIGN §7), in the spirit of vLLM's `OffloadingManager`.

Every verb takes and returns plain values (keys, ints, commands, `LookupResult`) so that a manager living in another
process (the node cache) can implement the same contract over a socket. The eight abstract verbs, in the order a
request uses them:

- `lookup(request, keys)` / `presence(keys)`: the longest held prefix (reserved, promoted), or a plain yes/no per key
  (`locate(keys)`, with a default: where the held prefix lies, before anything is reserved or moved).
- `prepare_load(request, chunks)` / `release(request)`: turn reservations into `Load` commands, or give them up.
- `prepare_store(request, chunks)`: slots and `Store` commands for computed chunks.
- `take_commands()` / `on_completions(answers)` / `is_pending(cmd_id)`: the commands for the workers, and every
  rank's answers; a command's effect is visible only once every rank answered.
The rest has defaults that fit a manager in process, so a caller never asks which manager it has: a manager shared
by engines (the node cache) overrides its epoch, lease, refused commands, payload sharing, a P/D hand-off's writer
(`lookup_awaiting`, `handoff_writer`), `sync` and `close`.
Observation (`occupancy`, `location`, `chunks`, ...) is `ChunkManagerView`'s; restart adoption is the factories'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from ..commands import Command, Completion, Load, Store, Tier
from ..keys import ChunkKey
from ..tier import TierCounters

# told (key, tier, entered) when a chunk becomes readable in a tier (arena, disk, remote) or stops being so
TierListener = Callable[[ChunkKey, Tier, bool], None]
# batch existence of keys in the remote store
RemoteExists = Callable[[Sequence[ChunkKey]], Sequence[bool]]
# (tier, the chunk's position in its request or None, its reuses) -> whether a copy in that slow tier pays
Admission = Callable[[Tier, Optional[int], int], bool]
# (chunk number in the request, key)
NumberedChunks = Sequence[tuple[int, ChunkKey]]
# told (key, payload as builtins) what a router needs to name a chunk another engine sharing the manager described
PayloadSink = Callable[[ChunkKey, tuple], None]
# an engine sharing the manager that writes chunks another engine may wait for: (engine name, its lease's public id)
Writer = tuple[str, str]


class SlotState(str, Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"
    READING = "reading"  # ready and pinned by in-flight loads, puts, persists (reported, never stored)


class DiskState(str, Enum):
    NONE = "none"
    WRITING = "writing"
    PRESENT = "present"


@dataclass(frozen=True)
class LookupResult:
    """`hit_chunks`: the longest prefix present in some tier (being promoted or stored counts); `ready_chunks`:
    the prefix loadable from the arena now. `pending` means the caller should ask again after promotions land.
    `sources` names, per hit chunk, the tier it was found in."""

    hit_chunks: int
    ready_chunks: int
    sources: tuple[Tier, ...] = ()

    @property
    def pending(self) -> bool:
        return self.ready_chunks < self.hit_chunks


@dataclass(frozen=True)
class ChunkView:
    """One chunk as the manager holds it (a snapshot, for status pages and tests)."""

    key: ChunkKey
    slot: Optional[int]
    slot_state: SlotState
    disk: DiskState
    readers: int  # in-flight loads, puts and persists reading the slot
    reservations: frozenset[str]  # requests between lookup and load
    disk_readers: int  # in-flight promotions reading the disk copy


class ChunkManager(ABC):
    """The scheduler side's contract: eight abstract verbs; `ChunkIndex` implements it in process, `NodeCacheClient`
    over the node cache's socket. Everything else has an in-process default (ABC keeps it from growing silently:
    tests/house/test_manager_contract_shape.py)."""

    num_slots: int  # arena slots
    disk_chunks: int  # disk tier capacity in chunks (0: none)
    counters: TierCounters
    epoch: Optional[str] = None  # the shared memory generation the workers map (None: their own arenas, or unattached)
    lease: str = ""  # the token a shared manager issued this engine's workers ("" none)

    @abstractmethod
    def lookup(self, request_id: str, keys: Sequence[ChunkKey]) -> LookupResult:
        """The longest prefix of `keys` held by some tier, reserved for `request_id` until `prepare_load` or
        `release`; disk and remote copies start moving into the arena. Asking again issues nothing twice."""

    @abstractmethod
    def presence(self, keys: Sequence[ChunkKey], remote: bool = True) -> list[bool]:
        """Whether some tier holds each key, without reserving or moving anything."""

    def locate(self, keys: Sequence[ChunkKey]) -> Optional[LookupResult]:
        """What `lookup` would find for `keys` (the held prefix, its ready part, a tier per chunk) without reserving
        or promoting anything, so that a caller can decide how much to claim before anything moves; None: this
        manager can tell only by a lookup (a node cache decides its promotions in its service)."""
        return None

    @abstractmethod
    def prepare_load(self, request_id: str, chunks: NumberedChunks) -> list[Load]:
        """Loads of ready chunks (a lookup said so); all are checked before any is issued."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The request gives up what its lookups reserved (finished, aborted or loaded)."""

    @abstractmethod
    def prepare_store(self, request_id: str, chunks: NumberedChunks) -> list[Store]:
        """Stores of computed chunks no tier holds yet, as far as slots can be had."""

    @abstractmethod
    def take_commands(self) -> list[Command]:
        """Every command issued since the last call, in the order the workers must run them."""

    @abstractmethod
    def on_completions(self, completions: Iterable[Completion]) -> None:
        """Workers' answers; a command takes effect once every rank answered (one failure fails it)."""

    @abstractmethod
    def is_pending(self, cmd_id: int) -> bool:
        """The command still waits for some rank's answer."""

    # ---- defaults: a manager in process; a shared one (the node cache) overrides them ----------------------------

    def lookup_awaiting(self, request_id: str, keys: Sequence[ChunkKey], writer: Writer) -> LookupResult:
        """`lookup`, where the chunks `writer` (another engine sharing the manager, under its live lease) is still
        storing count as pending hits, not misses (a P/D hand-off names its prefill engine). In process the only
        writer is this engine, whose stores in flight already are pending hits."""
        return self.lookup(request_id, keys)

    def handoff_writer(self) -> Optional[Writer]:
        """What another engine names to wait for this engine's stores (`lookup_awaiting`); None where no other engine
        can read them (in process)."""
        return None

    def limit_slots(self, usable: Union[int, Sequence[tuple[int, int]]]) -> None:
        """Hand out only slots of `usable` ([first, end) ranges live on every rank, or the first n); by default every
        slot is live."""

    def set_tier_listener(self, listener: Optional[TierListener]) -> None:
        """`listener(key, tier, entered)` hears every chunk entering or leaving a tier; None stops the calls. By
        default no change is told (a manager without routers to inform)."""

    def step_epoch(self) -> Optional[str]:
        """The epoch this step's workers must have mapped before they move a byte ("" while a shared manager is not
        attached); None: the slots are the workers' own arenas."""
        return None

    def mapped_on(self, epochs: Mapping[int, str]) -> bool:
        """Whether the ranks that told which epoch they mapped (`epochs`, rank -> epoch) can move this manager's
        slots now; until then nothing is looked up or stored. In process always."""
        return True

    def take_refused(self) -> list[Command]:
        """Commands the step's plans name that never reached the workers (a shared manager was lost): each rank
        answers them as failed. In process none."""
        return []

    def share_payloads(self, sink: PayloadSink) -> Optional[PayloadSink]:
        """A manager shared by engines tells `sink` the payloads others described, and returns where this engine
        describes its own; None: nothing is shared (in process)."""
        return None

    def sync(self) -> None:
        """Collects what one-way calls caused (counters, tier changes) before KV events are handed out; in process
        every call already took effect."""

    def close(self) -> None:
        """Gives back what the manager holds outside this process (a connection); in process nothing."""


class ChunkManagerView(ABC):
    """What a manager holds, for status pages, gauges, tools and tests (never needed to run a request). The factory
    that builds a manager hands out its view."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Commands issued and not answered by every rank."""

    @property
    @abstractmethod
    def eviction_policy(self) -> str:
        """The arena's eviction policy's name."""

    @abstractmethod
    def occupancy(self) -> dict[Tier, tuple[int, int]]:
        """Per local tier, (chunks held, capacity)."""

    @abstractmethod
    def location(self, key: ChunkKey) -> tuple[Optional[int], SlotState, DiskState]:
        """Where one chunk is: its slot, the slot's state, its disk copy's state."""

    @abstractmethod
    def chunks(self) -> list[ChunkView]:
        """Every chunk the manager tracks, as a snapshot."""

    @abstractmethod
    def queued_commands(self) -> tuple[Command, ...]:
        """The commands `take_commands` would hand out now, without taking them."""
