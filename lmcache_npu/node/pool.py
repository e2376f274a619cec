"""One geometry's share of the node cache: each rank's arena in shared memory, the index over it, the tiers behind it,
and the leases of the engines that use it.

The engines' workers move bytes between their device pages and these arenas themselves (the `Store` and `Load`
commands a verb returns go to the engine that called it); the pool's own executors, one per rank, run everything
else (spills, promotions, puts, persists, drops) against the same shared pages, so a chunk one engine stored is
promoted, spilled and loaded by every engine of the node. An engine's request ids are scoped by its name, so two
engines' requests never meet in the index; an engine whose connections are all gone gives back what its requests
reserved and its unanswered commands fail (their slots are freed, their pins dropped). A command no answer settles
within the pool's command TTL fails the same way while its engine lives (a reply the engine never read, an engine
that misbehaves): nothing is held forever.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..store.arena import HostArena, slot_bytes_for
from ..store.commands import Completion, Load, Store, Tier
from ..store.config import StoreConfig
from ..store.executor import StoreExecutor
from ..store.factory import build_executor, build_index
from ..store.index.chunk_index import ChunkIndex
from ..store.keys import ChunkKey
from ..store.metrics import Metric
from .messages import Attached, PoolGeometry

logger = logging.getLogger(__name__)

ENGINE_SEPARATOR = "\x1f"  # between an engine's name and its request id in the index (a byte no request id holds)
PAYLOAD_SLACK = 1024  # payloads kept beyond the chunks the tiers hold: room for stores and promotions in flight
MAX_QUEUED_TIER_CHANGES = 1 << 16  # per engine between two of its calls; beyond, the oldest are dropped and counted
PUMP_IDLE_S = 0.002  # how often the pump looks for tier completions while some are outstanding
# a device command unanswered this long fails (slot freed, pin dropped); longer than a worker's own deadline
# (integration/vllm/worker.COMMAND_DEADLINE_S), so a live engine's workers always answer first
COMMAND_TTL_S = 600.0


class PoolRefused(ValueError):
    """The pool cannot be made (no memory for one slot per rank, a disk tier that holds no chunk)."""


@dataclass
class EngineLease:
    """What one engine holds in a pool, kept while any of its connections is open."""

    engine: str
    connections: set[int] = field(default_factory=set)
    requests: set[str] = field(default_factory=set)  # scoped request ids that may hold reservations
    commands: set[int] = field(default_factory=set)  # Store and Load commands handed to its workers
    counters: Counter = field(default_factory=Counter)  # index counter moves of its calls, not yet told to it
    events: bool = False
    # (chunk hash, tier, entered, its event payload where an engine described it)
    tier_changes: list[tuple[bytes, Tier, bool, Optional[tuple]]] = field(default_factory=list)
    totals: Counter = field(default_factory=Counter)  # everything its calls moved, for the service's metrics


def scoped(engine: str, request_id: str) -> str:
    return f"{engine}{ENGINE_SEPARATOR}{request_id}"


class NodePool:
    """`store` is the node's configuration with `cpu_bytes` and `disk_bytes` this pool's share (all ranks together).
    Every method runs under the service's lock except the pump's own thread, which takes `lock`."""

    def __init__(self, geometry: PoolGeometry, store: StoreConfig, epoch: str, lock: threading.RLock,
                 command_ttl_s: float = COMMAND_TTL_S) -> None:
        if not command_ttl_s > 0:
            raise ValueError(f"command_ttl_s must be a positive number of seconds, got {command_ttl_s!r}")
        self.geometry = geometry
        self.command_ttl_s = command_ttl_s
        self.epoch = epoch
        self.lock = lock
        world = geometry.world
        slot_bytes = slot_bytes_for(geometry.object_bytes)
        num_slots = store.cpu_bytes // (world * slot_bytes)
        if num_slots < 1:
            raise PoolRefused(f"the node cache's {store.cpu_bytes} B for this pool hold no slot of {slot_bytes} B on "
                              f"each of {world} ranks ({geometry.describe()}); raise --cpu-bytes")
        per_rank = dataclasses.replace(store, cpu_bytes=num_slots * slot_bytes, disk_bytes=store.disk_bytes // world)
        self.store = per_rank
        self.arenas: list[HostArena] = []
        self.executors: list[StoreExecutor] = []
        try:
            for rank in range(world):
                arena = HostArena(num_slots, geometry.object_bytes, pinned=False, share=True,
                                  numa_node=store.numa_node, segment_bytes=store.arena_segment_bytes,
                                  hugepages=store.hugepages)
                self.arenas.append(arena)
                arena.wait_ready()  # pre-faulted before any engine maps it: engines never fault the node's pages
            remote = None
            for rank in range(world):
                executor = build_executor(per_rank, rank, geometry.object_bytes, geometry.layout_fingerprint, None,
                                          geometry.namespace, arena=self.arenas[rank], remote=remote)
                remote = executor.remote  # one Mooncake client for the pool's ranks
                self.executors.append(executor)
            # command ids of an earlier run of the service must never be taken for this one's
            self.index: ChunkIndex = build_index(per_rank, geometry.object_bytes, world, geometry.namespace,
                                                 geometry.layout_fingerprint, remote_client=remote,
                                                 num_slots=num_slots, first_cmd_id=time.time_ns() // 1000)
        except BaseException:
            self.close()
            raise
        self.leases: dict[str, EngineLease] = {}
        self.writing: dict[ChunkKey, tuple[str, int]] = {}  # chunk -> (engine, store command) not committed yet
        # every device command handed out and not settled: id -> (engine, the chunk a Store writes, when it expires);
        # in hand-out order, so in expiry order (one TTL)
        self.handed: dict[int, tuple[str, Optional[ChunkKey], float]] = {}
        # the engines' lookups for status: requests looked up (Metric.LOOKUPS), hit chunks per tier (HIT_CHUNKS_*)
        self.lookup_counters: Counter = Counter()
        self.payloads: OrderedDict[ChunkKey, tuple] = OrderedDict()  # what engines described, for the others' events
        self.max_payloads = self.index.num_slots + self.index.disk_chunks + PAYLOAD_SLACK
        self.index.set_tier_listener(self._tell)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.dispatch()  # the restart's drops of partial disk copies (the pump answers them once it runs)
        self._pump = threading.Thread(target=self._pump_loop, name="lmcache-node-pump", daemon=True)
        self._pump.start()
        logger.info("node cache pool %s: %d slots x %d rank(s) of %d B (%.2f GiB), %d disk chunks per rank, %s",
                    geometry.namespace, num_slots, world, slot_bytes, num_slots * world * slot_bytes / 2**30,
                    self.index.disk_chunks, self.index.eviction_policy)

    # ---- what an engine is told ---------------------------------------------------------------------------------

    def attached(self) -> Attached:
        arena = self.arenas[0]
        return Attached(epoch=self.epoch, num_slots=arena.num_slots, object_bytes=arena.object_bytes,
                        segment_bytes=self.store.arena_segment_bytes, hugepages=self.store.hugepages,
                        disk_chunks=self.index.disk_chunks, eviction_policy=self.index.eviction_policy)

    def segment_fds(self, rank: int) -> list[int]:
        if not 0 <= rank < self.geometry.world:
            raise ValueError(f"rank {rank} is not a rank of this pool ({self.geometry.world} ranks)")
        return list(self.arenas[rank].segment_fds)

    # ---- leases ---------------------------------------------------------------------------------------------------

    def lease(self, engine: str, connection: int, events: bool = False) -> EngineLease:
        lease = self.leases.get(engine)
        if lease is None:
            lease = self.leases[engine] = EngineLease(engine)
        lease.connections.add(connection)
        lease.events = lease.events or events
        return lease

    def drop_connection(self, engine: str, connection: int) -> bool:
        """The connection closed; when it was the engine's last, its lease ends (True)."""
        lease = self.leases.get(engine)
        if lease is None:
            return False
        lease.connections.discard(connection)
        if lease.connections:
            return False
        self.end_lease(lease)
        return True

    def end_lease(self, lease: EngineLease) -> None:
        """The engine is gone: its reservations are released and its unanswered commands fail on every rank that
        has not answered (a store's slot is freed, a load's pin dropped)."""
        self.leases.pop(lease.engine, None)
        for request_id in lease.requests:
            self.index.release(request_id)
        abandoned = self.index.abandon(lease.commands, f"engine {lease.engine} is gone")  # counts the pending ones
        self._settle(lease.commands)
        self.index.counters.add(Metric.LEASES_ENDED)
        self.index.counters.add(Metric.ABANDONED_COMMANDS, abandoned)
        self.index.counters.add(Metric.RELEASED_REQUESTS, len(lease.requests))
        self.dispatch()
        logger.info("node cache: engine %s left; %d request(s) released, %d unanswered command(s) failed",
                    lease.engine, len(lease.requests), abandoned)

    # ---- the verbs ------------------------------------------------------------------------------------------------

    def call(self, lease: EngineLease, verb: Callable[[], Any]) -> Any:
        """Runs one verb of `lease`'s engine: its counter moves are the engine's, its commands routed."""
        version, before = self.index.counters.versioned_snapshot()
        try:
            return verb()
        finally:
            if self.index.counters.version != version:  # most verbs of a step move no counter
                after = self.index.counters.snapshot()
                moved = {name: value - before.get(name, 0) for name, value in after.items()
                         if value != before.get(name, 0)}
                lease.counters.update(moved)
                lease.totals.update(moved)
            self.dispatch(lease)

    def hand_out(self, lease: EngineLease, commands: Sequence[Union[Store, Load]]) -> list[tuple[int, int, int, bytes]]:
        """Device commands a verb returned, now in the engine's lease, as the wire carries them: (command id, slot,
        chunk number, chunk hash) each (the engine makes its Store or Load of its own key and request id)."""
        lease.commands.update(command.cmd_id for command in commands)
        expires = time.monotonic() + self.command_ttl_s
        for command in commands:
            written = command.key if isinstance(command, Store) else None
            if written is not None:
                self.writing[written] = (lease.engine, command.cmd_id)
            self.handed[command.cmd_id] = (lease.engine, written, expires)
        return [(command.cmd_id, command.slot, command.chunk_index, command.key.chunk_hash) for command in commands]

    def on_completions(self, lease: EngineLease, completions: Iterable[Completion]) -> None:
        answers = [done for done in completions if done.cmd_id in lease.commands]
        self.index.on_completions(answers)
        settled = {done.cmd_id for done in answers if not self.index.is_pending(done.cmd_id)}
        lease.commands -= settled
        self._settle(settled)

    def visible(self, lease: EngineLease, keys: list[ChunkKey], count: bool = True) -> list[ChunkKey]:
        """The keys up to the first chunk another engine is still storing: a store is seen by other engines only
        once every rank of its engine committed it (waiting for it would spin on the socket every step, for a
        forward pass of the other engine); the engine's own stores in flight count as its index counts them."""
        if not self.writing:
            return keys
        for position, key in enumerate(keys):
            writer = self.writing.get(key)
            if writer is not None and writer[0] != lease.engine:
                if count:
                    self.index.counters.add(Metric.UNCOMMITTED_MISSES)
                return keys[:position]
        return keys

    def _settle(self, cmd_ids: Iterable[int]) -> None:
        """Forgets the settled ones of `cmd_ids` (only those: a step's answers cost no scan of the node's stores); a
        store's chunk is seen by the other engines from now on, or is gone where it failed."""
        for cmd_id in cmd_ids:
            if self.index.is_pending(cmd_id):
                continue
            handed = self.handed.pop(cmd_id, None)
            if handed is not None and handed[1] is not None and self.writing.get(handed[1]) == (handed[0], cmd_id):
                del self.writing[handed[1]]

    def expire(self, now: Optional[float] = None) -> int:
        """Fails the device commands handed out more than the TTL ago and still unanswered (their slots are freed,
        their pins dropped, as for an engine that is gone); how many."""
        now = time.monotonic() if now is None else now
        overdue = []
        for cmd_id, (engine, _, expires) in self.handed.items():
            if expires > now:
                break
            overdue.append((engine, cmd_id))
        if not overdue:
            return 0
        cmd_ids = [cmd_id for _, cmd_id in overdue]
        expired = self.index.abandon(cmd_ids, f"unanswered for {self.command_ttl_s:.0f} s")
        for engine, cmd_id in overdue:
            lease = self.leases.get(engine)
            if lease is not None:
                lease.commands.discard(cmd_id)  # a late answer is not the engine's any more
        self._settle(cmd_ids)
        self.index.counters.add(Metric.EXPIRED_COMMANDS, expired)
        self.dispatch()
        logger.warning("node cache %s: %d command(s) of engine(s) %s unanswered for %.0f s failed (slots freed, pins "
                       "dropped)", self.geometry.namespace, expired, sorted({engine for engine, _ in overdue}),
                       self.command_ttl_s)
        return expired

    def dispatch(self, caller: Optional[EngineLease] = None) -> None:
        """Routes what the index issued: device moves belong to the engine whose verb returned them; every other
        command runs now on every rank's executor (a spill copies its slot before the caller's next store can be
        handed out)."""
        tier = []
        for command in self.index.take_commands():
            if isinstance(command, (Store, Load)):
                engine = command.request_id.partition(ENGINE_SEPARATOR)[0]
                if caller is None or engine != caller.engine:  # only a verb of that engine may issue its moves
                    logger.error("node cache: command %d for engine %s issued outside its call; failed",
                                 command.cmd_id, engine)
                    self.index.abandon([command.cmd_id], "issued outside its engine's call")
                    continue
                if isinstance(command, Store):
                    for executor in self.executors:
                        executor.forget_seal(command.slot)
            else:
                tier.append(command)
        if not tier:
            return
        for executor in self.executors:
            executor.submit(tier)
        self._wake.set()

    # ---- tier completions -----------------------------------------------------------------------------------------

    def _pump_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(PUMP_IDLE_S if self._busy() else 1.0)
            self._wake.clear()
            with self.lock:
                if self._closed.is_set():
                    return
                self.pump()
                if self.handed:
                    self.expire()

    def pump(self) -> int:
        """Feeds the executors' answers to the index (and runs what that issues); how many answers there were."""
        done = [completion for executor in self.executors for completion in executor.poll()]
        if not done:
            return 0
        self.index.on_completions(done)
        self.dispatch()
        return len(done)

    def _busy(self) -> bool:
        return not all(executor.wait_idle(0) for executor in self.executors)

    def drain(self, timeout: float = 10.0) -> None:
        """Waits until every tier command answered (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.index.in_flight and time.monotonic() < deadline:
            for executor in self.executors:
                executor.wait_idle(max(0.0, deadline - time.monotonic()))
            with self.lock:
                if not self.pump():
                    break

    # ---- what routers hear --------------------------------------------------------------------------------------

    def describe(self, key: ChunkKey, payload: tuple) -> None:
        self.payloads[key] = payload
        self.payloads.move_to_end(key)
        while len(self.payloads) > self.max_payloads:
            self.payloads.popitem(last=False)

    def _tell(self, key: ChunkKey, tier: Tier, entered: bool) -> None:
        payload = self.payloads.get(key) if entered else None
        for lease in self.leases.values():
            if not lease.events:
                continue
            if len(lease.tier_changes) >= MAX_QUEUED_TIER_CHANGES:
                del lease.tier_changes[0]
                self.index.counters.add(Metric.DROPPED)
            lease.tier_changes.append((key.chunk_hash, tier, entered, payload))  # the pool's namespace: the engine's

    def close(self) -> None:
        pump = getattr(self, "_pump", None)  # a pool whose making failed has no pump yet
        if pump is not None:
            self._closed.set()
            self._wake.set()
            pump.join(timeout=5)
        for executor in self.executors:
            executor.close()
        for arena in self.arenas:
            arena.memory.close_segment_files()
            arena.close()
