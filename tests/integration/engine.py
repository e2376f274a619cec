"""A vLLM 0.23 engine without a model: the real `Scheduler` (CPU platform, HMA on) loads `LMCacheNPUConnector`
through `kv_connector_module_path` and drives its scheduler half; worker connectors in this process (one per
tensor-parallel rank) get a preset's registered tensors and a simulated model (`sim.py`), and their outputs are
merged by vLLM's own `KVOutputAggregator`, as the engine core does.

After every step the pages every scheduled request's next forward reads are checked against the simulated model's
bytes (`Engine.check`), so a load that delivers wrong rows, or a recompute that misses some, fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import numpy as np
import torch
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from lmcache_npu.integration.vllm import LMCacheNPUConnector  # noqa: E402
from lmcache_npu.integration.vllm.stats import LMCacheNPUStats  # noqa: E402
from lmcache_npu.transfer.slices import layer_key  # noqa: E402
from lmcache_npu.tools.presets import PresetKV, build_preset  # noqa: E402

from . import vllm_cpu  # noqa: F401  (forces the CPU platform before vLLM is used)
from .pd_stub import PDStubConnector  # noqa: E402
from .sim import SimModel, prefix_hashes  # noqa: E402
from .vllm_cpu import tiny_model_dir  # noqa: E402

VOCAB = 32000


def register_compressed_managers(kv_cache_config: Any) -> None:
    """vllm-ascend registers a manager for its compressed MLA spec, whose block holds block_size stored rows, i.e.
    block_size x compress_ratio tokens; this test double does the same for the presets' stand-in class."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    register_all_kvcache_specs(None)  # the built-in specs first: the registry fills itself only while empty

    class CompressedAttentionManager(FullAttentionManager):
        def __init__(self, kv_cache_spec: Any, **kwargs: Any) -> None:
            super().__init__(kv_cache_spec, **kwargs)
            self.block_size = kv_cache_spec.block_size * kv_cache_spec.compress_ratio

    for group in kv_cache_config.kv_cache_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", {"": group.kv_cache_spec}).values()
        for spec in specs:
            if type(spec).__name__ == "AscendMLAAttentionSpec":
                KVCacheSpecRegistry.register(type(spec), CompressedAttentionManager,
                                             uniform_type_base_spec=FullAttentionSpec)


SCENARIO_CHUNK_TOKENS = 256


@dataclass
class EngineSpec:
    preset: str = "llama3-8b"
    family: str = "ascend"
    max_layers: Optional[int] = 2
    num_blocks: int = 96
    world: int = 1
    backend: str = "emu"
    extra_config: dict = field(default_factory=dict)
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 8
    max_model_len: int = 16384
    failure_policy: str = "recompute"
    kv_role: str = "kv_both"
    check_every_step: bool = True
    async_scheduling: bool = False  # vLLM 0.23's default: step N+1 is scheduled before step N's output is applied
    loads_after_forward: bool = False  # vLLM >= 0.30 without synchronous loads: start_load_kv after the forward
    device: str = "cpu"  # where the preset's KV caches live (the NPU suite runs the same scenarios on npu:0)
    model_dir: Optional[str] = None  # the model directory vLLM is told about (its weights name the chunks); None: tiny
    # "before" / "after": a P/D connector stand-in (pd_stub.py) beside ours in vLLM's MultiConnector, in that place
    beside: Optional[str] = None
    # layers whose attention skips wait_for_layer_load in every forward from the `skip_hooks_from`-th computing step
    # on (vllm-ascend's MLA on short extends; a negative control of the sliced loads' guard)
    skip_hooks: frozenset = frozenset()
    skip_hooks_from: int = 0


