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

A pool may inherit its memory from a predecessor (`InheritedArena`: a planned hand-over, or systemd's descriptor store
after a crash): it keeps that epoch, so the engines' mappings stay valid, and rebuilds its index from the slots'
sealed envelopes (`rebuild.py`). Every store handed out voids its slot's envelope first, so a slot being written never
names its old chunk to a successor.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..store.arena import HostArena, slots_for_capacity
from ..store.commands import COMMAND_TTL_S, Completion, Load, Store, Tier
from ..store.config import StoreConfig
from ..store.executor import StoreExecutor
from ..store.factory import build_index
from ..store.index.chunk_index import ChunkIndex
from ..store.index.contract import SlotState
from ..store.keys import ChunkKey
from ..store.metrics import Metric
from ..transfer.pipeline import build_executor
from .capacity import PoolRefused, PoolShare
from .messages import Attached, PoolGeometry, lease_id
from .rebuild import ArenaRebuild, InheritedArena
from .seal_behind import SealBehind

logger = logging.getLogger(__name__)

ENGINE_SEPARATOR = "\x1f"  # between an engine's name and its request id in the index (a byte no request id holds)
PAYLOAD_SLACK = 1024  # payloads kept beyond the chunks the tiers hold: room for stores and promotions in flight
MAX_QUEUED_TIER_CHANGES = 1 << 16  # per engine between two of its calls; beyond, the oldest are dropped and counted
PUMP_IDLE_S = 0.002  # how often the pump looks for tier completions while some are outstanding


class LeaseTaken(ValueError):
    """Another live engine holds the lease of this engine name (two engines configured with one engine id)."""


@dataclass(frozen=True)
class LeaseLimits:
    """What one engine may hold of a pool it shares: its requests reserve and load at most `slot_share` of the
    pool's slots while another engine holds a lease too (alone it may use all), and a request's reservations that
    no lookup renewed for `reservation_ttl_s` are released (a hung engine pins nothing for ever)."""

    slot_share: float = 0.25
    reservation_ttl_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.slot_share <= 1:
            raise ValueError(f"a lease's slot share must be in (0, 1], got {self.slot_share}")
        if not self.reservation_ttl_s > 0:
            raise ValueError(f"the reservation TTL must be positive, got {self.reservation_ttl_s}")


@dataclass
class EngineLease:
    """What one engine holds in a pool, kept while its scheduler's connection or a worker's bound to it is open
    (before a scheduler claimed it: while any of its connections is)."""

    engine: str
    connections: set[int] = field(default_factory=set)
    token: str = ""  # issued to the scheduler that claimed the lease; "" before one did
    scheduler: Optional[int] = None  # that scheduler's connection while it is open
    bound: set[int] = field(default_factory=set)  # worker connections that presented the token
    requests: set[str] = field(default_factory=set)  # scoped request ids that may hold reservations
    commands: set[int] = field(default_factory=set)  # Store and Load commands handed to its workers
    counters: Counter = field(default_factory=Counter)  # index counter moves of its calls, not yet told to it
    looked_up: dict[str, float] = field(default_factory=dict)  # scoped request id -> its last lookup (monotonic)
    events: bool = False
    # (chunk hash, tier, entered, its event payload where an engine described it)
    tier_changes: list[tuple[bytes, Tier, bool, Optional[tuple]]] = field(default_factory=list)
    totals: Counter = field(default_factory=Counter)  # everything its calls moved, for the service's metrics


def scoped(engine: str, request_id: str) -> str:
    return f"{engine}{ENGINE_SEPARATOR}{request_id}"


def _check_engine_name(engine: object) -> None:
    if not isinstance(engine, str) or not engine or ENGINE_SEPARATOR in engine or len(engine) > 256:
        raise ValueError(f"an engine name must be 1-256 characters without \\x1f, got {engine!r}")


def _engine_of(name: str) -> str:
    """The engine a scoped request id is of (the index's holder of its reservations and loads)."""
    return name.partition(ENGINE_SEPARATOR)[0]


