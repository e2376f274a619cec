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

import dataclasses
import logging
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
from .handoff import HandoffDesk, Receiving
from .request_state import AnsweredLookup, RequestState
from .events import PAYLOAD_SLACK, ChunkPayload, KVEvents, kv_events_enabled
from .lora_identity import LoadedAdapters
from .manager_factory import build_manager
from .fence import PageFence, StepWrites, WriteGeometry
from ...transfer.plans import LoadPlan, StorePlan
from .metadata import LMCacheNPUConnectorMetadata, LMCacheNPUWorkerMetadata, WorkerGeometry, usable_on_every_rank
from .store_planner import StorePlanner, mirror_blocks
from .stats import INDEX_METRICS, CounterDeltas, LMCacheNPUStats
from .store_gauges import StoreGauges
from .cut_point import CutPoint, hit_shape, prefills_ahead
from .load_mode import LoadMode, LoadModes
from ...store.metrics import HIT_CHUNKS, Metric

logger = logging.getLogger(__name__)
# outputs of the workers a lookup waits for their plans through (they come with the first: more means they never will)
PLAN_WAIT_OUTPUTS = 8


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
        adapter.warn_about_failed_loads(self.failure_channel, adapter.load_failure_policy(vllm_config))
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
        self.requests: dict[str, RequestState] = {}
        self.counters = TierCounters()
        self.index_counters = CounterDeltas()  # the index's own counters, once the handshake built it
        self._owner: dict[int, RequestState] = {}  # in-flight store/load cmd id -> its request
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
        self.cut = CutPoint(config.load_policy, adapter.token_budget(vllm_config), self.counters,
                            ahead=self._compute_ahead)
        self.handoffs = HandoffDesk(self.counters, config.handoff_wait_ms)
        self.modes = LoadModes(config.load_mode, config.load_slices, config.load_policy, self.num_scheduler_groups)

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
        self.handoffs.set_geometry(agreed.namespace, self.chunk_tokens, self.hash_block_size, not self.eagle_block_drop
                                   and all(g.keeps_blocks and not g.recurrent and g.compress_ratio == 1
                                           and g.stored_tokens == self.chunk_tokens for g in self.planner.moved))
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
        self.modes.set_workers(all(g.sliced_loads for g in geometries), "tp_share's exchange loads whole objects")
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

    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None or state.finished:
            state = self.requests[request.request_id] = self._new_state(request)
        return state

    def _new_state(self, request: Any) -> RequestState:
        """A LoRA request's chunks are keyed by the content of its adapter as vLLM loaded it (vLLM's hash knows only
        the adapter's name, lora_identity.py); one whose adapter nothing may name (unreadable files, files changed
        under the loaded weights) bypasses the plugin."""
        state = RequestState(request)
        state.handoff_ask, state.receiving = self.handoffs.read(request)
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

    def _keys(self, state: RequestState, first: int, end: int) -> list[ChunkKey]:
        """Keys of chunks [first, end) that exist yet; kept per request, since a block hash never changes."""
        if len(state.keys) < end:
            state.keys += chunk_keys(state.request.block_hashes, self.hash_block_size, self.chunk_tokens,
                                     self.namespace, first_chunk=len(state.keys),
                                     adapter_digest=state.adapter_digest)
        return state.keys[first:end]

    def _lookup(self, request: Any, keys: list[ChunkKey], computed: int,
                first: int) -> tuple[LookupResult, list[ChunkKey]]:
        """The index's answer for the hit the cut claims, and the key chosen per hit chunk (lookup.py's end-state
        rule). Where the manager can say where the hit lies, the cut decides first: only what it claims is reserved
        and promoted."""
        assert self.index is not None
        chosen = keys
        if self.has_end_state:
            chosen = lookup.through_partial(keys, self.index.presence(lookup.probes(keys, self.has_end_state)))
        decided = self.cut.claimed(request.request_id, first)
        if decided is not None:  # vLLM asks again (promotions in flight, no budget): the standing decision holds
            chosen = chosen[:decided]
        elif (located := self.index.locate(chosen)) is not None and located.hit_chunks:
            hit_keys = chosen
            if self.has_end_state:
                located, hit_keys = lookup.ending_complete(located, chosen, keys)
            if located.hit_chunks:
                shape = hit_shape(computed, request.num_tokens, first, self.chunk_tokens, located,
                                  self._ends(hit_keys, keys))
                chosen = hit_keys[:self.cut.claim(request.request_id, shape)]
        result = self.index.lookup(request.request_id, chosen)
        return lookup.ending_complete(result, chosen, keys) if self.has_end_state else (result, chosen)

    def _ends(self, chosen: Sequence[ChunkKey], keys: Sequence[ChunkKey]) -> Optional[tuple[bool, ...]]:
        """Per chosen chunk whether a claim may end after it: with end-state groups, complete chunks only."""
        return tuple(c == k for c, k in zip(chosen, keys)) if self.has_end_state else None

    def _compute_ahead(self, request_id: str) -> float:
        """Predicted seconds of the prefills vLLM schedules before this request (cut_point.prefills_ahead)."""
        unfinished = {rid: (s.request, s.claimed_to) for rid, s in self.requests.items() if not s.finished}
        return self.cut.model.backlog_s(prefills_ahead(request_id, unfinished))

    def _before_last_held(self, state: RequestState, first: int, limit: int) -> list[ChunkKey]:
        """EAGLE/MTP: the keys of chunks [first, ...) a hit may claim, at most `limit` (lookup.py's one-chunk drop);
        nothing is reserved or promoted for the proof."""
        assert self.index is not None
        keys = self._keys(state, first, state.request.num_tokens // self.chunk_tokens)
        present = self.index.presence(lookup.probes(keys, self.has_end_state))
        claimable, dropped = lookup.claimable_keys(keys, present, self.has_end_state, limit)
        if dropped:
            self.counters.add(Metric.EAGLE_DROPPED_CHUNKS, dropped)
        return claimable

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
        if state.receiving is not None and not self.has_end_state and not self.eagle_block_drop:
            return self._receive(state, state.receiving, num_computed_tokens)
        last = (request.num_tokens - 1) // chunk  # vLLM computes at least the last token itself
        keys = self._keys(state, first, last)
        if self.eagle_block_drop:
            keys = self._before_last_held(state, first, len(keys))
        if not keys:
            self.index.release(request.request_id)
            return 0, False
        result, chosen = self._lookup(request, keys, num_computed_tokens, first)
        state.asked = num_computed_tokens
        for offset, source in enumerate(result.sources):  # a promoted chunk is in the arena by the time it loads
            state.found_in.setdefault(first + offset, source)
            if source is not Tier.ARENA and self.events is not None:  # a promotion: its arrival is announced with these
                self.events.remember(chosen[offset], request, first + offset)
        ends = self._ends(chosen, keys)
        result = self.cut.decide(request.request_id, hit_shape(num_computed_tokens, request.num_tokens, first, chunk,
                                                               result, ends), result)
        if result.pending:
            self.counters.add(Metric.LOOKUPS_PENDING)
            return None, False  # promotions into the arena are in flight: ask again next step
        hit_tokens = (first + result.ready_chunks) * chunk - num_computed_tokens
        if result.ready_chunks == 0 or hit_tokens <= 0:
            self.index.release(request.request_id)
            return 0, False
        sliced = self.modes.choose(self.cut.model, result.ready_chunks, num_computed_tokens + hit_tokens,
                                   request.num_tokens) is LoadMode.SLICED
        state.lookup = AnsweredLookup(first, chosen[:result.ready_chunks], num_computed_tokens, sliced=sliced)
        return hit_tokens, not sliced  # a sliced load is vLLM's synchronous one: the request computes this step

    def _receive(self, state: RequestState, receiving: Receiving,
                 num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """A decode request's hit from its hand-off (handoff.py); one of no use is looked up as any request."""
        assert self.index is not None
        request = state.request
        if receiving.keys is None and not self.handoffs.settle(
                receiving, request, self._keys(state, 0, self.handoffs.full_chunks(request)), state.adapter_digest):
            state.receiving = None
            return self.get_num_new_matched_tokens(request, num_computed_tokens)
        hit_tokens, keys, result = self.handoffs.lookup(self.index, receiving, request, num_computed_tokens)
        state.asked, first = num_computed_tokens, num_computed_tokens // self.chunk_tokens
        for offset, source in enumerate(result.sources):
            state.found_in.setdefault(first + offset, source)
        if hit_tokens is None or hit_tokens <= 0:
            if hit_tokens is not None:
                self.index.release(request.request_id)
            return (None if hit_tokens is None else 0), False  # None: its prefill engine is still storing
        state.lookup = AnsweredLookup(first, keys, num_computed_tokens, through=receiving.through)
        return hit_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        state.blocks = [list(ids) for ids in adapter.block_ids_of(blocks)]
        lookup, state.lookup = state.lookup, None
        state.claimed_to = (lookup.num_computed_tokens if lookup is not None else 0) + max(num_external_tokens, 0)
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
        ends_at = -(-end_token // chunk) if lookup.through else end_token // chunk  # a hand-off may end mid-chunk
        count = min(len(lookup.keys), ends_at - lookup.first_chunk)
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
        self.modes.admitted(self.counters, lookup.sliced, num_external_tokens)
        if state.receiving is not None:
            self.counters.add(Metric.HANDOFFS_RECEIVED)
        for chunk_index, _ in chunks:
            self.counters.add(HIT_CHUNKS[state.found_in.get(chunk_index, Tier.ARENA)])
        reported = lookup.sliced or self.failure_channel is adapter.FailureChannel.INVALID_BLOCKS  # block ids taken
        window = self.planner.window(state.blocks, lookup.first_chunk, lookup.first_chunk + count)
        self._loads.append(LoadPlan(
            request_id=request.request_id,
            moves=tuple(DeviceMove(load, window, first_token, end_token) for load in loads), window=window,
            first_token=first_token, end_token=end_token, refused=refused, sliced=lookup.sliced,
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
            state.blocks = mirror_blocks(state.blocks, scheduled)
            if writes is not None:
                writes.collect(scheduled, state.blocks, had_table)
            if storing and not state.bypass:
                computed_after = scheduled.num_computed_tokens + num_scheduled[scheduled.request_id]
                if spec_tokens:
                    computed_after -= len(spec_tokens.get(scheduled.request_id, ()))
                if state.handoff_ask and not state.tail_planned and computed_after >= state.request.num_prompt_tokens:
                    stores.extend(self._plan_tail(state))
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

    def _fenced_stores(self, scheduler_output: Any, writes: StepWrites) -> Optional[list[int]]:
        """The in-flight stores that read a block this step writes; None when some write could not be placed."""
        writes.collect_outside_forward(self._loads, adapter.blocks_to_zero(scheduler_output))
        fenced = self.fence.fenced(writes)
        if fenced is None:
            self.counters.add(Metric.FENCE_UNKNOWN_STEPS)
        elif fenced:
            self.counters.add(Metric.FENCED_STORE_COMMANDS, len(fenced))
        return fenced

    def _plan_stores(self, state: RequestState, computed_before: int, computed_after: int) -> Optional[StorePlan]:
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

    def _plan_tail(self, state: RequestState) -> list[StorePlan]:
        """A hand-off request's partial last prompt chunk, once computed (rows past the prompt stored as zeros)."""
        assert self.index is not None
        state.tail_planned = True
        state.tail_key, commands = self.handoffs.store_tail(self.index, state.request, state.adapter_digest)
        if not commands:
            return []
        self._own(state, commands, state.stores)
        self.counters.add(Metric.STORE_CHUNKS, len(commands))
        plan, reads = self.planner.plan(state.request.request_id, state.blocks, commands, set())
        self.fence.step_reads.extend(reads)
        tail_end = state.request.num_prompt_tokens  # rows past the prompt are not the request's yet: stored as zeros
        return [dataclasses.replace(plan, moves=tuple(dataclasses.replace(m, end_token=tail_end) for m in plan.moves))]

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
        params = self.handoffs.params(self.index, request, self._keys(state, 0, self.handoffs.full_chunks(request)),
                                      state.tail_key) if state.handoff_ask else None
        self.cut.forget(request.request_id)
        if not any(not s.finished for s in self.requests.values()):  # the engine may idle: no step is timed across it
            self.cut.idle()
        delay = bool(state.stores) and not adapter.waiting_for_remote_kv(request)
        if delay:
            self._delayed_free.append(request.request_id)
            self.counters.add(Metric.DELAYED_FREES)
        self._forget_if_settled(state)
        return delay, params

    def _own(self, state: RequestState, commands: Sequence[Load | Store], pending: set[int]) -> None:
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
        if isinstance(meta, LMCacheNPUWorkerMetadata):
            self._apply_usable_slots(meta.usable_slots)  # nothing when no rank's changed
            self._node_epochs.update(meta.node_epochs)
        if not isinstance(meta, LMCacheNPUWorkerMetadata) or self.index is None:
            return
        if meta.completions:
            self.index.on_completions(meta.completions)
        self.cut.on_output(meta, self.index.is_pending)
        self.modes.on_unwaited(meta.unwaited_sliced / self.place.world)  # each rank's guard sees the forward
        if not meta.completions:
            return
        touched: dict[int, RequestState] = {}
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

    def _forget_if_settled(self, state: RequestState) -> None:
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
