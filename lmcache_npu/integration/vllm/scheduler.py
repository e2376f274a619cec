"""The connector's scheduler half: which chunks a request can load, which chunks a step stores, and the store
index's commands for every rank (DESIGN §7-§8).

It owns the chunk manager (`store/index/contract.ChunkManager`, in process a `ChunkIndex`); workers only move
bytes. Per request it keeps a mirror of the block table (from the scheduler output), the next chunk to consider for
storing, and the commands still in flight. A chunk is keyed by vLLM's block hash at its last token; a chunk whose
recurrent (end-state) rows vLLM did not keep is stored under a second key that can sit inside a hit but never end
one.

The lookup rules (end state, the EAGLE one-chunk drop) are in lookup.py, store planning in store_planner.py, the
page fence in fence.py; this module keeps the request state and runs the steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ...config import ConnectorConfig
from ...layout.discovery import LayoutGroup
from ...store.commands import DeviceMove, Load, Store, Tier
from ...store.cost import SlowTierAdmission
from ...store.factory import scheduler_mooncake_client
from ...store.index.contract import ChunkManager, ChunkManagerView, LookupResult
from ...store.keys import ChunkKey, check_stable_hashing, chunk_keys
from ...store.tier import TierCounters
from . import adapter, lookup
from .events import PAYLOAD_SLACK, ChunkPayload, KVEvents, kv_events_enabled
from .lora_identity import LoadedAdapters
from .manager_factory import build_manager
from .fence import PageFence, StepWrites, WriteGeometry
from ...transfer.plans import LoadPlan, StorePlan
from .metadata import LMCacheNPUConnectorMetadata, LMCacheNPUWorkerMetadata, WorkerGeometry, usable_on_every_rank
from .store_planner import StorePlanner
from .stats import INDEX_METRICS, CounterDeltas, LMCacheNPUStats
from .store_gauges import StoreGauges
from .cut_point import CutPoint, hit_shape
from ...store.metrics import HIT_CHUNKS, Metric

logger = logging.getLogger(__name__)
# outputs of the workers a lookup waits for their plans through (they come with the first: more means they never will)
PLAN_WAIT_OUTPUTS = 8


@dataclass
class _Lookup:
    """The last hit answered for a request, kept until `update_state_after_alloc` turns it into loads."""

    first_chunk: int
    keys: list[ChunkKey]  # the chosen key of each hit chunk (complete or without end state)
    num_computed_tokens: int


@dataclass
class _Request:
    request: Any  # vLLM's Request: block hashes, token counts, status
    blocks: list[list[int]] = field(default_factory=list)  # mirror of the block table, per scheduler group
    next_chunk: int = 0  # chunks before it are stored, held, or passed over
    stores: set[int] = field(default_factory=set)  # store cmd ids not yet completed by every rank
    loads: set[int] = field(default_factory=set)
    lookup: Optional[_Lookup] = None
    found_in: dict[int, Tier] = field(default_factory=dict)  # chunk -> the tier its first lookup found it in
    keys: list[ChunkKey] = field(default_factory=list)  # of chunks 0.. whose hashes exist
    asked: Optional[int] = None  # tokens vLLM had computed when it last asked for a hit (counted at allocation)
    finished: bool = False
    no_hits: bool = False  # a load of this request failed: it recomputes, and never loads again
    adapter_digest: Optional[bytes] = None  # the content of the request's LoRA adapter: re-keys its chunks
    bypass: bool = False  # a LoRA adapter nothing may name (lora_identity.py): no loads or stores, vLLM computes


def _warn_about_failed_loads(channel: adapter.FailureChannel, policy: str) -> None:
    """Once per engine: what a chunk that cannot be loaded (a lost disk file, a remote fault) does to a request."""
    if channel is adapter.FailureChannel.NONE:
        logger.warning("lmcache_npu: this vLLM cannot be told a load of a model with several KV-cache groups failed "
                       "(vLLM >= 0.30 can): a failed load stops the engine rather than serve KV that may be wrong")
    elif policy != "recompute":
        logger.warning("lmcache_npu: kv_load_failure_policy is %r: a chunk that cannot be loaded fails its request; "
                       "'recompute' computes those tokens instead", policy)


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.stores_enabled, self.loads_enabled = adapter.kv_role(vllm_config)
        self.place = adapter.parallel_place(vllm_config)
        self.scheduler_block_size, self.hash_block_size = adapter.block_sizes(kv_cache_config, vllm_config)
        self.num_scheduler_groups = len(kv_cache_config.kv_cache_groups)
        self.failure_channel = adapter.failure_channel(self.num_scheduler_groups)
        # an EAGLE/MTP drafter: a hit ends one chunk before the last chunk held (lookup.py says why)
        self.eagle_block_drop = adapter.eagle_block_drop(vllm_config)
        _warn_about_failed_loads(self.failure_channel, adapter.load_failure_policy(vllm_config))
        if config.store.disk_path is not None or config.store.mooncake is not None or config.node_cache is not None:
            # chunks outliving this process must be named the same by the next one (and by other instances)
            check_stable_hashing(adapter.hash_algorithm(vllm_config),
                                 allow_fast_block_hash=config.allow_fast_block_hash)
        # from the workers' handshake: the plan's chunk size and groups
        self.chunk_tokens = 0
        self.groups: tuple[LayoutGroup, ...] = ()
        self.planner = StorePlanner.of((), 0, self.num_scheduler_groups, self.scheduler_block_size)
        self.has_end_state = False
        self.index: Optional[ChunkManager] = None  # codes against the contract's verbs only
        self.view: Optional[ChunkManagerView] = None  # the same manager's holdings, for the gauges
        self._remote: Optional[Any] = None  # the Mooncake client for existence checks, closed at shutdown
        self.namespace = ""
        self.requests: dict[str, _Request] = {}
        self.counters = TierCounters()
        self.index_counters = CounterDeltas()  # the index's own counters, once the handshake built it
        self._owner: dict[int, _Request] = {}  # in-flight store/load cmd id -> its request
        self._loads: list[LoadPlan] = []
        self._delayed_free: list[str] = []
        self.fence = PageFence(WriteGeometry.of(self.groups, self.num_scheduler_groups))
        self._warned_idle = False
        self._geometry_known = False  # every rank's plan arrived (the index is built, or the plugin is idle)
        self._plans: dict[int, WorkerGeometry] = {}  # rank -> the plan its step metadata carried (MultiConnector)
        self._outputs_without_plans = 0  # workers' outputs seen before every plan arrived
        self.composed = False  # the workers' connector is one child of a MultiConnector
        self._adapters = LoadedAdapters()
        self._usable_by_rank: dict[int, tuple[tuple[int, int], ...]] = {}  # live arena slot ranges each rank told
        self._events_enabled = kv_events_enabled(vllm_config)  # routers listen: the index reports its tier changes
        self.events: Optional[KVEvents] = None
        self.object_bytes = 0  # one rank's chunk object (the handshake says)
        self._gauges = StoreGauges()
        # rank -> the node cache epoch it has mapped ("" none); a rank that never said counts as having every epoch
        self._node_epochs: dict[int, str] = {}
        self._node_epoch: Optional[str] = None  # the client's epoch at the last step (KV events' capacity follows it)
        # which prefix of a hit to claim, from a cost model learned from the steps and transfers (cut_point.py)
        self.cut = CutPoint(config.load_policy, adapter.token_budget(vllm_config), self.counters)

    # ---- start-up ---------------------------------------------------------------------------------------------

    def set_worker_geometry(self, geometries: Sequence[WorkerGeometry]) -> None:
        """Every rank's plan (vLLM's handshake): the ranks must agree, then the index is built with as many slots as
        every rank's arena holds."""
        agreed = WorkerGeometry.agree(geometries, self.place.world)
        self._geometry_known = True
        self.composed = any(g.composed for g in geometries)
        if agreed is None:
            return
        self.chunk_tokens = agreed.chunk_tokens
        self.groups = agreed.groups
        self.planner = StorePlanner.of(self.groups, self.chunk_tokens, self.num_scheduler_groups,
                                       self.scheduler_block_size)
        self.has_end_state = any(g.recurrent for g in self.planner.moved)
        self.fence.geometry = WriteGeometry.of(self.groups, self.num_scheduler_groups)
        store = self.config.store
        if self.config.node_cache is None and store.mooncake is not None and self._remote is None:
            self._remote = scheduler_mooncake_client(store)
        # load-all keeps every slow-tier write, as before the model
        admission = (SlowTierAdmission(self.cut.model, self.chunk_tokens).pays
                     if self.config.load_policy == "cost-model" else None)
        built = build_manager(self.config, adapter.engine_name(self.vllm_config), agreed, self.place.world,
                              remote=self._remote, admission=admission)
        self.index, self.view = built.manager, built.view
        self.namespace = agreed.namespace
        self.object_bytes = agreed.object_bytes
        self.cut.model.set_geometry(agreed.object_bytes, agreed.device)
        self._gauges.reset()
        self.index_counters.watch(self.index.counters, INDEX_METRICS)
        self._apply_usable_slots({g.rank: g.usable_slots for g in geometries if g.usable_slots is not None})
        self._node_epochs = {g.rank: g.node_epoch for g in geometries if g.node_epoch is not None}
        if self._events_enabled:
            tell = self.index.share_payloads(self._adopt_payload)  # a shared manager: every engine names its chunks
            self.events = KVEvents(self.chunk_tokens, self.hash_block_size,
                                   max_payloads=self.index.num_slots + self.index.disk_chunks + PAYLOAD_SLACK,
                                   group_idx=0 if self.num_scheduler_groups == 1 else None,
                                   on_remember=None if tell is None else
                                   lambda key, payload: tell(key, payload.to_plain()))
            self.index.set_tier_listener(self.events.on_tier_change)
        logger.info("lmcache_npu scheduler: %d ranks, %d arena slots of %d B, chunks of %d tokens, %s backend on %s, "
                    "namespace %s (weights: %s)", self.place.world, agreed.num_slots, agreed.object_bytes,
                    self.chunk_tokens, agreed.backend, agreed.device, agreed.namespace,
                    dict(agreed.identity).get("weights", "?"))

    def _adopt_payload(self, key: ChunkKey, plain: tuple) -> None:
        """A payload another engine sharing the manager described: this engine's events can name that chunk too."""
        if self.events is not None:
            self.events.adopt(key, ChunkPayload.from_plain(plain))

    def _ready(self) -> bool:
        """The index exists (the workers' plans arrived); says once if it has not."""
        if self.index is None and not self._warned_idle and not self._awaiting_plans():
            self._warned_idle = True
            logger.warning("lmcache_npu has no worker plans yet: no lookups or stores until the workers report them")
        return self.index is not None

    def _awaiting_plans(self) -> bool:
        """The plans have not arrived and may yet, with the workers' next outputs (inside a MultiConnector they come
        with the first step's): lookups ask again meanwhile, for at most PLAN_WAIT_OUTPUTS outputs."""
        return not self._geometry_known and self._outputs_without_plans < PLAN_WAIT_OUTPUTS

    def _take_plans(self, plans: dict[int, WorkerGeometry]) -> None:
        """The plans the workers' step metadata carried: once every rank's arrived, as if from the handshake."""
        if self._geometry_known:
            return
        self._plans.update(plans)
        if len(self._plans) < self.place.world:
            self._outputs_without_plans += 1
            return
        self.set_worker_geometry(list(self._plans.values()))

    def _node_mapped(self) -> bool:
        """Whether every rank can move the manager's slots (in process always; a node cache's epoch once mapped on every
        rank): until then nothing is looked up or stored (no command a worker would have to fail)."""
        return self.index is None or self.index.mapped_on(self._node_epochs)

    def _follow_node(self) -> Optional[str]:
        """The epoch for this step's metadata ("" none yet; None when the slots are the workers' own arenas), after a
        shared manager took up an attach that finished in the background (or started one that is due)."""
        if self.index is None:
            return None
        epoch = self.index.step_epoch()
        if epoch is None:
            return None
        if (epoch or None) != self._node_epoch:
            self._node_epoch = epoch or None
            if epoch and self.events is not None:  # the pool's size is known once attached
                self.events.max_payloads = max(self.events.max_payloads,
                                               self.index.num_slots + self.index.disk_chunks + PAYLOAD_SLACK)
        return epoch

    # ---- requests ---------------------------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self.requests.get(request.request_id)
        if state is None or state.finished:
            state = self.requests[request.request_id] = self._new_state(request)
        return state

    def _new_state(self, request: Any) -> _Request:
        """A LoRA request's chunks are keyed by the content of its adapter as vLLM loaded it (vLLM's hash knows only
        the adapter's name, lora_identity.py); one whose adapter nothing may name (unreadable files, files changed
        under the loaded weights) bypasses the plugin."""
        state = _Request(request)
        lora = adapter.lora_adapter(request)
        if lora is not None:
            state.adapter_digest = self._adapters.digest(lora)
            if state.adapter_digest is None:
                state.bypass = True
                self.counters.add(Metric.LORA_BYPASSED_REQUESTS)
        return state

    def loaded_group_ids(self) -> tuple[int, ...]:
        """The scheduler groups a load writes rows into (every group the plan moves)."""
        return tuple(sorted({g.scheduler_group for g in self.planner.moved}))

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def chunk_keys(self, request: Any) -> list[ChunkKey]:
        """Keys of every chunk of the request whose last hash block vLLM has hashed (under the adapter digest its
        state holds, or the one its adapter would get now)."""
        state = self.requests.get(request.request_id)
        lora = adapter.lora_adapter(request)
        digest = state.adapter_digest if state is not None else (
            self._adapters.digest(lora) if lora is not None else None)
        return chunk_keys(request.block_hashes, self.hash_block_size, self.chunk_tokens, self.namespace,
                          adapter_digest=digest)

    def _keys(self, state: _Request, first: int, end: int) -> list[ChunkKey]:
        """Keys of chunks [first, end) that exist yet; kept per request, since a block hash never changes."""
        if len(state.keys) < end:
            state.keys += chunk_keys(state.request.block_hashes, self.hash_block_size, self.chunk_tokens,
                                     self.namespace, first_chunk=len(state.keys),
                                     adapter_digest=state.adapter_digest)
        return state.keys[first:end]

    def _lookup(self, request_id: str, keys: list[ChunkKey]) -> tuple[LookupResult, list[ChunkKey]]:
        """The index's answer for the longest hit, and the key chosen per hit chunk (lookup.py's end-state rule)."""
        assert self.index is not None
        if not self.has_end_state:
            return self.index.lookup(request_id, keys), keys
        present = self.index.presence(lookup.probes(keys, self.has_end_state))
        chosen = lookup.through_partial(keys, present)
        result = self.index.lookup(request_id, chosen)
        return lookup.ending_complete(result, chosen, keys)

    def _before_last_held(self, state: _Request, first: int, limit: int) -> list[ChunkKey]:
        """EAGLE/MTP: the keys of chunks [first, ...) a hit may claim, at most `limit` (lookup.py's one-chunk drop).
        Nothing is reserved or promoted for the proof."""
        assert self.index is not None
        keys = self._keys(state, first, state.request.num_tokens // self.chunk_tokens)
        present = self.index.presence(lookup.probes(keys, self.has_end_state))
        held = lookup.held_run(present, len(keys), self.has_end_state)
        claimable = lookup.claimable_before_last_held(held, limit)
        if min(limit, held) > claimable:
            self.counters.add(Metric.EAGLE_DROPPED_CHUNKS, min(limit, held) - claimable)
        return keys[:claimable]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        state = self._state(request)
        state.lookup = None
        if self.loads_enabled and self._awaiting_plans():
            return None, False  # the workers' plans come with their next output: ask again then
        if (not (self.loads_enabled and self._ready() and self._node_mapped()) or state.no_hits or state.bypass
                or adapter.skips_prefix_cache(request)):
            return 0, False
        if self.composed and adapter.remote_prefill(request):
            # its prompt comes from a prefill engine through the P/D connector beside us: claiming part of it here
            # would leave that connector nothing to read while the prefill engine holds the blocks for it
            self.counters.add(Metric.REMOTE_PREFILL_DEFERRED)
            return 0, False
        assert self.index is not None
        chunk = self.chunk_tokens
        first = num_computed_tokens // chunk
        last = (request.num_tokens - 1) // chunk  # vLLM computes at least the last token itself
        keys = self._keys(state, first, last)
        if self.eagle_block_drop:
            keys = self._before_last_held(state, first, len(keys))
        if not keys:
            self.index.release(request.request_id)
            return 0, False
        result, chosen = self._lookup(request.request_id, keys)
        state.asked = num_computed_tokens
        for offset, source in enumerate(result.sources):  # a promoted chunk is in the arena by the time it loads
            state.found_in.setdefault(first + offset, source)
            if source is not Tier.ARENA and self.events is not None:  # a promotion: its arrival is announced with these
                self.events.remember(chosen[offset], request, first + offset)
        ends = tuple(c == k for c, k in zip(chosen, keys)) if self.has_end_state else None  # complete chunks only
        result = self.cut.decide(request.request_id, hit_shape(num_computed_tokens, request.num_tokens, first, chunk,
                                                               result, ends), result)
        if result.pending:
            self.counters.add(Metric.LOOKUPS_PENDING)
            return None, False  # promotions into the arena are in flight: ask again next step
        hit_tokens = (first + result.ready_chunks) * chunk - num_computed_tokens
        if result.ready_chunks == 0 or hit_tokens <= 0:
            self.index.release(request.request_id)
            return 0, False
        state.lookup = _Lookup(first, chosen[:result.ready_chunks], num_computed_tokens)
        return hit_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        state.blocks = [list(ids) for ids in adapter.block_ids_of(blocks)]
        lookup, state.lookup = state.lookup, None
        if state.asked is not None:  # once per admission: vLLM may ask many times before it schedules a request
            self.counters.add(Metric.LOOKUPS)
            self.counters.add(Metric.LOOKUP_TOKENS, request.num_tokens - state.asked)
            state.asked = None
        self.cut.admitted(request.request_id, num_external_tokens, self.chunk_tokens)
        if self.index is None:
            return
        if num_external_tokens <= 0 or lookup is None:
            self.index.release(request.request_id)
            return
        chunk = self.chunk_tokens
        first_token = lookup.num_computed_tokens
        end_token = first_token + num_external_tokens
        count = min(len(lookup.keys), end_token // chunk - lookup.first_chunk)
        chunks = [(lookup.first_chunk + i, lookup.keys[i]) for i in range(count)]
        refused = ""
        try:
            loads = self.index.prepare_load(request.request_id, chunks)
        except ValueError as exc:  # a reserved chunk is not ready: a bug, reported as a failed load, never loaded
            loads, refused = [], str(exc)
            logger.error("lmcache_npu: request %s: %s", request.request_id, exc)
        self.index.release(request.request_id)
        self._own(state, loads, state.loads)
        self.counters.add(Metric.HIT_TOKENS, num_external_tokens)
        for chunk_index, _ in chunks:
            self.counters.add(HIT_CHUNKS[state.found_in.get(chunk_index, Tier.ARENA)])
        reported = self.failure_channel is adapter.FailureChannel.INVALID_BLOCKS  # only there vLLM takes block ids
        window = self.planner.window(state.blocks, lookup.first_chunk, lookup.first_chunk + count)
        self._loads.append(LoadPlan(
            request_id=request.request_id,
            moves=tuple(DeviceMove(load, window, first_token, end_token) for load in loads), window=window,
            first_token=first_token, end_token=end_token, refused=refused,
            error_block_ids=self.planner.error_blocks(state.blocks, first_token, end_token) if reported else ()))

    # ---- per step ---------------------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheNPUConnectorMetadata:
        stores: list[StorePlan] = []
        step = self.cut.on_step(scheduler_output)
        writes = self.fence.step_writes()
        node_epoch = self._follow_node()
        storing = self.stores_enabled and self.index is not None and self._node_mapped()
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = scheduler_output.num_scheduled_tokens
        for scheduled in adapter.scheduled_requests(scheduler_output):
            state = self.requests.get(scheduled.request_id)
            if state is None:  # scheduled before this connector saw it: nothing of it is tracked
                if writes is not None:
                    writes.collect_untracked(scheduled)
                continue
            had_table = bool(state.blocks)
            self._mirror(state, scheduled)
            if writes is not None:
                writes.collect(scheduled, state.blocks, had_table)
            if storing and not state.bypass:
                computed_after = scheduled.num_computed_tokens + num_scheduled[scheduled.request_id]
                if spec_tokens:
                    computed_after -= len(spec_tokens.get(scheduled.request_id, ()))
                if computed_after // self.chunk_tokens <= state.next_chunk:  # no chunk completes (most decode steps)
                    continue
                plan = self._plan_stores(state, scheduled.num_computed_tokens, computed_after)
                if plan is not None:
                    stores.append(plan)
        manager = self.index
        commands = manager.take_commands() if manager is not None else []
        self.cut.on_commands(commands)
        meta = LMCacheNPUConnectorMetadata(
            commands=[c for c in commands if not isinstance(c, (Load, Store))],  # those travel in the plans' moves
            loads=self._loads, stores=stores, delayed_free=self._delayed_free,
            fenced_stores=self._fenced_stores(scheduler_output, writes) if writes is not None else [],
            idle=scheduler_output.total_num_scheduled_tokens == 0, geometry_known=self._geometry_known,
            node_epoch=node_epoch,
            node_lease=(manager.lease or None) if manager is not None and manager.epoch else None,
            refused=manager.take_refused() if manager is not None else [], step=step)
        self.fence.end_step()
        self._loads, self._delayed_free = [], []
        return meta

    @staticmethod
    def _mirror(state: _Request, scheduled: adapter.ScheduledRequest) -> None:
        """The request's block-table mirror takes this step's ids: a whole table (new or resumed request, or a mirror
        that has none yet) or the newly allocated ones."""
        if scheduled.block_ids is None:
            return
        if scheduled.replace or not state.blocks:
            state.blocks = [list(ids) for ids in scheduled.block_ids]
        else:
            for table, new in zip(state.blocks, scheduled.block_ids):
                table.extend(new)

    def _fenced_stores(self, scheduler_output: Any, writes: StepWrites) -> Optional[list[int]]:
        """The in-flight stores that read a block this step writes; None when some write could not be placed."""
        writes.collect_outside_forward(self._loads, adapter.blocks_to_zero(scheduler_output))
        fenced = self.fence.fenced(writes)
        if fenced is None:
            self.counters.add(Metric.FENCE_UNKNOWN_STEPS)
        elif fenced:
            self.counters.add(Metric.FENCED_STORE_COMMANDS, len(fenced))
        return fenced

    def _plan_stores(self, state: _Request, computed_before: int, computed_after: int) -> Optional[StorePlan]:
        """Stores for the chunks this step completes (and earlier ones still safe to read), one command each."""
        assert self.index is not None
        request = state.request
        chunk = self.chunk_tokens
        end_chunk = computed_after // chunk
        if not self.config.store_decode_chunks:
            end_chunk = min(end_chunk, request.num_prompt_tokens // chunk)
        first = state.next_chunk
        keys = self._keys(state, first, end_chunk)  # stops before chunks whose hash vLLM has not computed yet
        if not keys:
            return None
        storable, complete = self.planner.safe_chunks(state.blocks, first, len(keys), computed_before)
        state.next_chunk = first + len(keys)
        self.counters.add(Metric.STORE_CHUNKS_UNSAFE, int((~storable).sum()))
        if not complete.all():  # a copy without end state is useless where the complete one is held
            held = self.index.presence([k for k, whole in zip(keys, complete) if not whole], remote=False)
            storable[~complete] &= ~np.array(held, dtype=bool)
        picked, without_end_state = self.planner.pick(first, keys, storable, complete)
        if not picked:
            return None
        commands = self.index.prepare_store(request.request_id, picked)
        if self.events is not None:
            for command in commands:
                self.events.remember(command.key, request, command.chunk_index)
        if not commands:
            return None
        self._own(state, commands, state.stores)
        self.counters.add(Metric.STORE_CHUNKS, len(commands))
        plan, reads = self.planner.plan(request.request_id, state.blocks, commands, without_end_state)
        self.fence.step_reads.extend(reads)
        return plan

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> tuple[bool, Optional[dict]]:
        """Delays the free while stores of the request still read its pages (reported later as finished_sending).
        A request still waiting for its loads is freed by vLLM itself once the load reports finished_recving."""
        state = self.requests.get(request.request_id)
        if self.index is not None:
            self.index.release(request.request_id)
        if state is None:
            return False, None
        state.finished = True
        state.lookup = None
        self.cut.forget(request.request_id)
        if not any(not s.finished for s in self.requests.values()):  # the engine may idle: no step is timed across it
            self.cut.idle()
        delay = bool(state.stores) and not adapter.waiting_for_remote_kv(request)
        if delay:
            self._delayed_free.append(request.request_id)
            self.counters.add(Metric.DELAYED_FREES)
        self._forget_if_settled(state)
        return delay, None

    def _own(self, state: _Request, commands: Sequence[Load | Store], pending: set[int]) -> None:
        for command in commands:
            pending.add(command.cmd_id)
            self._owner[command.cmd_id] = state

    def _apply_usable_slots(self, reports: dict[int, tuple[tuple[int, int], ...]]) -> None:
        """The index hands out only slots live on every rank: the intersection of the ranks' live segment ranges
        (a rank that has not reported counts as fully live: its handshake said nothing)."""
        self._usable_by_rank.update(reports)
        if self.index is None or not reports:
            return
        usable = usable_on_every_rank(self._usable_by_rank, self.index.num_slots)
        self.index.limit_slots(list(usable))
        logger.info("lmcache_npu scheduler: %d of %d arena slots usable (live segments on every rank)",
                    sum(end - begin for begin, end in usable), self.index.num_slots)

    def update_connector_output(self, connector_output: Any) -> None:
        """Every rank's completions reach the index; a request's command counts as done once all ranks answered."""
        meta = adapter.worker_metadata(connector_output)
        if not self._geometry_known:
            self._take_plans(meta.geometries if isinstance(meta, LMCacheNPUWorkerMetadata) else {})
        if isinstance(meta, LMCacheNPUWorkerMetadata) and meta.usable_slots:
            self._apply_usable_slots(meta.usable_slots)
        if isinstance(meta, LMCacheNPUWorkerMetadata) and meta.node_epochs:
            self._node_epochs.update(meta.node_epochs)
        if not isinstance(meta, LMCacheNPUWorkerMetadata) or self.index is None:
            return
        if meta.completions:
            self.index.on_completions(meta.completions)
        self.cut.on_output(meta, self.index.is_pending)
        if not meta.completions:
            return
        touched: dict[int, _Request] = {}
        for completion in meta.completions:
            state = self._owner.get(completion.cmd_id)
            if state is None:
                continue
            touched[id(state)] = state
            if not completion.ok and completion.cmd_id in state.loads:
                state.no_hits = True
                self.counters.add(Metric.LOAD_FAILURES)
            elif not completion.ok:
                self.counters.add(Metric.STORE_FAILURES)
        for state in touched.values():
            for pending in (state.stores, state.loads):
                for cmd_id in [c for c in pending if not self.index.is_pending(c)]:
                    pending.discard(cmd_id)
                    self._owner.pop(cmd_id, None)
                    self.fence.reads.forget(cmd_id)  # every rank is done with its pages
            self._forget_if_settled(state)

    def _forget_if_settled(self, state: _Request) -> None:
        request_id = state.request.request_id
        if state.finished and not state.stores and not state.loads and self.requests.get(request_id) is state:
            del self.requests[request_id]

    def stats(self) -> LMCacheNPUStats:
        gauges = {} if self.view is None else self._gauges.changed(
            self.view.occupancy(), self.config, self.view.eviction_policy, self.namespace,
            self.object_bytes * self.place.world, self.chunk_tokens)
        return LMCacheNPUStats.of({**self.counters.drain(), **self.index_counters.take(), **gauges,
                                   **self.cut.gauges()})

    def take_events(self) -> list[Any]:
        """vLLM KV events for the chunks that entered or left a tier since the last call (empty unless vLLM's KV
        events are enabled)."""
        if self.events is None:
            return []
        if self.index is not None:  # a shared manager's tier changes since this engine's last answer
            self.index.sync()
        return self.events.take()

    def shutdown(self) -> None:
        if self.index is not None:
            self.index.close()
        if self._remote is not None:
            self._remote.close()
            self._remote = None
