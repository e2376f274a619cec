"""The in-process chunk manager (DESIGN §7, `contract.ChunkManager`): which chunk is where, and the commands that move it.

Only this object changes slot states. It answers lookups from its own tables (no RPC to workers), allocates arena
slots for stores, orders ready slots for eviction with a policy (`policies/`: LRU, ARC, S3-FIFO) while pins keep
in-flight work, spills what it evicts to disk when a disk tier exists (with write-through, stored chunks are written
to disk at once, so they survive a restart), promotes disk/remote chunks into the arena before a load, and emits
every byte move as a command (`commands.py`) for all ranks. A command's effect becomes visible here only once every
rank has completed it.

With a reuse gate (`reuse_gate.py`) the Mooncake put is issued at the lookup that admits the chunk (or when it
becomes ready after it); an evicted chunk is spilled only if it passed the disk gate. Write-through to disk, when on,
still writes every chunk at once.

Slot life: free → writing (a store or a promotion in flight) → ready (in the policy) → reading (pinned by in-flight
loads, puts or persists) → ready. A slot that is writing, pinned or reserved by a request between its lookup and its
load is never evicted or reused, whatever the policy proposes.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Sequence, Union

from ...checks import check_int
from ..commands import Command, Completion, Drop, Load, Persist, Promote, Put, Spill, Store, Tier
from ..keys import ChunkKey
from ..policies import EvictionPolicy, make_policy
from ..tier import TierCounters
from .contract import (Admission, ChunkManager, ChunkManagerView, ChunkView, DiskState, LookupResult, NumberedChunks,
                       RemoteExists, SlotState, TierListener)
from .adoption import RestartAdoption
from .disk_catalog import DiskCatalog
from .entry import Entry
from .failure_log import FailureLog
from .holders import Holders
from .ledger import CommandLedger
from .remote_presence import RemotePresence
from .reuse_gate import ReuseGate
from .slots import SlotTable
from ..metrics import Metric

logger = logging.getLogger(__name__)

_FAILED = {Store: Metric.STORE_FAILED, Load: Metric.LOAD_FAILED, Spill: Metric.SPILL_FAILED,
           Promote: Metric.PROMOTE_FAILED, Put: Metric.PUT_FAILED, Persist: Metric.PERSIST_FAILED,
           Drop: Metric.DROP_FAILED}  # a command that failed on some rank counts under its kind


class ChunkIndex(RestartAdoption, ChunkManager, ChunkManagerView):
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
                 remote_admit_hits: int = 0, disk_admit_hits: int = 0, first_cmd_id: int = 1) -> None:
        if num_slots < 1 or num_ranks < 1 or disk_chunks < 0:
            raise ValueError(f"index needs num_slots >= 1, num_ranks >= 1, disk_chunks >= 0 "
                             f"(got {num_slots}, {num_ranks}, {disk_chunks})")
        check_int("remote_admit_hits", remote_admit_hits, lo=0)  # 0: no reuse gate
        check_int("disk_admit_hits", disk_admit_hits, lo=0)
        policy = make_policy(eviction_policy, num_slots) if isinstance(eviction_policy, str) else eviction_policy
        if not isinstance(policy, EvictionPolicy) or policy.capacity != num_slots or len(policy):
            raise ValueError(f"eviction_policy must be a policy name or an empty EvictionPolicy of {num_slots} "
                             f"slots, got {eviction_policy!r}")
        self.num_slots = num_slots
        self.num_ranks = num_ranks
        self.disk_chunks = disk_chunks
        self.counters = TierCounters()
        self._slots = SlotTable(num_slots, policy)
        self._disk = DiskCatalog(disk_chunks)
        self._ledger = CommandLedger(num_ranks, self.counters, check_int("first_cmd_id", first_cmd_id, lo=1))
        self._remote = RemotePresence(remote_exists, self.counters)
        self.remote_configured = remote_exists is not None
        self._gate = ReuseGate(num_slots + disk_chunks, remote_admit_hits, disk_admit_hits)
        self._put_to_remote = put_to_remote and remote_exists is not None
        self._write_through = disk_write_through and disk_chunks > 0
        self._to_persist: list[tuple[ChunkKey, int]] = []  # (key, slot) written to the arena by this batch of answers
        self._entries: dict[ChunkKey, Entry] = {}
        self._reserved: dict[str, set[ChunkKey]] = {}
        self._listener: Optional[TierListener] = None  # KV events for routers; None costs one check per change
        self.failure_log = FailureLog()  # how failed commands are reported (the node cache defers them)
        self.holders: Optional[Holders] = None  # who holds which chunks (limit_holders)
        self.admission: Optional[Admission] = None  # the cost model's say on slow-tier writes (None: the gates only)

    # ---- the contract -------------------------------------------------------------------------------------------

    def lookup(self, request_id: str, keys: Sequence[ChunkKey]) -> LookupResult:
        """The longest prefix of `keys` held by some tier. Chunks found on disk or remote are promoted into the
        arena (commands in the outbox); every hit chunk is reserved for `request_id` until `prepare_load` or
        `release`. Calling it again for the same request is cheap and issues nothing twice."""
        hit = ready = 0
        reserved = self._reserved.setdefault(request_id, set())
        held_before = set(reserved)
        for key in keys:  # pin what the arena already holds first: promotions below must not evict our own hits
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None and not self._reserve(entry, request_id, reserved):
                break  # its holder holds all it may: the hit ends here
        first_ask = self._gate.count(request_id, keys)
        gated_puts = self._gate.gates(Tier.REMOTE)
        remote_from, remote_present = 0, None  # asked once, for the keys from the first local miss on
        sources: list[Tier] = []
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None:
                if self.holders is not None and self.holders.cap is not None and request_id not in entry.reservations:
                    break  # not reserved above: its holder's cap
                if entry.slot_state is SlotState.READY:
                    self._slots.policy.touch(key, reuse=first_ask[position])
                    ready += ready == position
                    if first_ask[position] and gated_puts:
                        self._put_if_admitted(entry)
                sources.append(Tier.ARENA)
            elif entry is not None and entry.disk is DiskState.PRESENT:
                if not self._reserve(entry, request_id, reserved) or not self._promote(entry, Tier.DISK):
                    break
                sources.append(Tier.DISK)
            else:
                if remote_present is None:
                    remote_from, remote_present = position, self._remote.present(keys[position:])
                if not remote_present[position - remote_from]:
                    break
                entry = self._entries.setdefault(key, Entry(key))
                # reserved: kept while its own promotion may evict and drop; not: forgotten (it holds nothing)
                if not self._reserve(entry, request_id, reserved) or not self._promote(entry, Tier.REMOTE):
                    self._forget_if_empty(entry)
                    break
                sources.append(Tier.REMOTE)
            hit += 1
        for key in keys[hit:]:  # what lies past the hit prefix is not this request's to hold
            entry = self._entries.get(key)
            if key in reserved and key not in held_before and entry is not None:
                reserved.discard(key)
                self._unreserve(entry, request_id)
                self._forget_if_empty(entry)
        self.counters.add(Metric.LOOKUP_CHUNKS, len(keys))
        self.counters.add(Metric.LOOKUP_HIT_CHUNKS, hit)
        return LookupResult(hit, ready, tuple(sources[:hit]))

    def locate(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """`lookup`'s answer without its reservations and promotions (a holder's cap is not asked: it is lookup's)."""
        ready = 0
        sources: list[Tier] = []
        remote_from, remote_present = 0, None
        for position, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None:
                ready += ready == position and entry.slot_state is SlotState.READY
                sources.append(Tier.ARENA)
            elif entry is not None and entry.disk is DiskState.PRESENT:
                sources.append(Tier.DISK)
            else:
                if remote_present is None:
                    remote_from, remote_present = position, self._remote.peek(keys[position:])
                if not remote_present[position - remote_from]:
                    break
                sources.append(Tier.REMOTE)
        return LookupResult(len(sources), ready, tuple(sources))

    def presence(self, keys: Sequence[ChunkKey], remote: bool = True) -> list[bool]:
        """Whether some tier holds each key (the arena, a complete disk copy, or with `remote` the remote store), as
        `lookup` would find it, without reserving or promoting anything; one remote existence batch for the keys not
        held locally."""
        held = []
        for key in keys:
            entry = self._entries.get(key)
            held.append(entry is not None and (entry.slot is not None or entry.disk is DiskState.PRESENT))
        missing = [key for key, here in zip(keys, held) if not here]
        found = iter(self._remote.present(missing) if missing and remote else [False] * len(missing))
        return [here or next(found) for here in held]

    def limit_holders(self, holder_of: Callable[[str], str], cap: Optional[int]) -> None:
        """Counts per holder (the node's engines) the chunks its requests reserve or load (holders.py); a lookup's
        hit ends where `cap` would be passed (`lease_cap_misses`). First call before any lookup; later: the cap."""
        if self.holders is None:
            self.holders = Holders(holder_of)
        self.holders.cap = cap

    def prefetch_remote(self, keys: Sequence[ChunkKey]) -> None:
        """What a lookup/presence of `keys` will ask the remote store, asked now (the node cache, before its lock)."""
        self._remote.prefetch_from_first(keys, lambda key: (entry := self._entries.get(key)) is not None and (
            entry.slot is not None or entry.disk is DiskState.PRESENT))  # read only: a stale read costs an ask

    def prepare_load(self, request_id: str, chunks: NumberedChunks) -> list[Load]:
        """Loads for the request's chunks (chunk number, key); each must be ready (a lookup said so). Checked for
        all chunks before any load is issued: on error nothing is."""
        for chunk_index, key in chunks:
            entry = self._entries.get(key)
            if entry is None or entry.slot_state is not SlotState.READY:
                state = "absent" if entry is None else entry.slot_state.value
                raise ValueError(f"request {request_id!r} chunk {chunk_index}: key {key.chunk_hash.hex()} is {state} "
                                 f"in the arena; prepare_load needs a ready chunk (lookup reports ready_chunks)")
        loads = []
        reserved = self._reserved.get(request_id, set())
        for chunk_index, key in chunks:
            entry = self._entries[key]
            entry.readers += 1
            if self.holders is not None:  # the load holds what the reservation held, until every rank answered
                self.holders.hold(entry, request_id)
            if key in reserved:
                reserved.discard(key)
                self._unreserve(entry, request_id)
            self._slots.policy.touch(key, reuse=False)
            loads.append(self._emit(Load(self._ledger.new_id(), key, entry.slot, request_id,  # type: ignore[arg-type]
                                         chunk_index)))
        self.counters.add(Metric.LOADS, len(loads))
        return loads  # type: ignore[return-value]

    def release(self, request_id: str) -> None:
        """The request will not load what its lookups reserved (finished, aborted or loaded)."""
        self._gate.forget(request_id)
        for key in self._reserved.pop(request_id, set()):
            entry = self._entries.get(key)
            if entry is not None:
                self._unreserve(entry, request_id)
                self._forget_if_empty(entry)

    def prepare_store(self, request_id: str, chunks: NumberedChunks) -> list[Store]:
        """Stores for the request's computed chunks not already held in the arena or on disk. When every slot is
        pinned, the remaining chunks are not stored (counter `store_no_slot`)."""
        stores = []
        for chunk_index, key in chunks:
            entry = self._entries.get(key)
            if entry is not None and entry.has_copy:
                if entry.slot_state is SlotState.READY:
                    self._slots.policy.touch(key, reuse=False)  # the lookups count reuse, not re-stores
                continue
            slot = self._take_slot()
            if slot is None:
                self.counters.add(Metric.STORE_NO_SLOT, len(chunks) - len(stores))
                break
            entry = self._entries.setdefault(key, Entry(key))
            entry.chunk_index = chunk_index
            self._occupy(entry, slot)
            stores.append(self._emit(Store(self._ledger.new_id(), key, slot, request_id, chunk_index)))
        self.counters.add(Metric.STORES, len(stores))
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
        return self._ledger.take()

    def queued_commands(self) -> tuple[Command, ...]:
        return self._ledger.queued()

    def on_completions(self, completions: Iterable[Completion]) -> None:
        for command, failures in self._ledger.answer(completions):
            self._finish(command, failures)
        self._persist_written()

    @property
    def in_flight(self) -> int:
        return self._ledger.in_flight

    def is_pending(self, cmd_id: int) -> bool:
        return self._ledger.is_pending(cmd_id)

    def abandon(self, cmd_ids: Iterable[int], reason: str) -> int:
        """Fails every rank's missing answer to `cmd_ids` (their workers are gone: an engine that died holding
        them), so their slots and pins are given back as for any failed command; returns how many were pending."""
        failed = [Completion(cmd_id, rank, False, reason) for cmd_id in cmd_ids
                  for rank in sorted(self._ledger.waiting_ranks(cmd_id))]
        with self.failure_log.quieted(), self._slots.quarantining():  # reported by the caller; slots rest first
            self.on_completions(failed)
        return len({done.cmd_id for done in failed})

    def pending_command_ids(self) -> tuple[int, ...]:
        """Commands some rank has not answered, oldest first (benches answer them all)."""
        return self._ledger.pending_ids()

    def limit_slots(self, usable: Union[int, Sequence[tuple[int, int]]]) -> None:
        """Hands out only slots in `usable`: [first, end) slot ranges (those of the arena segments live on every
        rank), or an int n for the first n. Slots leaving the set are withheld once free (a chunk in one keeps it
        until it goes); slots entering it become free at once."""
        self._slots.limit(usable)

    @property
    def usable_slots(self) -> int:
        """How many slots the index may hand out (those of live arena segments)."""
        return self._slots.usable_count

    @property
    def free_slots(self) -> int:
        """Usable slots no chunk holds."""
        return self._slots.free_count

    def occupancy(self) -> dict[Tier, tuple[int, int]]:
        """Per local tier, (chunks held, capacity): the arena counts slots being written too and has the usable slots
        (live segments) as capacity, the disk counts files being written too (what `lmcache-npu status` shows)."""
        return {Tier.ARENA: (self._slots.held, self._slots.usable_count), Tier.DISK: (len(self._disk), self.disk_chunks)}

    @property
    def eviction_policy(self) -> str:
        return self._slots.policy.name

    def reuses(self, key: ChunkKey) -> int:
        """How many requests after the first looked `key` up, as far as the bounded reuse table remembers."""
        return self._gate.reuses(key)

    def location(self, key: ChunkKey) -> tuple[Optional[int], SlotState, DiskState]:
        entry = self._entries.get(key)
        if entry is None:
            return None, SlotState.FREE, DiskState.NONE
        return entry.slot, self._reported_state(entry), entry.disk

    def chunks(self) -> list[ChunkView]:
        return [ChunkView(e.key, e.slot, self._reported_state(e), e.disk, e.readers, frozenset(e.reservations),
                          e.disk_readers) for e in self._entries.values()]

    def check_invariants(self) -> None:
        """Raises AssertionError when the tables disagree (tests call this after every step)."""
        owners = {}
        policy = self._slots.policy
        for key, entry in self._entries.items():
            assert entry.has_copy or entry.reservations or entry.readers, f"{key} has no copy and is kept"
            if entry.slot is not None:
                assert entry.slot not in owners, f"slot {entry.slot} has two owners"
                owners[entry.slot] = key
                assert (key in policy) == (entry.slot_state is SlotState.READY)
            else:
                assert entry.slot_state is SlotState.FREE and key not in policy
            assert (key in self._disk) == (entry.disk is not DiskState.NONE)
            assert entry.readers >= 0 and entry.disk_readers >= 0
        self._slots.check_invariants(owners)
        assert len(self._disk) <= self.disk_chunks
        if self.holders is not None:
            self.holders.check_invariants(self._entries.values())
        ready = sum(entry.slot_state is SlotState.READY for entry in self._entries.values())
        assert len(policy) == ready, f"policy holds {len(policy)} chunks, {ready} are ready"
        assert len(self._gate) <= self._gate.capacity

    # ---- internals ----------------------------------------------------------------------------------------------

    @staticmethod
    def _reported_state(entry: Entry) -> SlotState:
        return SlotState.READING if entry.slot_state is SlotState.READY and entry.readers else entry.slot_state

    def _tell(self, key: ChunkKey, tier: Tier, entered: bool) -> None:
        """Tells the listener a chunk entered or left a tier; a failing listener never breaks the index."""
        if self._listener is None:
            return
        try:
            self._listener(key, tier, entered)
        except Exception as exc:  # events are advisory: a router missing one must not stop serving
            self.counters.add(Metric.LISTENER_ERRORS)
            logger.warning("tier listener failed on %s %s of chunk %s: %s", "entry to" if entered else "exit from",
                           tier, key.chunk_hash.hex()[:16], exc)

    def _emit(self, command: Command) -> Command:
        return self._ledger.emit(command)

    def _reserve(self, entry: Entry, request_id: str, reserved: set[ChunkKey]) -> bool:
        if self.holders is not None and not self.holders.reserve(entry, request_id):
            self.counters.add(Metric.LEASE_CAP_MISSES)
            return False
        entry.reservations.add(request_id)
        reserved.add(entry.key)
        return True

    def _unreserve(self, entry: Entry, request_id: str) -> None:
        if self.holders is not None:
            self.holders.unreserve(entry, request_id)
        entry.reservations.discard(request_id)

    def _put_if_admitted(self, entry: Entry) -> None:
        """A ready chunk that passes the gate and is not in the remote store yet is put there (slot pinned)."""
        if (not self._put_to_remote or entry.remote_put or entry.slot is None
                or entry.slot_state is not SlotState.READY or not self._gate.admits(entry.key, Tier.REMOTE)
                or not self._pays(entry, Tier.REMOTE)):
            return
        entry.remote_put = True
        entry.readers += 1
        self._emit(Put(self._ledger.new_id(), entry.key, entry.slot))

    def _pays(self, entry: Entry, tier: Tier) -> bool:
        """Whether the cost model admits a copy of `entry` to a slow tier; a decline is counted."""
        if self.admission is None or self.admission(tier, entry.chunk_index, self._gate.reuses(entry.key)):
            return True
        self.counters.add(Metric.COST_DECLINED_DISK_WRITES if tier is Tier.DISK else Metric.COST_DECLINED_REMOTE_PUTS)
        return False

    def _occupy(self, entry: Entry, slot: int) -> None:
        entry.slot = slot
        entry.slot_state = SlotState.WRITING
        self._slots.occupy(slot, entry.key)

    def _take_slot(self) -> Optional[int]:
        """A free slot, or the policy's victim among the unpinned ready ones (spilled to disk first when possible)."""
        while True:
            slot = self._slots.pop_free()
            if slot is not None:
                return slot
            victim = self._slots.policy.victim(lambda key: not self._entries[key].pinned)
            if victim is None:
                return None
            entry = self._entries[victim]
            if entry.pinned or entry.slot_state is not SlotState.READY:
                raise RuntimeError(f"{self._slots.policy.name} policy proposed chunk {victim.chunk_hash.hex()[:16]}, "
                                   f"which is pinned or not ready; a policy may only propose evictable chunks")
            slot = self._evict(entry)
            if self._slots.is_usable(slot):
                return slot
            self._slots.withhold(slot)  # its segment left the usable set (limit_slots): never reused

    def _evict(self, entry: Entry) -> int:
        slot = entry.slot
        assert slot is not None
        self._detach_slot(entry, evicted=True)
        if self.disk_chunks and entry.disk is DiskState.NONE and not self._gate.admits(entry.key, Tier.DISK):
            self.counters.add(Metric.EVICTED_NOT_REUSED)  # the gate keeps one-off chunks off the disk
        elif self.disk_chunks and entry.disk is DiskState.NONE and self._pays(entry, Tier.DISK):
            if self._make_disk_room():
                entry.disk = DiskState.WRITING
                self._disk.add(entry.key)
                entry.disk_cmd = self._emit(Spill(self._ledger.new_id(), entry.key, slot)).cmd_id  # before reuse
                self.counters.add(Metric.SPILLS)
            else:
                self.counters.add(Metric.EVICTED_LOST)
        elif entry.disk is DiskState.NONE:
            self.counters.add(Metric.EVICTED_LOST)
        self.counters.add(Metric.EVICTIONS)
        self._forget_if_empty(entry)
        return slot

    def _make_disk_room(self) -> bool:
        """Drops the least recently used disk copies until one more fits; False when every copy is being read."""
        while self._disk.full():
            victim = self._disk.victim(lambda key: self._entries[key].disk_readers == 0)
            if victim is None:
                return False
            entry = self._entries[victim]
            self._drop_disk(entry)
            self.counters.add(Metric.DISK_EVICTIONS)
            self._forget_if_empty(entry)
        return True

    def _drop_disk(self, entry: Entry) -> None:
        if entry.disk is DiskState.PRESENT:
            self._tell(entry.key, Tier.DISK, False)
        entry.disk = DiskState.NONE
        self._disk.discard(entry.key)
        self._emit(Drop(self._ledger.new_id(), entry.key, Tier.DISK))

    def _promote(self, entry: Entry, source: Tier) -> bool:
        """Starts moving a disk or remote copy into a slot; False when no slot can be had."""
        if source is Tier.DISK and entry.disk is not DiskState.PRESENT:
            return False  # a spill still being written is not readable by every rank yet
        if source is Tier.DISK:
            entry.disk_readers += 1  # before _take_slot: making disk room for its spill must not drop this file
        slot = self._take_slot()
        if slot is None:
            if source is Tier.DISK:
                entry.disk_readers -= 1
            self.counters.add(Metric.PROMOTE_NO_SLOT)
            return False
        self._occupy(entry, slot)
        if source is Tier.DISK:
            self._disk.touch(entry.key)
        self._emit(Promote(self._ledger.new_id(), entry.key, slot, source))
        self.counters.add(Metric.PROMOTIONS_DISK if source is Tier.DISK else Metric.PROMOTIONS_REMOTE)
        return True

    def _detach_slot(self, entry: Entry, evicted: bool = False) -> None:
        """The entry no longer holds its slot (`evicted`: the policy chose it); the caller reuses or frees the slot."""
        assert entry.slot is not None
        if entry.slot_state is SlotState.READY:
            self._tell(entry.key, Tier.ARENA, False)
        self._slots.policy.remove(entry.key, evicted)
        self._slots.vacate(entry.slot)
        entry.slot = None
        entry.slot_state = SlotState.FREE

    def _release_slot(self, entry: Entry) -> None:
        slot = entry.slot
        assert slot is not None
        self._detach_slot(entry)
        self._slots.give_back(slot)

    def _forget_if_empty(self, entry: Entry) -> None:
        if not entry.has_copy and not entry.pinned and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]

    # ---- a command's effect, once every rank answered: one method per kind -------------------------------------

    def _finish(self, command: Command, failures: list[str]) -> None:
        ok = not failures
        if not ok:
            self.counters.add(_FAILED[type(command)])
            self.failure_log.report(command, failures)
        entry = self._entries.get(command.key)
        if entry is None:
            return
        finish = self._FINISH.get(type(command))
        if finish is not None:
            finish(self, entry, command, ok)
        self._forget_if_empty(entry)

    def _finish_store(self, entry: Entry, command: Store, ok: bool) -> None:
        self._finish_write(entry, command.slot, ok)
        if ok and entry.slot == command.slot:
            self._put_if_admitted(entry)
        if ok and self._write_through:
            self._to_persist.append((entry.key, command.slot))

    def _finish_promote(self, entry: Entry, command: Promote, ok: bool) -> None:
        if command.source is Tier.REMOTE:
            if not ok:
                self._remote.promotion_failed(command.key)
            else:
                entry.remote_put = True  # the remote store holds it: nothing to put back
                self._tell(entry.key, Tier.REMOTE, True)
                if self._write_through:
                    self._to_persist.append((entry.key, command.slot))
        if command.source is Tier.DISK:
            entry.disk_readers -= 1
            if not ok and entry.disk is DiskState.PRESENT:
                self._drop_disk(entry)  # some rank found its file bad: the others' copies are useless alone
        self._finish_write(entry, command.slot, ok)
        if ok and self._gate.gates(Tier.REMOTE) and entry.slot == command.slot:
            self._put_if_admitted(entry)  # reused while on disk: the gate admits it to the remote store now

    def _finish_load(self, entry: Entry, command: Load, ok: bool) -> None:
        entry.readers -= 1
        if self.holders is not None:
            self.holders.unhold(entry, command.request_id)

    def _finish_put(self, entry: Entry, command: Put, ok: bool) -> None:
        entry.readers -= 1
        if ok:
            self._tell(entry.key, Tier.REMOTE, True)
        else:
            entry.remote_put = False  # no delete: another instance may hold a good copy under the same name

    def _finish_disk_write(self, entry: Entry, command: Union[Spill, Persist], ok: bool) -> None:
        if isinstance(command, Persist):
            entry.readers -= 1
        if entry.disk is DiskState.WRITING and entry.disk_cmd == command.cmd_id:
            if ok:
                entry.disk = DiskState.PRESENT
                self._tell(entry.key, Tier.DISK, True)
            else:
                self._drop_disk(entry)

    _FINISH = {Store: _finish_store, Promote: _finish_promote, Load: _finish_load, Put: _finish_put,
               Spill: _finish_disk_write, Persist: _finish_disk_write}  # Drop: nothing to undo or confirm

    def _persist_written(self) -> None:
        """Write-through of the chunks this batch of answers made ready: Persists follow the batch's Puts, so the
        executor still sends consecutive puts as one remote batch."""
        written, self._to_persist = self._to_persist, []
        for key, slot in written:
            entry = self._entries.get(key)
            if (entry is None or entry.slot != slot or entry.slot_state is not SlotState.READY
                    or entry.disk is not DiskState.NONE):
                continue  # gone, moved, or a disk copy exists or is being written already
            if not self._pays(entry, Tier.DISK):
                continue
            if not self._make_disk_room():
                self.counters.add(Metric.PERSIST_NO_ROOM)
                continue
            entry.disk = DiskState.WRITING
            self._disk.add(key)
            entry.readers += 1  # the slot must not be evicted or reused while ranks read it
            entry.disk_cmd = self._emit(Persist(self._ledger.new_id(), key, slot)).cmd_id
            self.counters.add(Metric.PERSISTS)

    def _finish_write(self, entry: Entry, slot: int, ok: bool) -> None:
        if entry.slot != slot or entry.slot_state is not SlotState.WRITING:
            return
        if ok:
            entry.slot_state = SlotState.READY
            self._slots.policy.insert(entry.key)
            self._tell(entry.key, Tier.ARENA, True)
        else:
            self._release_slot(entry)