class NodePool:
    """`share` is this pool's part of the node (all ranks together), `tiers` the service's tier settings. Every method
    runs under the service's lock except the pump's own thread, which takes `lock`."""

    def __init__(self, geometry: PoolGeometry, share: PoolShare, tiers: StoreConfig, epoch: str, lock: threading.RLock,
                 command_ttl_s: float = COMMAND_TTL_S, inherited: Optional[InheritedArena] = None,
                 seal_behind: bool = False) -> None:
        """`inherited`: the predecessor's memory to adopt instead of making the arena (this pool owns its files from
        now on, also when it refuses them: PoolRefused when this configuration would lay the arena out otherwise).
        `seal_behind`: seal every committed store off the lock (a crash can be recovered: systemd keeps the memory)."""
        self.geometry = geometry
        self.command_ttl_s = command_ttl_s
        self.lock = lock
        self.arenas: list[HostArena] = []
        self.executors: list[StoreExecutor] = []
        world = geometry.world
        try:
            if not command_ttl_s > 0:
                raise ValueError(f"command_ttl_s must be a positive number of seconds, got {command_ttl_s!r}")
            per_rank = share.rank_store(tiers, geometry.object_bytes, world, geometry.describe())
            num_slots = slots_for_capacity(per_rank.cpu_bytes, geometry.object_bytes)
            if inherited is not None:
                _check_inherited(inherited, geometry, per_rank, num_slots)
                epoch = inherited.epoch  # the same pages: the engines' mappings of this epoch stay valid
        except BaseException:
            if inherited is not None:
                inherited.close(range(len(inherited.fds)))
            raise
        self.epoch = epoch
        self.store = per_rank
        try:
            for rank in range(world):
                arena = HostArena(num_slots, geometry.object_bytes, pinned=False, share=inherited is None,
                                  numa_node=per_rank.numa_node, segment_bytes=per_rank.arena_segment_bytes,
                                  hugepages=per_rank.hugepages, prefault=inherited is None,
                                  shared_fds=None if inherited is None else inherited.fds[rank])
                self.arenas.append(arena)
                arena.wait_ready()  # pre-faulted before any engine maps it: engines never fault the node's pages
            remote = None
            for rank in range(world):
                executor = build_executor(per_rank, rank, geometry.object_bytes, geometry.layout_fingerprint, None,
                                          geometry.namespace, arena=self.arenas[rank], remote=remote)
                remote = executor.remote  # one Mooncake client for the pool's ranks
                self.executors.append(executor)
            # command ids of an earlier run of the service must never be taken for this one's
            first_cmd_id = max(time.time_ns() // 1000, inherited.next_cmd_id if inherited is not None else 0)
            self.index: ChunkIndex = build_index(per_rank, geometry.object_bytes, world, geometry.namespace,
                                                 geometry.layout_fingerprint, remote_client=remote,
                                                 num_slots=num_slots, first_cmd_id=first_cmd_id)
        except BaseException:
            if inherited is not None:  # the ranks whose arena was made close their files with it
                inherited.close(range(len(self.arenas), len(inherited.fds)))
            self.close()
            raise
        # engine -> the lease token its scheduler held in the predecessor: given back to it alone
        self.carried_tokens: dict[str, str] = dict(inherited.tokens) if inherited is not None else {}
        self.leases: dict[str, EngineLease] = {}
        self.idle_since = time.monotonic()  # when its last lease ended (its making, before the first)
        self.writing: dict[ChunkKey, tuple[str, int]] = {}  # chunk -> (engine, store command) not committed yet
        # every device command handed out and not settled: id -> (engine, the chunk a Store writes, when it expires);
        # in hand-out order, so in expiry order (one TTL)
        self.handed: dict[int, tuple[str, Optional[ChunkKey], float]] = {}
        # the engines' lookups for status: requests looked up (Metric.LOOKUPS), hit chunks per tier (HIT_CHUNKS_*)
        self.lookup_counters: Counter = Counter()
        self.payloads: OrderedDict[ChunkKey, tuple] = OrderedDict()  # what engines described, for the others' events
        self.max_payloads = self.index.num_slots + self.index.disk_chunks + PAYLOAD_SLACK
        self.index.set_tier_listener(self._tell)
        self.index.failure_log.defer()
        self.limits = LeaseLimits()
        self.index.limit_holders(_engine_of, None)  # capped once a second engine holds a lease (_update_cap)
        self._swept = time.monotonic()
        self._notes: list[tuple[int, str, tuple]] = []  # log records made under the lock, emitted by `flush_log`
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.turned = time.monotonic()  # when the pump last held the lock (it tries every second): /healthz reads it
        self.dispatch()  # the restart's drops of partial disk copies (the pump answers them once it runs)
        self._pump = threading.Thread(target=self._pump_loop, name="lmcache-node-pump", daemon=True)
        self._pump.start()
        self.sealing: Optional[SealBehind] = SealBehind(self) if seal_behind else None
        self.rebuild: Optional[ArenaRebuild] = None
        if inherited is not None:
            self.rebuild = ArenaRebuild(self, inherited.torn)
            self.rebuild.start()
        logger.info("node cache pool %s: %d slots x %d rank(s) of %d B (%.2f GiB), %d disk chunks per rank, %s%s",
                    geometry.namespace, num_slots, world, self.arenas[0].slot_bytes, per_rank.cpu_bytes * world / 2**30,
                    self.index.disk_chunks, self.index.eviction_policy,
                    f", epoch {epoch} inherited (its index is rebuilt from the slots' envelopes)" if inherited else "")

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

    def lease(self, engine: str, connection: int, events: bool = False, limits: Optional[LeaseLimits] = None, *,
              rank: Optional[int] = None, token: str = "") -> EngineLease:
        """`connection` in `engine`'s lease. A scheduler (rank None) claims the lease and is issued its token; while
        the claimed lease lives, another scheduler under that name is refused (LeaseTaken) unless it presents the
        token (the same engine attaching again). A worker presenting the token is bound to the lease; one without it
        (workers attach before their scheduler) counts only once it joins (`join`). The token a predecessor issued
        the engine (`carried_tokens`, a hand-over) is honoured once, by the first of its scheduler and workers."""
        _check_engine_name(engine)
        lease = self.leases.get(engine)
        if lease is None:
            lease = self.leases[engine] = EngineLease(engine)
        if rank is None:
            if lease.token and token != lease.token:
                raise LeaseTaken(f"engine name {engine!r} is held by a live engine on this node (its scheduler or "
                                 "workers are attached): two engines share one kv_transfer_config.engine_id; give "
                                 "each engine (and each data-parallel deployment) its own")
            carried = self.carried_tokens.pop(engine, "")  # the predecessor's token, once, for that scheduler only
            lease.token = lease.token or (token if token and token == carried else secrets.token_hex(16))
            lease.scheduler = connection
        elif token and token == lease.token:
            lease.bound.add(connection)
        elif token and not lease.token and token == self.carried_tokens.get(engine):  # the predecessor's workers
            lease.token = self.carried_tokens.pop(engine)
            lease.bound.add(connection)
        lease.connections.add(connection)
        lease.events = lease.events or events
        if limits is not None:
            self.limits = limits
        self._update_cap()
        return lease

    def join(self, engine: str, connection: int, token: str) -> Optional[EngineLease]:
        """A worker's connection presents the token of its scheduler's lease and is bound to it; None when no live
        lease of this engine has that token (the commands of that scheduler must not run)."""
        lease = self.leases.get(engine)
        if lease is None or not token or token != lease.token:
            return None
        lease.connections.add(connection)  # it may have attached to the lease's predecessor
        lease.bound.add(connection)
        return lease

    def lease_named(self, engine: str, public_id: str) -> bool:
        """`engine` holds a live lease whose public id (`messages.lease_id`) is `public_id`."""
        lease = self.leases.get(engine)
        return lease is not None and bool(lease.token) and lease_id(lease.token) == public_id

    def _update_cap(self) -> None:
        """An engine alone in the pool may hold all of it; with others, `limits.slot_share` of its slots."""
        cap = max(1, int(self.limits.slot_share * self.index.num_slots)) if len(self.leases) > 1 else None
        self.index.limit_holders(_engine_of, cap)

    def expire_reservations(self, now: float) -> int:
        """Releases every request's reservations no lookup renewed for `limits.reservation_ttl_s` (its engine may
        still load them: a prepare_load of a chunk still ready succeeds, of one evicted since is refused, and vLLM
        recomputes it); how many requests."""
        ttl = self.limits.reservation_ttl_s
        expired = 0
        for lease in self.leases.values():
            stale = [name for name, when in lease.looked_up.items() if now - when > ttl]
            for name in stale:
                del lease.looked_up[name]
                self.index.release(name)
                lease.requests.discard(name)
            if stale:
                expired += len(stale)
                self.note(logging.WARNING, "node cache: engine %s: %d request(s) held reservations for more than "
                          "%.0f s without a lookup; released", lease.engine, len(stale), ttl)
        if expired:
            self.index.counters.add(Metric.RESERVATIONS_EXPIRED, expired)
            self.dispatch()
        return expired

    def drop_connection(self, engine: str, connection: int) -> bool:
        """The connection closed; when it was the last that holds the engine's lease, the lease ends (True). Workers
        that never joined it stay, in a new lease of the name (their scheduler may claim it later)."""
        lease = self.leases.get(engine)
        if lease is None:
            return False
        lease.connections.discard(connection)
        lease.bound.discard(connection)
        if lease.scheduler == connection:
            lease.scheduler = None
        if (lease.scheduler is not None or lease.bound) if lease.token else lease.connections:
            return False
        self.end_lease(lease)
        if lease.connections:
            self.leases[engine] = EngineLease(engine, set(lease.connections), events=lease.events)
        self._update_cap()
        return True

    def end_lease(self, lease: EngineLease) -> None:
        """The engine is gone: its reservations are released and its unanswered commands fail on every rank that
        has not answered (a store's slot is freed, a load's pin dropped)."""
        self.leases.pop(lease.engine, None)
        if not self.leases:
            self.idle_since = time.monotonic()
        for request_id in lease.requests:
            self.index.release(request_id)
        abandoned = self.index.abandon(lease.commands, f"engine {lease.engine} is gone")  # counts the pending ones
        self._settle(lease.commands)
        self.index.counters.add(Metric.LEASES_ENDED)
        self.index.counters.add(Metric.ABANDONED_COMMANDS, abandoned)
        self.index.counters.add(Metric.RELEASED_REQUESTS, len(lease.requests))
        self.dispatch()
        self.note(logging.WARNING if abandoned else logging.INFO,
                  "node cache: engine %s left; %d request(s) released, %d unanswered command(s) failed", lease.engine,
                  len(lease.requests), abandoned)

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
                for executor in self.executors:  # after any spill sealed the old chunk: the device may write now
                    executor.unseal_slot(command.slot)
            self.handed[command.cmd_id] = (lease.engine, written, expires)
        return [(command.cmd_id, command.slot, command.chunk_index, command.key.chunk_hash) for command in commands]

    def on_completions(self, lease: EngineLease, completions: Iterable[Completion]) -> None:
        completions = list(completions)
        answers = [done for done in completions if done.cmd_id in lease.commands]
        if len(answers) != len(completions):  # a predecessor's commands, or ones expired or abandoned here: no effect
            self.index.counters.add(Metric.STALE_COMPLETIONS, len(completions) - len(answers))
        self.index.on_completions(answers)
        settled = {done.cmd_id for done in answers if not self.index.is_pending(done.cmd_id)}
        lease.commands -= settled
        self._settle(settled)

    def visible(self, lease: EngineLease, keys: list[ChunkKey], count: bool = True,
                awaited: Optional[tuple[str, str]] = None) -> list[ChunkKey]:
        """The keys up to the first chunk another engine is still storing: a store is seen by other engines only
        once every rank of its engine committed it (waiting for it would spin on the socket every step, for a
        forward pass of the other engine); the engine's own stores in flight count as its index counts them, and so
        do those of `awaited` (engine, lease id) while that engine holds that very lease (a P/D hand-off names its
        prefill engine, whose stores the decode engine waits for; another lease of the name is another writer)."""
        if not self.writing:
            return keys
        waits_for = {lease.engine}
        if awaited is not None and self.lease_named(*awaited):
            waits_for.add(awaited[0])
        for position, key in enumerate(keys):
            writer = self.writing.get(key)
            if writer is not None and writer[0] not in waits_for:
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
            if handed is not None and handed[1] is not None and self.sealing is not None:
                slot, state, _ = self.index.location(handed[1])
                if slot is not None and state in (SlotState.READY, SlotState.READING):
                    self.sealing.note(slot, handed[1])

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
        self.note(logging.WARNING, "node cache %s: %d command(s) of engine(s) %s unanswered for %.0f s failed (slots "
                  "freed, pins dropped)", self.geometry.namespace, expired, sorted({engine for engine, _ in overdue}),
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
                    self.note(logging.ERROR, "node cache: command %d for engine %s issued outside its call; failed",
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

    # ---- what operators read ----------------------------------------------------------------------------------------

    def note(self, level: int, message: str, *args: Any) -> None:
        """A log record made under the lock, emitted by the next `flush_log` (a stalled log sink must never hold
        the lock every engine's verbs wait for)."""
        self._notes.append((level, message, args))

    def flush_log(self) -> None:
        """Emits what `note` kept and the index's failed commands, one line per kind and reason (an engine's death
        fails hundreds of commands at once). Called without the lock held; takes it only to take the records."""
        if not self._notes and not self.index.failure_log.kept:  # racy peek: one missed now goes with the next call
            return
        with self.lock:
            notes, self._notes = self._notes, []
            failures = self.index.failure_log.take()
        for level, message, args in notes:
            logger.log(level, message, *args)
        grouped: dict[tuple[str, str], list[str]] = {}
        for kind, chunk, why in failures:
            grouped.setdefault((kind, why), []).append(chunk)
        for (kind, why), chunks in grouped.items():
            logger.warning("node cache pool %s: %d %s command(s) failed (chunk %s%s): %s", self.geometry.namespace,
                           len(chunks), kind, chunks[0], " and others" if len(chunks) > 1 else "", why)

    # ---- tier completions -----------------------------------------------------------------------------------------

    def _pump_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(PUMP_IDLE_S if self._busy() else 1.0)
            self._wake.clear()
            with self.lock:
                self.turned = time.monotonic()
                if self._closed.is_set():
                    return
                self.pump()
                if self.turned - self._swept >= 1.0:
                    self._swept = self.turned
                    self.expire_reservations(self.turned)
                if self.handed:
                    self.expire()
            self.flush_log()

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
        for helper in (getattr(self, "rebuild", None), getattr(self, "sealing", None)):
            if helper is not None:
                helper.stop()
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


def _check_inherited(inherited: InheritedArena, geometry: PoolGeometry, store: StoreConfig, num_slots: int) -> None:
    """The predecessor's arena must be the one this configuration makes (slots, segments, pages), one file list per
    rank: otherwise a slot number would name other bytes here than in the engines' mappings."""
    ours = (num_slots, store.arena_segment_bytes, store.hugepages, geometry.world)
    theirs = (inherited.num_slots, inherited.segment_bytes, inherited.hugepages, len(inherited.fds))
    if ours != theirs:
        raise PoolRefused(f"the inherited arena of epoch {inherited.epoch} ({geometry.describe()}) has {theirs[0]} "
                          f"slots, {theirs[1]} B segments, hugepages {theirs[2]} and {theirs[3]} rank(s); this "
                          f"service's configuration makes {ours[0]} slots, {ours[1]} B segments, hugepages {ours[2]} "
                          f"and {ours[3]} rank(s) (--cpu-bytes, --max-pools, arena_segment_bytes or hugepages "
                          "changed): its chunks are not adopted, the pool starts cold")