class Runner:
    """One rank's view of the requests, built only from scheduler outputs as vLLM's model runner builds it."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def update(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
            else:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)


class Engine:
    def __init__(self, spec: EngineSpec, worker_factory: Optional[Callable[..., Any]] = None) -> None:
        self.spec = spec
        self.presets: list[PresetKV] = [build_preset(spec.preset, spec.family, num_blocks=spec.num_blocks, seed=rank,
                                                     device=torch.device(spec.device), max_layers=spec.max_layers)
                                        for rank in range(spec.world)]
        kv_cache_config = self.presets[0].kv_cache_config
        register_compressed_managers(kv_cache_config)
        block_size = int(np.lcm.reduce([g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]))
        self.configs = [self._vllm_config(spec, block_size, kv_cache_config, rank) for rank in range(spec.world)]
        for config in self.configs[1:]:  # one engine: vLLM hands every rank the same config, engine id and all
            config.kv_transfer_config.engine_id = self.configs[0].kv_transfer_config.engine_id
        vc = self.configs[0]
        scheduler_config = generate_scheduler_kv_cache_config([kv_cache_config])
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vc)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_block_size, sha256)
        scheduler_cls = vc.scheduler_config.get_scheduler_cls()
        self.scheduler: Scheduler = scheduler_cls(
            vllm_config=vc, kv_cache_config=scheduler_config, structured_output_manager=StructuredOutputManager(vc),
            block_size=self.block_size, hash_block_size=self.hash_block_size, log_stats=True)
        self.top = self.scheduler.connector  # what vLLM calls: ours, or a MultiConnector holding ours
        self.connector = _ours(self.top)
        self.pd_stub = next((c for c in getattr(self.top, "_connectors", ()) if isinstance(c, PDStubConnector)), None)
        PDStubConnector.writer = self._received_rows
        self._build_meta = self.connector.build_connector_meta
        self.connector.build_connector_meta = self._checked_build_meta
        make = worker_factory or (MultiConnector if spec.beside else LMCacheNPUConnector)
        self.engine_workers = [make(self.configs[r], KVConnectorRole.WORKER, self.presets[r].kv_cache_config)
                               for r in range(spec.world)]
        self.workers = [_ours(worker) for worker in self.engine_workers]
        handshake = {}
        with contextlib.ExitStack() as stack:
            if self.presets[0].model.fractal_nz:  # 310P: the preset lays NZ bytes into plain tensors, on any device
                from lmcache_npu.integration.vllm import worker as worker_module

                stack.enter_context(mock.patch.object(worker_module, "_fractal_nz", lambda caches: True))
            for rank, (worker, preset) in enumerate(zip(self.engine_workers, self.presets)):
                # each rank's process keeps its engine connector where vLLM's kv_transfer_state says
                with mock.patch.object(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker):
                    worker.register_kv_caches(preset.kv_caches)
                    metadata = worker.get_handshake_metadata()
                if metadata is not None:
                    handshake[(0, rank)] = pickle.loads(pickle.dumps(metadata))
        if handshake:  # as vLLM's engine core: only when some worker has any
            self.top.set_xfer_handshake_metadata_pp_aware(handshake)
        self.sims = [SimModel(r, w.worker_half.layout) for r, w in enumerate(self.workers)]
        self.hook_layers = [attention_layers(p.kv_cache_config) for p in self.presets]
        self.forwards = 0  # steps that computed something
        self.runners = [Runner() for _ in self.workers]
        self.aggregator = KVOutputAggregator(spec.world)
        self.hashes: dict[str, np.ndarray] = {}
        self.pending: dict[str, list[int]] = {}  # tokens the runner sampled that the scheduler has not applied yet
        self.in_flight: list[tuple[Any, Any]] = []  # (scheduler output, model output) not yet applied
        self.requests: dict[str, Request] = {}  # every request ever added (vLLM drops finished ones)
        self.loaded_tokens: dict[str, int] = {}  # request -> tokens vLLM took from the connector
        self.stats = LMCacheNPUStats()  # every step's connector stats, as the engine reports them
        self.steps = 0
        self.problems: list[str] = []
        self._ids = itertools.count()

    @staticmethod
    def _vllm_config(spec: EngineSpec, block_size: int, kv_cache_config: Any, rank: int) -> VllmConfig:
        mamba = any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in kv_cache_config.kv_cache_groups)
        # the scenarios' budgets (blocks, preemptions, fenced pages) were sized for 256-token chunks; mamba models
        # keep their state interval's size; tests/replay/test_defaults.py and the engines cover the automatic size
        sized = {} if mamba else {"chunk_tokens": SCENARIO_CHUNK_TOKENS}
        ours = dict(kv_connector="LMCacheNPUConnector", kv_connector_module_path="lmcache_npu.integration.vllm",
                    kv_role=spec.kv_role, kv_load_failure_policy=spec.failure_policy,
                    # every hit claimed unless a test says otherwise: the scenarios check what loads do, and a
                    # simulated step's time says nothing of a model's (tests/integration/test_cut_point)
                    kv_connector_extra_config={"backend": spec.backend, **sized, "load_policy": "load-all",
                                               **spec.extra_config,
                                               # a node cache's engines have no arena size of their own
                                               **({} if "node_cache" in spec.extra_config
                                                  else {"cpu_bytes": spec.extra_config.get("cpu_bytes", "64MiB")})})
        if spec.beside is None:
            kt = KVTransferConfig(**ours)
        else:
            stub = dict(kv_connector="PDStubConnector", kv_connector_module_path="tests.integration.pd_stub",
                        kv_role=spec.kv_role)
            children = [stub, ours] if spec.beside == "before" else [ours, stub]
            kt = KVTransferConfig(kv_connector="MultiConnector", kv_role=spec.kv_role,
                                  kv_load_failure_policy=spec.failure_policy,
                                  kv_connector_extra_config={"connectors": children})
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=mamba,
                            mamba_cache_mode="align" if mamba else "none")
        vc = VllmConfig(
            model_config=ModelConfig(model=spec.model_dir or tiny_model_dir(), skip_tokenizer_init=True,
                                     dtype="float32", max_model_len=spec.max_model_len),
            cache_config=cache,
            scheduler_config=SchedulerConfig(max_num_seqs=spec.max_num_seqs,
                                             max_num_batched_tokens=spec.max_num_batched_tokens,
                                             max_model_len=spec.max_model_len, is_encoder_decoder=False,
                                             enable_chunked_prefill=True, async_scheduling=spec.async_scheduling),
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=spec.world),
            kv_transfer_config=kt)
        vc.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if rank:
            vc = copy.copy(vc)
            vc.parallel_config = copy.copy(vc.parallel_config)
        vc.parallel_config.rank = rank
        return vc

    def _checked_build_meta(self, scheduler_output: Any) -> Any:
        """The connector must not change the scheduler output, and its metadata must survive pickling (vLLM sends it
        to worker processes)."""
        before = pickle.dumps(scheduler_output)
        meta = self._build_meta(scheduler_output)
        assert pickle.dumps(scheduler_output) == before, "build_connector_meta changed the scheduler output"
        return pickle.loads(pickle.dumps(meta))

    # ---- requests -------------------------------------------------------------------------------------------

    def add(self, tokens: list[int], max_tokens: int = 4, request_id: Optional[str] = None,
            lora_request: Any = None, kv_transfer_params: Optional[dict] = None) -> str:
        request_id = request_id or f"r{next(self._ids)}"
        extra = None if kv_transfer_params is None else {"kv_transfer_params": dict(kv_transfer_params)}
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        request = Request(request_id, list(tokens), sampling, None, block_hasher=self.hasher,
                          lora_request=lora_request)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request_id

    def output_tokens(self, request_id: str) -> list[int]:
        return list(self.requests[request_id].output_token_ids)

    def evict_device_cache(self) -> None:
        """vLLM forgets its own prefix cache (as when HBM pressure evicts it): later hits can come only from the
        connector."""
        assert self.scheduler.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def tokens(self, request: Request) -> list[int]:
        """The request's tokens as the runner knows them: the scheduler's plus samples still on their way to it."""
        return list(request.all_token_ids) + self.pending.get(request.request_id, [])

    def _hashes(self, request: Request) -> np.ndarray:
        tokens = self.tokens(request)
        known = self.hashes.get(request.request_id)
        if known is not None and len(known) > len(tokens):
            known = known[:len(tokens)]
        if known is None or len(known) < len(tokens):
            known = self.hashes[request.request_id] = prefix_hashes(tokens, known)
        return known

    def _sample(self, request: Request, end: int) -> int:
        """The token a deterministic model emits after `end` tokens of this request."""
        return 3 + int(self._hashes(request)[end - 1] % np.uint64(VOCAB - 3))

    # ---- steps ----------------------------------------------------------------------------------------------

    def check(self, requests: list[tuple[Request, int]], what: str, ranks: Optional[list[int]] = None) -> None:
        """Every row each request's next forward (at token n) reads, on every rank, against the model's bytes."""
        for rank in ranks if ranks is not None else range(len(self.sims)):
            sim, runner = self.sims[rank], self.runners[rank]
            for request, n in requests:
                tables = runner.tables[request.request_id]
                self.problems += sim.check(self._hashes(request), tables, n, f"{what} {request.request_id}")
        if self.problems:
            raise AssertionError("\n".join(self.problems[:10]))

    def step(self) -> Any:
        """One engine step: schedule and execute; the scheduler sees the output now (sync) or after the next
        schedule (async, like vLLM's batch queue of two)."""
        so = self.scheduler.schedule()
        output = self._execute(so)
        self.in_flight.append((so, output))
        while self.in_flight and (not self.spec.async_scheduling or len(self.in_flight) > 1
                                  or not so.total_num_scheduled_tokens):
            self._apply(*self.in_flight.pop(0))
        self.steps += 1
        if not so.total_num_scheduled_tokens:
            time.sleep(0.002)  # loads run on the transfer thread; let it work instead of spinning
        return so

    def _plan_step(self, so: Any) -> tuple[list, dict[str, int], dict[str, list[int]]]:
        """The step's (request, tokens) pairs, each request's first computed token, and what each one samples (its
        next token once the step reaches the end of what it knows, else nothing)."""
        scheduled = [(self.scheduler.requests[r], n) for r, n in so.num_scheduled_tokens.items()]
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update({r: cached.num_computed_tokens[i] for i, r in enumerate(cached.req_ids)})
        samples: dict[str, list[int]] = {}
        for request, count in scheduled:
            end = starts[request.request_id] + count
            samples[request.request_id] = [self._sample(request, end)] if end >= len(self.tokens(request)) else []
        return scheduled, starts, samples

    @staticmethod
    def _runner_output(so: Any, scheduled: list, samples: dict[str, list[int]], kvo: Any) -> Any:
        """One rank's ModelRunnerOutput: the sampled tokens of a step that computed, else the connector output only."""
        if not so.total_num_scheduled_tokens:  # a copy: with an empty kvo this is vLLM's shared EMPTY output, which
            # the aggregator would write into (in vLLM each rank's output arrives unpickled, a fresh object)
            return copy.copy(ModelRunnerOutput.with_kv_conn_output_only(kvo))
        req_ids = [request.request_id for request, _ in scheduled]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[samples[r] for r in req_ids], kv_connector_output=kvo)

    def _execute(self, so: Any) -> Any:
        meta = so.kv_connector_metadata
        scheduled, starts, samples = self._plan_step(so)
        outputs = []
        for rank, (worker, sim, runner) in enumerate(zip(self.engine_workers, self.sims, self.runners)):
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if not self.spec.loads_after_forward:
                worker.start_load_kv(None)
            runner.update(so)
            if so.total_num_scheduled_tokens:
                self._announce(worker, rank)
                if self.spec.check_every_step:
                    doomed = self._doomed(rank)  # vLLM drops this forward's token for them and recomputes
                    self.check([(req, starts[req.request_id]) for req, _ in scheduled if req.request_id not in doomed],
                               f"step {self.steps} before", [rank])
                for request, count in scheduled:
                    start = starts[request.request_id]
                    sim.forward(self._hashes(request), runner.tables[request.request_id], start, start + count)
            if self.spec.loads_after_forward:
                worker.start_load_kv(None)
            if so.total_num_scheduled_tokens:
                worker.wait_for_save()
            sending, recving = worker.get_finished(so.finished_req_ids)
            kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                    kv_connector_stats=worker.get_kv_connector_stats(),
                                    kv_connector_worker_meta=worker.build_connector_worker_meta(),
                                    invalid_block_ids=worker.get_block_ids_with_load_errors())
            kvo = pickle.loads(pickle.dumps(kvo))  # it crosses a process boundary in vLLM
            worker.clear_connector_metadata()
            outputs.append(self._runner_output(so, scheduled, samples, kvo))
        for req_id, new in samples.items():
            self.pending.setdefault(req_id, []).extend(new)
        ours = next((m for m in (meta, *getattr(meta, "metadata", ())) if hasattr(m, "loads")), None)
        if ours is not None:  # a sliced load is never reported received: vLLM took its tokens when it scheduled it
            self.loaded_tokens.update((plan.request_id, plan.end_token) for plan in ours.loads if plan.sliced)
        self.forwards += bool(so.total_num_scheduled_tokens)
        return self.aggregator.aggregate(outputs)

    def _doomed(self, rank: int) -> set[str]:
        """Requests whose sliced load already failed on this rank when the forward starts."""
        step = self.workers[rank].worker_half.sliced.step if self.workers[rank].worker_half.sliced else None
        return {plan.request_id for plan in step.plans} if step is not None and step.failure else set()

    def _announce(self, worker: Any, rank: int) -> None:
        """The forward's attention layers call wait_for_layer_load in order, as vLLM's decorator does, before any
        reads a page (the check and the simulated forward come after)."""
        skipping = self.forwards >= self.spec.skip_hooks_from
        for name in self.hook_layers[rank]:
            if not (skipping and name in self.spec.skip_hooks):
                worker.wait_for_layer_load(name)

    def _apply(self, so: Any, output: Any) -> None:
        kvo = output.kv_connector_output
        for req_id in (kvo.finished_recving or ()) if kvo else ():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                self.loaded_tokens[req_id] = request.num_computed_tokens
        for engine_output in self.scheduler.update_from_output(so, output).values():
            stats = engine_output.scheduler_stats
            if stats is not None and stats.kv_connector_stats:  # what vLLM's stat loggers receive
                data = dict(stats.kv_connector_stats)
                ours = data.get(LMCacheNPUConnector.__name__)  # a MultiConnector's stats are kept per child
                self.stats.aggregate(LMCacheNPUStats(data=dict(ours.data if ours is not None else data)))
        for index, req_id in enumerate(getattr(output, "req_ids", []) or []):
            applied = len(output.sampled_token_ids[index])
            self.pending[req_id] = self.pending.get(req_id, [])[applied:]

    def run(self, max_steps: int = 2000) -> None:
        """Steps until every request finished and every delayed free and transfer settled."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.busy() and not self.in_flight:
                return
            self.step()
        raise AssertionError(f"engine did not settle in {max_steps} steps: {self.scheduler.get_request_counts()} "
                             f"requests, {self.connector.scheduler_half.index.in_flight} commands in flight")

    def busy(self) -> bool:
        half = self.connector.scheduler_half
        return bool(half.requests) or (half.index is not None and half.index.in_flight > 0)

    def close(self) -> None:
        for worker in self.engine_workers:
            worker.shutdown()
        self.top.shutdown()

    def _received_rows(self, rank: int, request_id: str, tables: list[list[int]], first: int, end: int) -> None:
        """The rows a prefill engine computed for [first, end) of the request, as the P/D stand-in receives them."""
        self.sims[rank].forward(self._hashes(self.requests[request_id]), tables, first, end)


def attention_layers(kv_cache_config: Any) -> list[str]:
    """The registered layers vLLM's attention decorator announces, in forward order: every one but mamba's."""
    names = [name for group in kv_cache_config.kv_cache_groups if type(group.kv_cache_spec).__name__ != "MambaSpec"
             for name in group.layer_names]
    return sorted(names, key=lambda name: (layer_key(name) if isinstance(layer_key(name), int) else 1 << 30, name))


def _ours(connector: Any) -> LMCacheNPUConnector:
    """The plugin's connector: `connector` itself, or its child inside a MultiConnector."""
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        if isinstance(candidate, LMCacheNPUConnector):
            return candidate
    raise AssertionError(f"no LMCacheNPUConnector in {type(connector).__name__}")


@contextlib.contextmanager
def engines_closed_after() -> Iterator[list[Engine]]:
    """A list to put engines in: on the way out each is closed (one failing to close does not keep the others open),
    and vLLM's NONE_HASH, which an engine re-seeds from PYTHONHASHSEED, is put back so later tests in this process
    hash as before."""
    from vllm.v1.core import kv_cache_utils

    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    engines: list[Engine] = []
    try:
        yield engines
    finally:
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.close()
        if saved is not None:
            kv_cache_utils.NONE_HASH = saved
