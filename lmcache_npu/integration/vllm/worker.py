"""The connector's worker half: registered KV caches -> layout -> plan -> transfer backend -> store executor, and
each step's commands run without blocking the model (DESIGN §8).

Per step: `handle_preemptions` queues the stores an earlier step bound but never queued (no `wait_for_save`), then
raises the page fence; `start_load_kv` runs the tier commands in order and queues every load of the step as one
transfer; `wait_for_save` queues every store of the step as one transfer, ordered after the forward by an event;
`get_finished` collects completions, reports loads done (`finished_recving`), stores of finished requests done
(`finished_sending`) and failed loads, and the completions go back to the scheduler's index. On a step where vLLM
computes nothing (metadata `idle`: every runnable request waits for its KV) it first waits, briefly, for one of the
pending loads; where the model runs on the host it also waits, at most a share of a step, for the loads its own step
queued, so they are reported in that step (`load_wait.py` says why each wait pays and why devices do not wait).

Why this order is safe, with speculative decoding, under the narrow page fence and for stores a step left unqueued:
`docs/architecture.md`, "The worker's ordering arguments".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ...config import ConnectorConfig
from ...layout.discovery import KVLayout, LayoutPolicy, default_chunk_tokens, discover_layout, token_granularity
from ...ops import BackendUnavailable, Direction, TransferBackend, get_backend
from ...ops.backend import backend_for_device
from ...node.messages import PoolGeometry
from ...node.worker_mapping import WorkerNodeMapping
from ...store.commands import COMMAND_DEADLINE_S, Completion, DeviceMove, WorkerCommand
from ...store.disk import check_disk_parent
from ...store.cost.timer import TransferTimer
from ...store.executor import StoreExecutor
from ...store.tier import TierCounters
from ...transfer import KVMover
from ...transfer.pipeline import WorkerPipeline, build_worker_pipeline
from ...transfer.plans import LoadPlan
from ...transfer.shares import ShareLayout
from . import adapter, tp_share
from .engine_identity import EngineIdentity, engine_identity
from .hook_map import HookMap
from .sliced_loads import SlicedLoads, SlicedStep
from .load_wait import IDLE_WAIT_S, StepLoadWait
from .metadata import LMCacheNPUConnectorMetadata, LMCacheNPUWorkerMetadata, WorkerGeometry, plan_group_geometry
from .stats import DISK_METRICS, REMOTE_METRICS, CounterDeltas, LMCacheNPUStats
from ...store.metrics import Metric, per_rank

logger = logging.getLogger(__name__)


class LoadFailedError(RuntimeError):
    """A load failed and this vLLM cannot be told to recompute it; the engine stops rather than serve wrong KV."""


@dataclass
class _Recv:
    plan: LoadPlan
    pending: set[int]
    failure: str = ""


@dataclass
class _Sends:
    pending: set[int] = field(default_factory=set)
    delayed: bool = False  # the scheduler kept the request's blocks: report finished_sending once pending is empty


def _fractal_nz(kv_caches: Mapping[str, Any]) -> bool:
    """310P caches are in the private FRACTAL_NZ format (ACL format 29), which only torch_npu can tell."""
    first = next(iter(kv_caches.values()), None)
    tensor = first if not isinstance(first, (tuple, list)) else (first[0] if first else None)
    if tensor is None or getattr(tensor, "device", None) is None or tensor.device.type != "npu":
        return False
    import torch_npu

    return int(torch_npu.get_npu_format(tensor)) == 29


class WorkerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.place = adapter.parallel_place(vllm_config)
        _, self.hash_block_size = adapter.block_sizes(kv_cache_config, vllm_config)
        self.failure_channel = adapter.failure_channel(len(kv_cache_config.kv_cache_groups))
        self.load_failure_policy = adapter.load_failure_policy(vllm_config)
        self.counters = TierCounters()
        self.tier_counters = CounterDeltas()  # the disk and Mooncake tiers' own counters, once the executor exists
        self.layout: Optional[KVLayout] = None
        self.kv_caches: Mapping[str, Any] = {}  # what vLLM registered (the tensors the plan's planes view)
        self.pipeline: Optional[WorkerPipeline] = None  # the lanes, the executor, its arena and tiers
        self.geometry: Optional[WorkerGeometry] = None
        self.identity: Optional[EngineIdentity] = None
        self.shares: Optional[ShareLayout] = None  # this rank's share of replicated planes (tp_share), or None
        self._stores: list[DeviceMove] = []  # the step's stores, queued at wait_for_save
        self._recv: dict[str, _Recv] = {}
        self._sends: dict[str, _Sends] = {}
        self._owner: dict[int, str] = {}  # in-flight load/store cmd id -> request id
        self._due: dict[int, float] = {}  # the same ids -> their deadline (monotonic), in arrival: deadline order
        self._late: set[int] = set()  # ids answered as failed at their deadline: a later answer is dropped
        self._outbox: list[Completion] = []
        self._reported_usable: Optional[tuple[tuple[int, int], ...]] = None  # arena slot ranges last told
        self._arena_told: dict[str, int] = {}  # the arena's segment stats as of the last stats() report
        self._load_error_blocks: set[int] = set()
        self._fenced: Optional[Any] = None  # the metadata whose step handle_preemptions fenced
        self._idle_step = False  # vLLM computes nothing this step: get_finished may wait for a load
        self._step_loads: set[int] = set()  # load commands this step queued (waited for where the model is the host)
        self._load_wait: Optional[StepLoadWait] = None  # set where the model runs on the host (a CPU KV cache)
        self._node: Optional[WorkerNodeMapping] = None  # this rank's mapping of the node cache (node_cache only)
        self._reported_epoch: Optional[str] = None  # the node epoch last told to the scheduler as mapped here
        self._in_flight: set[int] = set()  # commands submitted and not yet polled (a retired mapping waits for its)
        self._geometry_known = False  # the scheduler said it has every rank's plan: no more sending it
        self._steps: list[int] = []  # step numbers run since the last worker metadata (the scheduler times them)
        self.hooks = HookMap()  # the layers this runtime announces through wait_for_layer_load, learned per forward
        self.sliced: Optional[SlicedLoads] = None  # loads into the step's own forward (not with tp_share's exchange)
        self._sliced_step: Optional[SlicedStep] = None  # the last forward's sliced load, for get_finished's verdict
        self._unwaited = 0  # sliced loads the guard failed since the last worker metadata (the scheduler stops slicing)

    # ---- start-up ---------------------------------------------------------------------------------------------

    def chunk_tokens(self) -> int:
        """The configured chunk size, or the automatic one: `DEFAULT_CHUNK_TOKENS` (128) rounded up to a multiple of
        vLLM's hash block and of every stored group's granularity."""
        if self.config.chunk_tokens is not None:
            return self.config.chunk_tokens
        granularity = token_granularity(self.kv_cache_config, LayoutPolicy(skip_spec_kinds=self.config.skip_spec_kinds))
        return default_chunk_tokens(granularity, self.hash_block_size)

    def register_kv_caches(self, kv_caches: Mapping[str, Any], composed: bool = False) -> None:
        """`composed`: this connector is one child of the engine's (MultiConnector), which its plan says."""
        policy = LayoutPolicy(chunk_tokens=self.chunk_tokens(), skip_spec_kinds=self.config.skip_spec_kinds,
                              hash_block_size=self.hash_block_size, fractal_nz=_fractal_nz(kv_caches))
        policy = tp_share.with_tp(policy, self.vllm_config, self.config.tp_share)
        self.kv_caches = kv_caches
        layout = discover_layout(self.kv_cache_config, kv_caches, policy,
                                 adapter.attention_backends(self.vllm_config, kv_caches))
        self.layout = layout
        plan = layout.plan
        if plan.object_bytes == 0:
            reason = "every KV-cache group is skipped (see `lmcache-npu inspect`), so no chunk has bytes to store"
            logger.warning("lmcache_npu rank %d: %s", self.place.rank, reason)
            self.geometry = WorkerGeometry(self.place.rank, self.place.world, enabled=False, reason=reason,
                                           composed=composed)
            return
        store = self.config.store
        # the node cache is persistent and shared like a disk or Mooncake tier: weights nothing names are refused
        self.identity = engine_identity(self.config, self.vllm_config, kv_caches,
                                        persistent_tiers=store.disk_path is not None or store.mooncake is not None
                                        or self.config.node_cache is not None)
        self._load_wait = StepLoadWait() if plan.device.type == "cpu" else None
        # replicated planes: this rank stores its own planes and a 1/share_ranks share of the rest, loads exchange them
        self.shares = (tp_share.share_layout(plan, tp_share.tp_rank(), layout.share_ranks)
                       if layout.share_ranks > 1 else None)
        shared = None if self.shares is None else (self.shares, lambda: tp_share.share_exchange(
            self.config.tp_share_exchange, policy.tp_size, layout.share_ranks, plan.device))
        pipeline = self.pipeline = build_worker_pipeline(
            layout, self.config.store, self.place.rank, lambda: self._backend(plan.device), self.counters,
            load_retries=self.config.load_retries, model_identity=self.identity.fingerprint, shared=shared,
            arena_for=None if self.config.node_cache is None else
            lambda namespace, fingerprint, object_bytes: self._attach_node(PoolGeometry(
                namespace or "", fingerprint, self.place.world, object_bytes, plan.chunk_tokens)))
        if self._node is not None:  # the node's commands run only against the epoch they were issued for
            pipeline.executor.epoch = self._node.epoch
        pipeline.executor.timer = TransferTimer(pipeline.object_bytes)  # the scheduler's cost model learns the tiers
        self.sliced = SlicedLoads(layout, self.config.load_slices, self.counters) if self.shares is None else None
        backend = pipeline.mover.backends[Direction.LOAD].name
        for tier, names in ((pipeline.disk, DISK_METRICS), (pipeline.remote, REMOTE_METRICS)):
            if tier is not None:
                self.tier_counters.watch(tier.counters, names)
        self.geometry = WorkerGeometry(
            self.place.rank, self.place.world, enabled=True, namespace=pipeline.namespace,
            layout_fingerprint=pipeline.layout_fingerprint, chunk_tokens=plan.chunk_tokens,
            object_bytes=pipeline.object_bytes, num_slots=pipeline.arena.num_slots,
            usable_slots=self._take_usable_change(), groups=plan_group_geometry(layout.groups), backend=backend,
            device=str(plan.device), identity=self.identity.description, node_epoch=self._take_epoch_change(),
            weights=self.identity.weights_naming, composed=composed, sliced_loads=self.sliced is not None)
        logger.info("lmcache_npu rank %d: %d planes in %d groups, %d B per %d-token chunk, %s backend, %d arena slots",
                    self.place.rank, len(plan.moved_planes), len(layout.groups), plan.object_bytes, plan.chunk_tokens,
                    backend, pipeline.arena.num_slots)

    def _attach_node(self, geometry: PoolGeometry) -> Any:
        """This rank's segments of the node cache's pool, mapped (and registered with the device) in the background:
        the arena of no slot until they are (the service away, its pool being made, registration under way)."""
        assert self.config.node_cache is not None and self.identity is not None
        self._node = WorkerNodeMapping(self.config.node_cache, adapter.engine_name(self.vllm_config), geometry,
                                       self.place.rank, self.counters, weights=self.identity.weights_naming,
                                       pinned=self.config.store.pinned,
                                       npu_host_memory=self.config.store.npu_host_memory)
        self._node.start(self.config.node_cache_start_wait_ms / 1000)
        return self._node.arena

    def _follow_node_epoch(self, meta: LMCacheNPUConnectorMetadata) -> bool:
        """The epoch the scheduler names this step: mapped here, the step's commands run on it; else they are
        answered as failed (never waited for: it is mapped in the background) and False."""
        if self._node is None:
            return True
        assert self.executor is not None
        ready = self._node.follow(meta.node_epoch, self._in_flight)
        # commands in flight keep an old mapping alive through their slots; later ones run only on this epoch's pages
        self.executor.use_arena(self._node.arena, self._node.epoch)
        commands = self._step_commands(meta)
        if not ready and commands:
            self.counters.add(Metric.NODE_UNMAPPED_COMMANDS, len(commands))
            self.executor.refuse(commands, f"the node cache's epoch {meta.node_epoch or '(none)'} is not mapped "
                                 f"on rank {self.place.rank}")
        return ready

    @staticmethod
    def _step_commands(meta: LMCacheNPUConnectorMetadata) -> list[WorkerCommand]:
        """Everything the step would run: its tier commands and its device moves (not the refused ones)."""
        refused = {c.cmd_id for c in meta.refused}
        moves = [m for m in (*meta.load_moves(), *meta.store_moves()) if m.cmd_id not in refused]
        return [*meta.commands, *moves]

    def _submit(self, commands: list[WorkerCommand]) -> None:
        """Runs `commands`, remembered until polled: a retired node mapping goes once none of its is in flight."""
        self._in_flight.update(c.cmd_id for c in commands)
        assert self.executor is not None
        self.executor.submit(commands)

    def _join_node_lease(self, meta: LMCacheNPUConnectorMetadata) -> bool:
        """This rank's connection joins the lease the scheduler holds (named in the step) before it runs the step's
        commands: the service then keeps that lease, and the slots the commands use, while this rank lives. False
        when it cannot (the lease is gone, another engine's), and every command of the step is answered as failed."""
        if self._node is None or not meta.node_lease or meta.node_lease == self._node.lease:
            return True
        assert self.executor is not None
        if self._node.join(meta.node_lease):
            return True
        logger.warning("lmcache_npu rank %d: the node cache has no live lease of this engine's scheduler; the step's "
                       "node commands are refused", self.place.rank)
        self.executor.refuse(self._step_commands(meta), "this rank could not join its scheduler's node cache lease")
        return False

    @property
    def mover(self) -> Optional[KVMover]:
        return self.pipeline.mover if self.pipeline is not None else None

    @property
    def executor(self) -> Optional[StoreExecutor]:
        return self.pipeline.executor if self.pipeline is not None else None

    def _backend(self, device: Any) -> TransferBackend:
        try:
            name = backend_for_device(device.type, self.config.backend)
        except ValueError as exc:
            raise ValueError(f"lmcache_npu: KV caches on {device}: {exc}") from exc
        try:
            return get_backend(name, **dict(self.config.backend_options))
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"lmcache_npu rank {self.place.rank}: {exc}") from exc

    # ---- per step ---------------------------------------------------------------------------------------------

    def handle_preemptions(self, meta: Any) -> None:
        """vLLM calls this every step before the model writes a page (preempted requests or not), with the step's
        metadata: stores an earlier step left unqueued are queued behind that step's forward, then the model's stream
        waits for the queued stores that still read pages this step writes."""
        self._fenced = meta
        if self.executor is None or self.mover is None:
            return
        if self._stores:  # a previous step bound stores but never reached wait_for_save (its plans are still expected)
            self._submit(self._stores)
            self._stores = []
        # metadata of another kind, or from a scheduler that could not place a write, fences every queued store
        fenced = meta.fenced_stores if isinstance(meta, LMCacheNPUConnectorMetadata) else None
        self.mover.release_pages(fenced)

    def start_load_kv(self, meta: LMCacheNPUConnectorMetadata) -> None:
        self._geometry_known = self._geometry_known or meta.geometry_known
        if self.executor is None or self.mover is None:
            return
        if meta.step is not None:
            self._steps.append(meta.step)
        if self._fenced is not meta:  # a runner that skips handle_preemptions: fence here, before any load is queued
            self.handle_preemptions(meta)
        self._fenced = None
        runnable = self._follow_node_epoch(meta) and self._join_node_lease(meta)  # else every command was refused
        self._idle_step = meta.idle
        due = time.monotonic() + COMMAND_DEADLINE_S
        for plan in meta.loads:
            self._recv[plan.request_id] = _Recv(plan, set(plan.cmd_ids), f"refused: {plan.refused}" if plan.refused
                                                else "")
            self._owner.update((c, plan.request_id) for c in plan.cmd_ids)
            self._due.update((c, due) for c in plan.cmd_ids)
        for plan in meta.stores:
            self._sends.setdefault(plan.request_id, _Sends()).pending.update(plan.cmd_ids)
            self._owner.update((c, plan.request_id) for c in plan.cmd_ids)
            self._due.update((c, due) for c in plan.cmd_ids)
        for request_id in meta.delayed_free:
            self._sends.setdefault(request_id, _Sends()).delayed = True
        if meta.refused:  # the plans name them, the node cache was lost before they were sent: failed, never run
            self.executor.refuse(meta.refused, "the node cache was lost before this command reached the workers")
        if not runnable:
            self._stores = []
            return
        refused = {c.cmd_id for c in meta.refused}
        others = meta.commands
        sliced = [plan for plan in meta.loads if plan.sliced]
        loads = [m for plan in meta.loads if not plan.sliced for m in plan.moves if m.cmd_id not in refused]
        self._stores = [m for m in meta.store_moves() if m.cmd_id not in refused]
        if others:
            self._submit(others)  # spills, promotions, puts, drops: in the index's order
        if sliced:  # first on the load lane: the forward about to run waits for them
            self._start_sliced(sliced, refused)
        if loads:
            self._submit(loads)  # one transfer for every load of the step
            if self._load_wait is not None:
                self._step_loads.update(c.cmd_id for c in loads)

    def _start_sliced(self, plans: list[LoadPlan], refused: set[int]) -> None:
        assert self.executor is not None and self.sliced is not None, "sliced loads on a rank that cannot slice"
        moves = [m for plan in plans for m in plan.moves if m.cmd_id not in refused]
        self._in_flight.update(m.cmd_id for m in moves)
        self.sliced.start(self.executor, moves, plans, self.hooks.order)

    def wait_for_layer(self, layer_name: str) -> None:
        """`wait_for_layer_load`: learns the layer (hook_map.py); with a sliced load in this step, the model's stream
        waits for that layer's slice."""
        self.hooks.announce(layer_name)
        if self.sliced is not None and self.sliced.step is not None:
            self.sliced.wait_for_layer(layer_name)

    def _end_sliced_forward(self) -> None:
        """The step's forward is done (wait_for_save, or get_finished where vLLM defers wait_for_save past a
        drafter's forward): the sliced load's guard runs while the hook map still holds this forward."""
        if self.sliced is not None and self.sliced.step is not None:
            self._sliced_step = self.sliced.end_forward(self.hooks.announced_now)

    def wait_for_save(self) -> None:
        """Queues every store of the step as one transfer behind the forward; returns at once."""
        self._end_sliced_forward()
        self.hooks.end_forward()
        if self._stores and self.executor is not None:
            self._submit(self._stores)
        self._stores = []

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        if self.executor is None:
            return set(), set(), set()
        self._end_sliced_forward()
        sliced_step, self._sliced_step = self._sliced_step, None
        if sliced_step is not None:  # its verdict is due in this step's output: vLLM then drops the step's token
            self.executor.wait_for_all({c for plan in sliced_step.plans for c in plan.cmd_ids}, self.sliced.wait_s)
        if self._idle_step:  # nothing runs until a load lands: wait for one here rather than spin through empty steps
            self._idle_step = False
            self.executor.wait_for_any({c for recv in self._recv.values() for c in recv.pending}, IDLE_WAIT_S)
        if self._load_wait is not None:
            self._load_wait.begin()
            if self._step_loads:  # reported now, the requests run next step instead of the one after
                step_loads, self._step_loads = self._step_loads, set()
                self.counters.add(Metric.STEP_LOAD_WAITS)
                if not self.executor.wait_for_all(step_loads, self._load_wait.budget()):
                    self.counters.add(Metric.STEP_LOAD_WAIT_MISSES)
            self._load_wait.end()
        completions = self.executor.poll()
        if self._late:
            completions = [done for done in completions if not self._dropped_late(done.cmd_id)]
        for done in completions:
            self._due.pop(done.cmd_id, None)
        now = time.monotonic()
        if self._due and next(iter(self._due.values())) <= now:  # the oldest first: one look when none is due
            completions += self._overdue(now)
        self._outbox.extend(completions)
        if completions:
            self._in_flight.difference_update(done.cmd_id for done in completions)
        if self._node is not None:
            self._node.settle(done.cmd_id for done in completions)
        for done in completions:
            request_id = self._owner.pop(done.cmd_id, None)
            if request_id is None:
                continue
            recv = self._recv.get(request_id)
            if recv is not None and done.cmd_id in recv.pending:
                recv.pending.discard(done.cmd_id)
                if not done.ok and not recv.failure:
                    recv.failure = done.reason
            sends = self._sends.get(request_id)
            if sends is not None:
                sends.pending.discard(done.cmd_id)
        if sliced_step is not None:
            self._judge_sliced(sliced_step)
        recving, failed = set(), set()
        for request_id, recv in list(self._recv.items()):
            if recv.pending or recv.plan.sliced:
                continue
            del self._recv[request_id]
            recving.add(request_id)
            if recv.failure:
                failed.add(request_id)
                self._load_failed(recv)
        sending = {r for r, s in self._sends.items() if s.delayed and not s.pending}
        for request_id in sending:
            del self._sends[request_id]
        for request_id in [r for r, s in self._sends.items() if not s.pending and not s.delayed]:
            del self._sends[request_id]
        return sending, recving, failed

    def _overdue(self, now: float) -> list[Completion]:
        """Failed answers to the commands waited for past their deadline (a load then recomputes, a store's request
        is freed); whatever their transfer answers later is dropped."""
        overdue = []
        for cmd_id, due in self._due.items():
            if due > now:
                break
            overdue.append(cmd_id)
        for cmd_id in overdue:
            del self._due[cmd_id]
        self._late.update(overdue)
        if self.executor is not None and self.executor.timer is not None:
            self.executor.timer.abandon(overdue)
        self.counters.add(Metric.OVERDUE_COMMANDS, len(overdue))
        logger.error("lmcache_npu rank %d: %d command(s) unanswered after %g s, answered as failed (loads recompute, "
                     "stores are dropped): %s", self.place.rank, len(overdue), COMMAND_DEADLINE_S, overdue[:8])
        return [Completion(cmd_id, self.place.rank, False, f"no answer within {COMMAND_DEADLINE_S:g} s")
                for cmd_id in overdue]

    def _dropped_late(self, cmd_id: int) -> bool:
        """Whether this answer comes after its command's deadline answered it (then it is dropped)."""
        if cmd_id not in self._late:
            return False
        self._late.discard(cmd_id)
        return True

    def _judge_sliced(self, step: SlicedStep) -> None:
        """Every sliced load of the step is settled now: loaded, or failed (a command failed or is still unanswered,
        or the guard found a layer that read before its slice landed)."""
        self._unwaited += bool(step.unwaited)  # forwards, not requests: the scheduler stops slicing after a few
        for plan in step.plans:
            recv = self._recv.pop(plan.request_id, None)
            failure = step.failure or (recv.failure if recv is not None else "") or (
                "unanswered when the forward ended" if recv is not None and recv.pending else "")
            if failure:
                self.counters.add(Metric.SLICED_LOAD_FAILURES)
                self._load_failed(_Recv(plan, set(), failure), adapter.FailureChannel.INVALID_BLOCKS
                                  if len(self.kv_cache_config.kv_cache_groups) == 1 else adapter.FailureChannel.NONE)

    def _load_failed(self, recv: _Recv, channel: Optional[adapter.FailureChannel] = None) -> None:
        """`channel`: how vLLM is told (a sliced load: as invalid blocks of one group, or not at all); by default the
        channel of asynchronous loads."""
        plan, channel = recv.plan, channel or self.failure_channel
        where = (f"lmcache_npu rank {self.place.rank}: loading request {plan.request_id} (tokens {plan.first_token}.."
                 f"{plan.end_token}) failed: {recv.failure}")
        if channel is adapter.FailureChannel.NONE:
            groups = len(self.kv_cache_config.kv_cache_groups)
            raise LoadFailedError(
                f"{where}. vLLM {'.'.join(map(str, adapter.VLLM_VERSION))} cannot recompute a failed "
                + (f"sliced load of a model with {groups} KV-cache groups (it takes a failed synchronous load as "
                   "block ids of one group only; load_mode auto loads such hits asynchronously)" if plan.sliced else
                   f"load of a model with {groups} KV-cache groups (its invalid-block handler maps one group only; "
                   "vLLM >= 0.30 takes request-level failures)")
                + ", so the engine stops instead of serving KV that may be wrong")
        outcome = ("vLLM recomputes these tokens" if self.load_failure_policy == "recompute" else
                   "vLLM fails the request (kv_load_failure_policy is 'fail'; 'recompute' would compute them instead)")
        logger.warning("%s; %s", where, outcome)
        if channel is adapter.FailureChannel.INVALID_BLOCKS:
            self._load_error_blocks.update(plan.error_block_ids)

    def take_load_error_blocks(self) -> set[int]:
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def build_worker_meta(self) -> Optional[LMCacheNPUWorkerMetadata]:
        usable = self._take_usable_change()
        epoch = self._take_epoch_change()
        plan = None if self._geometry_known else self.geometry
        timings = self.executor.timer.take() if self.executor is not None and self.executor.timer is not None else []
        if (not self._outbox and usable is None and epoch is None and plan is None and not timings and not self._steps
                and not self._unwaited):
            return None
        meta = LMCacheNPUWorkerMetadata(self._outbox, timings=timings, steps=self._steps,
                                        unwaited_sliced=self._unwaited)
        self._outbox, self._steps, self._unwaited = [], [], 0
        if plan is not None:
            meta.geometries[self.place.rank] = plan
        if usable is not None:
            meta.usable_slots[self.place.rank] = usable
        if epoch is not None:
            meta.node_epochs[self.place.rank] = epoch
        return meta

    def _take_epoch_change(self) -> Optional[str]:
        """The node epoch mapped here ("" none) when it changed since last told: the scheduler hands out commands of
        an epoch only once every rank has it mapped."""
        if self._node is None:
            return None
        epoch = self._node.epoch or ""
        if epoch == self._reported_epoch:
            return None
        self._reported_epoch = epoch
        return epoch

    def _take_usable_change(self) -> Optional[tuple[tuple[int, int], ...]]:
        """The arena's live slot ranges when they changed since last told (segments register in the background). A
        node cache mapping is reported whole, as its epoch (the service places chunks for every engine)."""
        if self.executor is None or self._node is not None:
            return None
        usable = self.executor.arena.usable_ranges()
        if usable == self._reported_usable:
            return None
        self._reported_usable = usable
        return usable

    def stats(self) -> LMCacheNPUStats:
        counts = self.counters.drain()
        counts.update(self.tier_counters.take())
        now = self.executor.arena.segment_stats() if self.executor is not None else self._arena_told
        if now != self._arena_told:  # arena gauges as counters: what grew since the last report (rarely anything)
            counts.update({k: v - self._arena_told.get(k, 0) for k, v in now.items()
                           if v != self._arena_told.get(k, 0)})
            self._arena_told = now
        if self.shares is None and self.executor is not None and self.place.world > 1:
            # whole objects per rank: what this rank's arena took and gave, comparable with tp_share's share objects
            for chunks, moved in ((Metric.STORED_CHUNKS, Metric.STORED_BYTES),
                                  (Metric.LOADED_CHUNKS, Metric.LOADED_BYTES)):
                if counts.get(chunks):
                    counts[per_rank(self.place.rank, moved)] = counts[chunks] * self.executor.arena.object_bytes
        return LMCacheNPUStats.of(counts)

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self._node is not None:  # the lease ends after the last command answered
            self._node.close()
            self._node = None


def engine_store_config(config: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """Data-parallel engines on one host each manage their own chunk files: `disk_path/dp<rank>`, under a
    `disk_path` checked first (others must not be able to rename a rank's directory away or create it first)."""
    dp_rank = adapter.data_parallel_rank(vllm_config)
    if dp_rank is None or config.store.disk_path is None:
        return config
    check_disk_parent(config.store.disk_path)
    store = dataclasses.replace(config.store, disk_path=f"{config.store.disk_path.rstrip('/')}/dp{dp_rank}")
    return dataclasses.replace(config, store=store)
