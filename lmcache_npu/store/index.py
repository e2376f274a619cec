"""The scheduler-side index (DESIGN §7): which chunk is where, and the commands that move it.

Only this object changes slot states. It answers lookups from its own tables (no RPC to workers), allocates arena
slots for stores, orders ready slots for eviction with a policy (`policies/`: LRU, ARC, S3-FIFO) while pins keep
in-flight work, spills what it evicts to disk when a disk tier exists (with write-through, stored chunks are written
to disk at once, so they survive a restart), promotes disk/remote chunks into the arena before a load, and emits
every byte move as a command (`commands.py`) for all ranks. A command's effect becomes visible here only once every
rank has completed it.

Reuse gate, per slow tier (`remote_admit_hits`, `disk_admit_hits`; N >= 1): a chunk reaches the tier only once
lookups of N later requests asked for it (counted per key in a bounded table that outlives the chunk's slot). The
Mooncake put is issued at that lookup (or when the chunk becomes ready after it); an evicted chunk is spilled only if
it passed the disk gate. Write-through to disk, when on, still writes every chunk at once.

Slot life: free → writing (a store or a promotion in flight) → ready (in the policy) → reading (pinned by in-flight
loads, puts or persists) → ready. A slot that is writing, pinned or reserved by a request between its lookup and its
load is never evicted or reused, whatever the policy proposes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Optional, Sequence, Union

from .commands import Command, Completion, Drop, Load, Persist, Promote, Put, Spill, Store, Tier
from .keys import ChunkKey
from .policies import EvictionPolicy, make_policy
from .tier import TierCounters

logger = logging.getLogger(__name__)

RemoteExists = Callable[[Sequence[ChunkKey]], Sequence[bool]]
# told (key, tier, entered) when a chunk becomes readable in a tier (arena, disk, remote) or stops being so
TierListener = Callable[[ChunkKey, Tier, bool], None]
# A chunk whose promotion from the remote store failed on some rank is a miss for this long, then tried again.
REMOTE_MISS_AFTER_FAILURE_S = 60.0
# the reuse table remembers this many keys per arena slot (at least SEEN_MIN): enough to see a chunk come back
# after it left the arena and disk
SEEN_PER_SLOT = 2
SEEN_MIN = 1024


class SlotState(str, Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"
    READING = "reading"  # ready and pinned by in-flight loads, puts, persists (reported by `location`, never stored)


class DiskState(str, Enum):
    NONE = "none"
    WRITING = "writing"
    PRESENT = "present"


@dataclass
class _Entry:
    key: ChunkKey
    slot: Optional[int] = None
    slot_state: SlotState = SlotState.FREE
    readers: int = 0  # in-flight loads, puts and persists reading the slot
    reservations: set[str] = field(default_factory=set)  # requests between lookup and load
    disk: DiskState = DiskState.NONE
    disk_readers: int = 0  # in-flight promotions reading the file
    disk_cmd: int = 0  # the spill or persist that is writing the current disk copy
    remote_put: bool = False  # a put of this chunk is in flight or done

    @property
    def pinned(self) -> bool:
        return self.readers > 0 or bool(self.reservations)

    @property
    def has_copy(self) -> bool:
        return self.slot is not None or self.disk is not DiskState.NONE


@dataclass
class _Pending:
    command: Command
    waiting: set[int]
    failures: list[str] = field(default_factory=list)


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


class ChunkIndex:
    """One per scheduler; capacities are in chunks (`arena.slots_for_capacity` and `disk.disk_chunks_for_capacity`
    convert the configured bytes). `remote_exists` answers batch existence in the remote store (None: no remote tier).
    `disk_write_through`: every chunk stored or promoted from the remote store is also written to disk (`Persist`),
    so a restart finds it; off, the disk only receives evicted chunks. `eviction_policy` orders the arena's ready
    chunks (a name from `policies.POLICIES` or a policy object of `num_slots`). `remote_admit_hits` /
    `disk_admit_hits`: 0 sends every chunk to that tier (puts at store, spills at eviction); N >= 1 only chunks that
    N later requests looked up."""

    def __init__(self, num_slots: int, num_ranks: int = 1, disk_chunks: int = 0,
                 remote_exists: Optional[RemoteExists] = None, put_to_remote: bool = True,
                 disk_write_through: bool = False, eviction_policy: Union[str, EvictionPolicy] = "lru",
                 remote_admit_hits: int = 0, disk_admit_hits: int = 0) -> None:
        if num_slots < 1 or num_ranks < 1 or disk_chunks < 0:
            raise ValueError(f"index needs num_slots >= 1, num_ranks >= 1, disk_chunks >= 0 "
                             f"(got {num_slots}, {num_ranks}, {disk_chunks})")
        for name, value in (("remote_admit_hits", remote_admit_hits), ("disk_admit_hits", disk_admit_hits)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: no reuse gate), got {value!r}")
        policy = make_policy(eviction_policy, num_slots) if isinstance(eviction_policy, str) else eviction_policy
        if not isinstance(policy, EvictionPolicy) or policy.capacity != num_slots or len(policy):
            raise ValueError(f"eviction_policy must be a policy name or an empty EvictionPolicy of {num_slots} "
                             f"slots, got {eviction_policy!r}")
        self.num_slots = num_slots
        self.num_ranks = num_ranks
        self.disk_chunks = disk_chunks
        self._remote_exists = remote_exists
        self._remote_failed: dict[ChunkKey, float] = {}  # key -> until when a failed remote promotion makes it a miss
        self._put_to_remote = put_to_remote and remote_exists is not None
        self._write_through = disk_write_through and disk_chunks > 0
        self._to_persist: list[tuple[ChunkKey, int]] = []  # (key, slot) written to the arena by this batch of answers
        self._entries: dict[ChunkKey, _Entry] = {}
        self._slot_owner: list[Optional[ChunkKey]] = [None] * num_slots
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._usable = bytearray(b"\x01") * num_slots  # slots of live arena segments on every rank (limit_slots)
        self._withheld: set[int] = set()  # free slots outside the usable set: never handed out
        self._arena_policy = policy  # ready slots, in eviction order
        self._remote_admit_hits = remote_admit_hits
        self._disk_admit_hits = disk_admit_hits
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> requests that looked it up, oldest first
        self._seen_capacity = max(SEEN_MIN, SEEN_PER_SLOT * (num_slots + disk_chunks))
        self._counted: dict[str, set[ChunkKey]] = {}  # per request: keys its lookups already counted in _seen
        self._disk_lru: OrderedDict[ChunkKey, None] = OrderedDict()  # disk copies (writing or present), oldest first
        self._reserved: dict[str, set[ChunkKey]] = {}
        self._pending: dict[int, _Pending] = {}
        self._outbox: list[Command] = []
        self._next_cmd_id = 1
        self.counters = TierCounters()
        self._listener: Optional[TierListener] = None  # KV events for routers; None costs one check per change

    # ---- what the connector calls -------------------------------------------------------------------------------

    def adopt_disk(self, keys: Iterable[ChunkKey]) -> int:
        """Restart: chunks whose files every rank has on disk, oldest first. Returns how many were adopted
        (beyond `disk_chunks` the oldest are dropped)."""
        adopted = 0
        for key in keys:
            if self.disk_chunks == 0:
                break
            entry = self._entries.setdefault(key, _Entry(key))
            if entry.disk is DiskState.NONE:
                self._make_disk_room()
                entry.disk = DiskState.PRESENT
                self._disk_lru[key] = None
                self._tell(key, Tier.DISK, True)
                adopted += 1
        return adopted

    def drop_disk_copies(self, keys: Iterable[ChunkKey]) -> None:
        """Restart: chunks only some ranks have on disk cannot be loaded; every rank deletes its file of them."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.disk is DiskState.NONE:
                self._emit(Drop(self._new_id(), key, Tier.DISK))

    def lookup(self, request_id: str, keys: Sequence[ChunkKey]) -> LookupResult:
        """The longest prefix of `keys` held by some tier. Chunks found on disk or remote are promoted into the
        arena (commands in the outbox); every hit chunk is reserved for `request_id` until `begin_load` or
        `release`. Calling it again for the same request is cheap and issues nothing twice."""
        hit = ready = 0
        reserved = self._reserved.setdefault(request_id, set())
        held_before = set(reserved)
        for key in keys:  # pin what the arena already holds first: promotions below must not evict our own hits
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None:
                self._reserve(entry, request_id, reserved)
        first_ask = self._count_requests(request_id, keys)
        remote_from, remote_present = 0, None  # asked once, for the keys from the first local miss on
        sources: list[Tier] = []
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None:
                if entry.slot_state is SlotState.READY:
                    self._arena_policy.touch(key, reuse=first_ask[position])
                    ready += ready == position
                    if first_ask[position] and self._remote_admit_hits:
                        self._put_if_admitted(entry)
                sources.append(Tier.ARENA)
            elif entry is not None and entry.disk is DiskState.PRESENT:
                self._reserve(entry, request_id, reserved)
                if not self._promote(entry, Tier.DISK):
                    break
                sources.append(Tier.DISK)
            else:
                if remote_present is None:
                    remote_from, remote_present = position, self._remote_present(keys[position:])
                if not remote_present[position - remote_from]:
                    break
                entry = self._entries.setdefault(key, _Entry(key))
                self._reserve(entry, request_id, reserved)  # kept while its own promotion may evict and drop
                if not self._promote(entry, Tier.REMOTE):
                    break
                sources.append(Tier.REMOTE)
            hit += 1
        for key in keys[hit:]:  # what lies past the hit prefix is not this request's to hold
            entry = self._entries.get(key)
            if key in reserved and key not in held_before and entry is not None:
                reserved.discard(key)
                entry.reservations.discard(request_id)
                self._forget_if_empty(entry)
        self.counters.add("lookup_chunks", len(keys))
        self.counters.add("lookup_hit_chunks", hit)
        return LookupResult(hit, ready, tuple(sources[:hit]))

    def presence(self, keys: Sequence[ChunkKey], remote: bool = True) -> list[bool]:
        """Whether some tier holds each key (the arena, a complete disk copy, or with `remote` the remote store), as
        `lookup` would find it, without reserving or promoting anything; one remote existence batch for the keys not
        held locally."""
        held = []
        for key in keys:
            entry = self._entries.get(key)
            held.append(entry is not None and (entry.slot is not None or entry.disk is DiskState.PRESENT))
        missing = [key for key, here in zip(keys, held) if not here]
        found = iter(self._remote_present(missing) if missing and remote else [False] * len(missing))
        return [here or next(found) for here in held]

    def begin_load(self, request_id: str, chunks: Sequence[tuple[int, ChunkKey]]) -> list[Load]:
        """Loads for the request's chunks (chunk number, key); each must be ready (a lookup said so). Checked for
        all chunks before any load is issued: on error nothing is."""
        for chunk_index, key in chunks:
            entry = self._entries.get(key)
            if entry is None or entry.slot_state is not SlotState.READY:
                state = "absent" if entry is None else entry.slot_state.value
                raise ValueError(f"request {request_id!r} chunk {chunk_index}: key {key.chunk_hash.hex()} is {state} "
                                 f"in the arena; begin_load needs a ready chunk (lookup reports ready_chunks)")
        loads = []
        reserved = self._reserved.get(request_id, set())
        for chunk_index, key in chunks:
            entry = self._entries[key]
            entry.readers += 1
            if key in reserved:
                reserved.discard(key)
                entry.reservations.discard(request_id)
            self._arena_policy.touch(key, reuse=False)
            loads.append(self._emit(Load(self._new_id(), key, entry.slot, request_id, chunk_index)))  # type: ignore
        self.counters.add("loads", len(loads))
        return loads

    def release(self, request_id: str) -> None:
        """The request will not load what its lookups reserved (finished, aborted or loaded)."""
        self._counted.pop(request_id, None)
        for key in self._reserved.pop(request_id, set()):
            entry = self._entries.get(key)
            if entry is not None:
                entry.reservations.discard(request_id)
                self._forget_if_empty(entry)

    def allocate_store(self, request_id: str, chunks: Sequence[tuple[int, ChunkKey]]) -> list[Store]:
        """Stores for the request's computed chunks not already held in the arena or on disk. When every slot is
        pinned, the remaining chunks are not stored (counter `store_no_slot`)."""
        stores = []
        for chunk_index, key in chunks:
            entry = self._entries.get(key)
            if entry is not None and entry.has_copy:
                if entry.slot_state is SlotState.READY:
                    self._arena_policy.touch(key, reuse=False)  # the lookups count reuse, not re-stores
                continue
            slot = self._take_slot()
            if slot is None:
                self.counters.add("store_no_slot", len(chunks) - len(stores))
                break
            entry = self._entries.setdefault(key, _Entry(key))
            self._occupy(entry, slot)
            stores.append(self._emit(Store(self._new_id(), key, slot, request_id, chunk_index)))
        self.counters.add("stores", len(stores))
        return stores  # type: ignore[return-value]

    def set_tier_listener(self, listener: Optional[TierListener]) -> None:
        """`listener(key, tier, entered)` hears every chunk that becomes readable in a tier (ARENA: a store or
        promotion completed on every rank; DISK: a spill or write-through completed, or adopted at restart; REMOTE: a
        put or remote promotion completed) or stops being so (ARENA: evicted; DISK: dropped). The remote store evicts
        on its own, so REMOTE is never left. None stops the calls."""
        if listener is not None and not callable(listener):
            raise ValueError(f"tier listener must be callable or None, got {type(listener).__name__}")
        self._listener = listener

    def take_commands(self) -> list[Command]:
        """Every command issued since the last call, in the order workers must run them."""
        commands, self._outbox = self._outbox, []
        return commands

    def on_completions(self, completions: Iterable[Completion]) -> None:
        """Workers' answers; a command takes effect once all ranks answered (one failure fails it)."""
        for done in completions:
            pending = self._pending.get(done.cmd_id)
            if pending is None or done.rank not in pending.waiting:
                self.counters.add("unexpected_completions")
                logger.warning("ignoring completion of unknown command %d from rank %d", done.cmd_id, done.rank)
                continue
            pending.waiting.discard(done.rank)
            if not done.ok:
                pending.failures.append(f"rank {done.rank}: {done.reason}")
            if not pending.waiting:
                del self._pending[done.cmd_id]
                self._finish(pending.command, pending.failures)
        self._persist_written()

    # ---- introspection ------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def is_pending(self, cmd_id: int) -> bool:
        """The command still waits for some rank's completion."""
        return cmd_id in self._pending

    def limit_slots(self, usable: Union[int, Sequence[tuple[int, int]]]) -> None:
        """Hands out only slots in `usable`: [first, end) slot ranges (those of the arena segments live on every
        rank), or an int n for the first n. Slots leaving the set are withheld once free (a chunk in one keeps it
        until it goes); slots entering it become free at once."""
        ranges = [(0, usable)] if isinstance(usable, int) else list(usable)
        mask = bytearray(self.num_slots)
        for begin, end in ranges:
            if not 0 <= begin <= end <= self.num_slots:
                raise ValueError(f"usable slot range [{begin}, {end}) is outside the index's {self.num_slots} slots")
            mask[begin:end] = b"\x01" * (end - begin)
        self._usable = mask
        back = [slot for slot in self._withheld if mask[slot]]
        self._withheld.difference_update(back)
        leaving = [slot for slot in self._free_slots if not mask[slot]]
        self._withheld.update(leaving)
        if back or leaving:  # lowest slot first, as at start
            self._free_slots = sorted([slot for slot in self._free_slots if mask[slot]] + back, reverse=True)

    @property
    def usable_slots(self) -> int:
        """How many slots the index may hand out (those of live arena segments)."""
        return self._usable.count(1)

    def occupancy(self) -> dict[Tier, tuple[int, int]]:
        """Per local tier, (chunks held, capacity): the arena counts slots being written too and has the usable slots
        (live segments) as capacity, the disk counts files being written too (what `lmcache-npu status` shows)."""
        held = self.num_slots - len(self._free_slots) - len(self._withheld)
        usable = self._usable.count(1)  # C speed: the scheduler reports this every step
        return {Tier.ARENA: (held, usable), Tier.DISK: (len(self._disk_lru), self.disk_chunks)}

    @property
    def eviction_policy(self) -> str:
        return self._arena_policy.name

    def reuses(self, key: ChunkKey) -> int:
        """How many requests after the first looked `key` up, as far as the bounded reuse table remembers."""
        return max(0, self._seen.get(key, 0) - 1)

    def location(self, key: ChunkKey) -> tuple[Optional[int], SlotState, DiskState]:
        entry = self._entries.get(key)
        if entry is None:
            return None, SlotState.FREE, DiskState.NONE
        state = SlotState.READING if entry.slot_state is SlotState.READY and entry.readers else entry.slot_state
        return entry.slot, state, entry.disk

    def check_invariants(self) -> None:
        """Raises AssertionError when the tables disagree (tests call this after every step)."""
        owners = {}
        for key, entry in self._entries.items():
            assert entry.has_copy or entry.reservations or entry.readers, f"{key} has no copy and is kept"
            if entry.slot is not None:
                assert entry.slot not in owners, f"slot {entry.slot} has two owners"
                owners[entry.slot] = key
                assert self._slot_owner[entry.slot] == key
                assert (key in self._arena_policy) == (entry.slot_state is SlotState.READY)
            else:
                assert entry.slot_state is SlotState.FREE and key not in self._arena_policy
            assert (key in self._disk_lru) == (entry.disk is not DiskState.NONE)
            assert entry.readers >= 0 and entry.disk_readers >= 0
        assert len(owners) + len(self._free_slots) + len(self._withheld) == self.num_slots
        assert set(self._free_slots).isdisjoint(owners) and self._withheld.isdisjoint(owners)
        assert all(self._usable[slot] for slot in self._free_slots)
        assert not any(self._usable[slot] for slot in self._withheld)
        assert len(self._disk_lru) <= self.disk_chunks
        ready = sum(entry.slot_state is SlotState.READY for entry in self._entries.values())
        assert len(self._arena_policy) == ready, f"policy holds {len(self._arena_policy)} chunks, {ready} are ready"
        assert len(self._seen) <= self._seen_capacity

    # ---- internals ----------------------------------------------------------------------------------------------

    def _tell(self, key: ChunkKey, tier: Tier, entered: bool) -> None:
        """Tells the listener a chunk entered or left a tier; a failing listener never breaks the index."""
        if self._listener is None:
            return
        try:
            self._listener(key, tier, entered)
        except Exception as exc:  # events are advisory: a router missing one must not stop serving
            self.counters.add("listener_errors")
            logger.warning("tier listener failed on %s %s of chunk %s: %s", "entry to" if entered else "exit from",
                           tier, key.chunk_hash.hex()[:16], exc)

    def _new_id(self) -> int:
        cmd_id = self._next_cmd_id
        self._next_cmd_id += 1
        return cmd_id

    def _emit(self, command: Command) -> Command:
        self._outbox.append(command)
        self._pending[command.cmd_id] = _Pending(command, set(range(self.num_ranks)))
        return command

    def _reserve(self, entry: _Entry, request_id: str, reserved: set[ChunkKey]) -> None:
        entry.reservations.add(request_id)
        reserved.add(entry.key)

    def _count_requests(self, request_id: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Counts this request once per key in the reuse table; True where this lookup is the request's first ask."""
        counted = self._counted.setdefault(request_id, set())
        first = []
        for key in keys:
            new = key not in counted
            first.append(new)
            if new:
                counted.add(key)
                self._seen[key] = self._seen.pop(key, 0) + 1  # re-inserted: the table forgets the longest unasked
        while len(self._seen) > self._seen_capacity:
            self._seen.popitem(last=False)
        return first

    def _admitted(self, key: ChunkKey, gate: int) -> bool:
        """Whether a slow tier's reuse gate of `gate` lookups lets `key` in."""
        return gate == 0 or self.reuses(key) >= gate

    def _put_if_admitted(self, entry: _Entry) -> None:
        """A ready chunk that passes the gate and is not in the remote store yet is put there (slot pinned)."""
        if (not self._put_to_remote or entry.remote_put or entry.slot is None
                or entry.slot_state is not SlotState.READY or not self._admitted(entry.key, self._remote_admit_hits)):
            return
        entry.remote_put = True
        entry.readers += 1
        self._emit(Put(self._new_id(), entry.key, entry.slot))

    def _remote_present(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch existence in the remote store; a key whose promotion failed lately is a miss whatever it says (the
        store may list an object every rank cannot read, and a lookup must not promote it again every step)."""
        if self._remote_exists is None:
            return [False] * len(keys)
        try:
            present = list(self._remote_exists(keys))
        except Exception as exc:  # the remote tier must never break a lookup
            self.counters.add("remote_lookup_errors")
            logger.warning("remote existence check failed, treating as misses: %s", exc)
            return [False] * len(keys)
        present += [False] * (len(keys) - len(present))
        if self._remote_failed:
            now = time.monotonic()
            for key, until in list(self._remote_failed.items()):
                if until <= now:
                    del self._remote_failed[key]
            present = [there and key not in self._remote_failed for key, there in zip(keys, present)]
        return present

    def _occupy(self, entry: _Entry, slot: int) -> None:
        entry.slot = slot
        entry.slot_state = SlotState.WRITING
        self._slot_owner[slot] = entry.key

    def _take_slot(self) -> Optional[int]:
        """A free slot, or the least recently used unpinned ready one (spilled to disk first when possible)."""
        while True:
            if self._free_slots:
                return self._free_slots.pop()
            victim = self._arena_policy.victim(lambda key: not self._entries[key].pinned)
            if victim is None:
                return None
            entry = self._entries[victim]
            if entry.pinned or entry.slot_state is not SlotState.READY:
                raise RuntimeError(f"{self._arena_policy.name} policy proposed chunk {victim.chunk_hash.hex()[:16]}, "
                                   f"which is pinned or not ready; a policy may only propose evictable chunks")
            slot = self._evict(entry)
            if self._usable[slot]:
                return slot
            self._withheld.add(slot)  # its segment left the usable set (limit_slots): never reused

    def _evict(self, entry: _Entry) -> int:
        slot = entry.slot
        assert slot is not None
        self._detach_slot(entry, evicted=True)
        if self.disk_chunks and entry.disk is DiskState.NONE and not self._admitted(entry.key, self._disk_admit_hits):
            self.counters.add("evicted_not_reused")  # the gate keeps one-off chunks off the disk
        elif self.disk_chunks and entry.disk is DiskState.NONE:
            if self._make_disk_room():
                entry.disk = DiskState.WRITING
                self._disk_lru[entry.key] = None
                entry.disk_cmd = self._emit(Spill(self._new_id(), entry.key, slot)).cmd_id  # before the slot's reuse
                self.counters.add("spills")
            else:
                self.counters.add("evicted_lost")
        elif entry.disk is DiskState.NONE:
            self.counters.add("evicted_lost")
        self.counters.add("evictions")
        self._forget_if_empty(entry)
        return slot

    def _make_disk_room(self) -> bool:
        """Drops the least recently used disk copies until one more fits; False when every copy is being read."""
        while len(self._disk_lru) >= self.disk_chunks:
            victim = next((k for k in self._disk_lru if self._entries[k].disk_readers == 0), None)
            if victim is None:
                return False
            entry = self._entries[victim]
            self._drop_disk(entry)
            self.counters.add("disk_evictions")
            self._forget_if_empty(entry)
        return True

    def _drop_disk(self, entry: _Entry) -> None:
        if entry.disk is DiskState.PRESENT:
            self._tell(entry.key, Tier.DISK, False)
        entry.disk = DiskState.NONE
        self._disk_lru.pop(entry.key, None)
        self._emit(Drop(self._new_id(), entry.key, Tier.DISK))

    def _promote(self, entry: _Entry, source: Tier) -> bool:
        """Starts moving a disk or remote copy into a slot; False when no slot can be had."""
        if source is Tier.DISK and entry.disk is not DiskState.PRESENT:
            return False  # a spill still being written is not readable by every rank yet
        if source is Tier.DISK:
            entry.disk_readers += 1  # before _take_slot: making disk room for its spill must not drop this file
        slot = self._take_slot()
        if slot is None:
            if source is Tier.DISK:
                entry.disk_readers -= 1
            self.counters.add("promote_no_slot")
            return False
        self._occupy(entry, slot)
        if source is Tier.DISK:
            self._disk_lru.move_to_end(entry.key)
        self._emit(Promote(self._new_id(), entry.key, slot, source))
        self.counters.add(f"promotions_{source.value}")
        return True

    def _detach_slot(self, entry: _Entry, evicted: bool = False) -> None:
        """The entry no longer holds its slot (`evicted`: the policy chose it); the caller reuses or frees the slot."""
        assert entry.slot is not None
        if entry.slot_state is SlotState.READY:
            self._tell(entry.key, Tier.ARENA, False)
        self._arena_policy.remove(entry.key, evicted)
        self._slot_owner[entry.slot] = None
        entry.slot = None
        entry.slot_state = SlotState.FREE

    def _release_slot(self, entry: _Entry) -> None:
        slot = entry.slot
        self._detach_slot(entry)
        if self._usable[slot]:  # type: ignore[index]
            self._free_slots.append(slot)  # type: ignore[arg-type]
        else:
            self._withheld.add(slot)  # type: ignore[arg-type]

    def _forget_if_empty(self, entry: _Entry) -> None:
        if not entry.has_copy and not entry.pinned and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]

    def _finish(self, command: Command, failures: list[str]) -> None:
        entry = self._entries.get(command.key)
        ok = not failures
        if not ok:
            self.counters.add(f"{type(command).__name__.lower()}_failed")
            logger.warning("%s of chunk %s failed: %s", type(command).__name__, command.key.chunk_hash.hex()[:16],
                           "; ".join(failures))
        if entry is None:
            return
        if isinstance(command, Store):
            self._finish_write(entry, command.slot, ok)
            if ok and entry.slot == command.slot:
                self._put_if_admitted(entry)
            if ok and self._write_through:
                self._to_persist.append((entry.key, command.slot))
        elif isinstance(command, Promote):
            if command.source is Tier.REMOTE and not ok:
                self._remote_failed[command.key] = time.monotonic() + REMOTE_MISS_AFTER_FAILURE_S
            if command.source is Tier.REMOTE and ok:
                entry.remote_put = True  # the remote store holds it: nothing to put back
                self._tell(entry.key, Tier.REMOTE, True)
            if command.source is Tier.REMOTE and ok and self._write_through:
                self._to_persist.append((entry.key, command.slot))
            if command.source is Tier.DISK:
                entry.disk_readers -= 1
                if not ok and entry.disk is DiskState.PRESENT:
                    self._drop_disk(entry)  # some rank found its file bad: the others' copies are useless alone
            self._finish_write(entry, command.slot, ok)
            if ok and self._remote_admit_hits and entry.slot == command.slot:
                self._put_if_admitted(entry)  # reused while on disk: the gate admits it to the remote store now
        elif isinstance(command, (Load, Put)):
            entry.readers -= 1
            if isinstance(command, Put) and ok:
                self._tell(entry.key, Tier.REMOTE, True)
            if isinstance(command, Put) and not ok:
                entry.remote_put = False  # no delete: another instance may hold a good copy under the same name
        elif isinstance(command, (Spill, Persist)):
            if isinstance(command, Persist):
                entry.readers -= 1
            if entry.disk is DiskState.WRITING and entry.disk_cmd == command.cmd_id:
                if ok:
                    entry.disk = DiskState.PRESENT
                    self._tell(entry.key, Tier.DISK, True)
                else:
                    self._drop_disk(entry)
        self._forget_if_empty(entry)

    def _persist_written(self) -> None:
        """Write-through of the chunks this batch of answers made ready: Persists follow the batch's Puts, so the
        executor still sends consecutive puts as one remote batch."""
        written, self._to_persist = self._to_persist, []
        for key, slot in written:
            entry = self._entries.get(key)
            if (entry is None or entry.slot != slot or entry.slot_state is not SlotState.READY
                    or entry.disk is not DiskState.NONE):
                continue  # gone, moved, or a disk copy exists or is being written already
            if not self._make_disk_room():
                self.counters.add("persist_no_room")
                continue
            entry.disk = DiskState.WRITING
            self._disk_lru[key] = None
            entry.readers += 1  # the slot must not be evicted or reused while ranks read it
            entry.disk_cmd = self._emit(Persist(self._new_id(), key, slot)).cmd_id
            self.counters.add("persists")

    def _finish_write(self, entry: _Entry, slot: int, ok: bool) -> None:
        if entry.slot != slot or entry.slot_state is not SlotState.WRITING:
            return
        if ok:
            entry.slot_state = SlotState.READY
            self._arena_policy.insert(entry.key)
            self._tell(entry.key, Tier.ARENA, True)
        else:
            self._release_slot(entry)
