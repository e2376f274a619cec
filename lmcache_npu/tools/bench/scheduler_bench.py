"""`lmcache-npu bench-scheduler`: the host cost the connector's scheduler half adds to vLLM's scheduling loop.

Measured on vLLM's own objects (`Request` with its block hasher, `SchedulerOutput`) against the scheduler half of
`LMCacheNPUConnector` with an index built from a preset's plan, nothing simulated in between:
* `get_num_new_matched_tokens` for a 128K-token prompt whose chunks are all in the arena (the hit path: 511 keys,
  reservations) and whose chunks are nowhere (the miss path), on a fresh request (its keys are built) and asked
  again (vLLM asks a waiting request every step);
* `build_connector_meta` for 64 running requests in decode (a chunk completes now and then and is stored) and for
  a prefill step of 16 requests of 8K tokens (512 chunks to store at once).
Each is measured with the in-process index and with the node cache (`node_cache`: a live `NodeCacheService` in a
thread of this process, its `NodeCacheClient` answering every verb over the Unix socket), plus the node cache's
floor: one round trip of a verb that does nothing. The node's pool keeps one page per chunk and rank (the index's
work does not depend on a chunk's bytes, and thousands of real chunks would not fit a bench host).
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

LOOKUP_TOKENS = 128 * 1024
DECODE_REQUESTS = 64
DECODE_PROMPT = 4096
DECODE_STEPS = 512
PREFILL_REQUESTS = 16
PREFILL_PROMPT = 8192
LOOKUP_ARENA_CHUNKS = 2 * LOOKUP_TOKENS // 256 + 64
META_ARENA_CHUNKS = PREFILL_REQUESTS * PREFILL_PROMPT // 256 + 2048
NODE_OBJECT_BYTES = 4096  # the node cache's chunk object per rank in the bench (one page)
INDEXES = ("in-process", "node cache")


@dataclass
class SchedulerTiming:
    operation: str
    preset: str
    requests: int
    tokens: int
    median_us: float
    p99_us: float
    max_us: float
    target_us: Optional[float] = None
    index: str = "in-process"  # or "node cache": the scheduler half's ChunkManager

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _force_cpu_platform() -> None:
    """vLLM picks UnspecifiedPlatform on a machine without an accelerator, which turns the hybrid KV-cache manager
    off; the bench wants the engine's configuration as it is on a serving host."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    current = platforms._current_platform
    if current is None or type(current).__name__ == "UnspecifiedPlatform":
        platforms._current_platform = CpuPlatform()


def _model_dir() -> str:
    directory = tempfile.mkdtemp(prefix="lmcache-npu-bench-model-")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 32000, "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


@contextmanager
def node_service(slots: int) -> Iterator[str]:
    """A node cache service of `slots` one-page slots in a thread of this process; its socket path."""
    from ...node.capacity import NodeCapacity
    from ...node.service import NodeCacheService, ServiceOptions
    from ...store.arena import slot_bytes_for
    from ...store.config import StoreConfig

    directory = tempfile.mkdtemp(prefix="lmcache-npu-bench-node-", dir="/tmp")  # a Unix socket path is short
    path = os.path.join(directory, "node.sock")
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(slots * slot_bytes_for(NODE_OBJECT_BYTES)),
                                              StoreConfig(pinned=False, hugepages="off"))).start()
    try:
        yield path
    finally:
        service.close()
        shutil.rmtree(directory, ignore_errors=True)


class _Bench:
    """A scheduler half over a preset's plan, with vLLM requests made by vLLM's block hasher; with `node` (a node
    cache's socket) the half's index is that node cache's client."""

    def __init__(self, preset: str, device_family: str, arena_chunks: int, node: Optional[str] = None) -> None:
        _force_cpu_platform()
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
        )

        from ...config import load_config
        from ...integration.vllm.metadata import WorkerGeometry, plan_group_geometry
        from ...integration.vllm.scheduler import SchedulerHalf
        from ...node.messages import WEIGHTS_CONTENT
        from ..presets import preset_layout
        from ...store.keys import model_fingerprint, namespace_of

        layout, kv = preset_layout(preset, device_family, num_blocks=2)
        groups = kv.kv_cache_config.kv_cache_groups
        block = int(np.lcm.reduce([g.kv_cache_spec.block_size for g in groups]))
        mamba = any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in groups)
        extra: dict[str, Any] = {"cpu_bytes": arena_chunks * (layout.plan.object_bytes + 4096)}
        object_bytes = layout.plan.object_bytes
        if node is not None:
            # the service is up in this process: the half attaches before it is timed, however loaded the host
            extra, object_bytes = {"node_cache": node, "node_cache_start_wait_ms": 60_000}, NODE_OBJECT_BYTES
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=_model_dir(), skip_tokenizer_init=True, max_model_len=LOOKUP_TOKENS + 1024),
            cache_config=CacheConfig(block_size=block, enable_prefix_caching=mamba,
                                     mamba_cache_mode="align" if mamba else "none"),
            scheduler_config=SchedulerConfig(max_model_len=LOOKUP_TOKENS + 1024, is_encoder_decoder=False,
                                             max_num_batched_tokens=PREFILL_REQUESTS * PREFILL_PROMPT),
            kv_transfer_config=KVTransferConfig(kv_connector="LMCacheNPUConnector", kv_role="kv_both",
                                                kv_connector_module_path="lmcache_npu.integration.vllm",
                                                kv_load_failure_policy="recompute",
                                                kv_connector_extra_config=extra))
        self.vllm_config.cache_config.num_gpu_blocks = 1 << 20
        scheduler_config = generate_scheduler_kv_cache_config([kv.kv_cache_config])
        self.half = SchedulerHalf(load_config(extra, environ={}), self.vllm_config, scheduler_config)
        fingerprint = layout.plan.fingerprint
        from ...integration.vllm import adapter

        namespace = namespace_of(model_fingerprint(**adapter.model_facts(self.vllm_config, None)), fingerprint)
        self.half.set_worker_geometry([WorkerGeometry(
            0, 1, True, namespace=namespace, layout_fingerprint=fingerprint, chunk_tokens=layout.plan.chunk_tokens,
            object_bytes=object_bytes, num_slots=arena_chunks, groups=plan_group_geometry(layout.groups),
            weights=WEIGHTS_CONTENT)])  # the bench's model is named by its content, as a node cache requires
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.half.hash_block_size, sha256)
        self.groups = len(groups)
        self.block_size = block
        self._next_block = 1
        self._ids = 0

    def request(self, tokens: int, seed: int) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._ids += 1
        prompt = np.random.default_rng(seed).integers(5, 30000, tokens).tolist()
        return Request(f"bench-{self._ids}", prompt, SamplingParams(max_tokens=1 << 20), None,
                       block_hasher=self.hasher)

    def blocks(self, tokens: int) -> tuple[list[int], ...]:
        """Fresh block ids for `tokens` tokens in every scheduler group (its blocks hold its own token count)."""
        out = []
        for group in range(self.groups):
            per_block = min((g.tokens_per_block for g in self.half.groups if g.scheduler_group == group),
                            default=self.block_size)
            count = -(-tokens // per_block)
            out.append(list(range(self._next_block, self._next_block + count)))
            self._next_block += count
        return tuple(out)

    def settle(self) -> None:
        """Every rank completes every command (the worker side is not part of this bench)."""
        from ...integration.vllm.metadata import LMCacheNPUWorkerMetadata
        from ...store.commands import Completion

        index = self.half.index
        while index.in_flight:
            index.take_commands()
            done = [Completion(cmd_id, 0, True) for cmd_id in index.pending_command_ids()]
            self.half.update_connector_output(type("Output", (), {
                "kv_connector_worker_meta": LMCacheNPUWorkerMetadata(done)})())

    def store_prompt(self, request: Any) -> None:
        """The request's prompt chunks stored and ready, as a first request would leave them."""
        half = self.half
        half.index.prepare_store("warm", list(enumerate(half.chunk_keys(request))))
        self.settle()


def _timed(calls: int, work: Callable[[int], Any]) -> list[float]:
    out = []
    for i in range(calls):
        start = time.perf_counter()
        work(i)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def _summary(operation: str, preset: str, requests: int, tokens: int, samples: list[float],
             target: Optional[float] = None, index: str = INDEXES[0]) -> SchedulerTiming:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return SchedulerTiming(operation, preset, requests, tokens, round(statistics.median(ordered), 1), round(p99, 1),
                           round(ordered[-1], 1), target, index)


def _index_of(node: Optional[str]) -> str:
    return INDEXES[0] if node is None else INDEXES[1]


def bench_lookup(preset: str, device_family: str, repeats: int, node: Optional[str] = None) -> list[SchedulerTiming]:
    """First calls for fresh requests (their chunk keys are built then) and repeated calls for one waiting request
    (vLLM asks again every step until it is scheduled)."""
    bench = _Bench(preset, device_family, arena_chunks=LOOKUP_ARENA_CHUNKS, node=node)
    half = bench.half
    bench.store_prompt(bench.request(LOOKUP_TOKENS, seed=1))
    expected = (LOOKUP_TOKENS - 1) // half.chunk_tokens * half.chunk_tokens
    out = []
    for label, seed in (("hit", 1), ("miss", 2)):
        first, again = [], []
        for _ in range(max(1, repeats // 20)):
            request = bench.request(LOOKUP_TOKENS, seed=seed)
            start = time.perf_counter()
            found, _ = half.get_num_new_matched_tokens(request, 0)
            first.append((time.perf_counter() - start) * 1e6)
            if found != (expected if label == "hit" else 0):
                raise RuntimeError(f"bench setup: the 128K prompt matched {found} tokens")
            again += _timed(20, lambda _, asked=request: half.get_num_new_matched_tokens(asked, 0))
            half.request_finished(request, ())
        out.append(_summary(f"get_num_new_matched_tokens, {label}, first call", preset, 1, LOOKUP_TOKENS, first,
                            target=1000.0, index=_index_of(node)))
        out.append(_summary(f"get_num_new_matched_tokens, {label}, asked again", preset, 1, LOOKUP_TOKENS, again,
                            target=1000.0, index=_index_of(node)))
    if node is not None:
        client = half.index
        floor = _timed(repeats, lambda _: client.presence([]))
        out.append(_summary("node cache round trip (a verb that does nothing)", preset, 1, 0, floor,
                            index=_index_of(node)))
    return out


def bench_meta(preset: str, device_family: str, node: Optional[str] = None) -> list[SchedulerTiming]:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    bench = _Bench(preset, device_family, arena_chunks=META_ARENA_CHUNKS, node=node)
    half = bench.half

    def output(new: list, cached: list, scheduled: dict[str, int]) -> Any:
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r, _ in cached], resumed_req_ids=set(), new_token_ids=[],
                all_token_ids={}, new_block_ids=[ids for _, ids in cached],
                num_computed_tokens=[r.num_computed_tokens for r, _ in cached],
                num_output_tokens=[r.num_output_tokens for r, _ in cached]),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[],
            finished_req_ids=set(), free_encoder_mm_hashes=[])

    prefill = [bench.request(PREFILL_PROMPT, seed=100 + i) for i in range(PREFILL_REQUESTS)]
    new = []
    for request in prefill:
        half.on_new_request(request)
        new.append(NewRequestData.from_request(request, bench.blocks(PREFILL_PROMPT)))
    step = output(new, [], {r.request_id: PREFILL_PROMPT for r in prefill})
    start = time.perf_counter()
    meta = half.build_connector_meta(step)
    prefill_us = (time.perf_counter() - start) * 1e6
    stored = sum(len(p.cmd_ids) for p in meta.stores)
    if stored != PREFILL_REQUESTS * PREFILL_PROMPT // half.chunk_tokens:
        raise RuntimeError(f"bench setup: the prefill step stored {stored} chunks")
    bench.settle()

    running = [bench.request(DECODE_PROMPT, seed=1000 + i) for i in range(DECODE_REQUESTS)]
    new = []
    for request in running:
        half.on_new_request(request)
        new.append(NewRequestData.from_request(request, bench.blocks(DECODE_PROMPT + DECODE_STEPS)))
        request.num_computed_tokens = 0
    half.build_connector_meta(output(new, [], {r.request_id: DECODE_PROMPT for r in running}))
    bench.settle()
    for request in running:
        request.num_computed_tokens = DECODE_PROMPT
        request.append_output_token_ids(7)
    samples, decode_stores = [], 0
    for step_index in range(DECODE_STEPS):
        step = output([], [(r, None) for r in running], {r.request_id: 1 for r in running})
        start = time.perf_counter()
        meta = half.build_connector_meta(step)
        samples.append((time.perf_counter() - start) * 1e6)
        decode_stores += sum(len(p.cmd_ids) for p in meta.stores)
        bench.settle()
        for request in running:
            request.num_computed_tokens += 1
            request.append_output_token_ids(8 + step_index % 100)
    if decode_stores != DECODE_REQUESTS * ((DECODE_PROMPT + DECODE_STEPS) // half.chunk_tokens
                                           - DECODE_PROMPT // half.chunk_tokens):
        raise RuntimeError(f"bench setup: decode stored {decode_stores} chunks")
    index = _index_of(node)
    return [_summary("build_connector_meta, decode step", preset, DECODE_REQUESTS, DECODE_PROMPT, samples,
                     index=index),
            SchedulerTiming("build_connector_meta, prefill step", preset, PREFILL_REQUESTS, PREFILL_PROMPT,
                            round(prefill_us, 1), round(prefill_us, 1), round(prefill_us, 1), index=index)]


PRESETS = (("llama3-8b", "cuda"), ("deepseek-v4-flash", "ascend"))


def run_scheduler_bench(repeats: int = 200, indexes: tuple[str, ...] = INDEXES) -> list[SchedulerTiming]:
    """Every measurement with each of `indexes` (in-process, node cache), the two side by side per preset."""
    unknown = sorted(set(indexes) - set(INDEXES))
    if unknown or not indexes:
        raise ValueError(f"indexes must be some of {', '.join(INDEXES)}, got {list(indexes)}")
    if INDEXES[1] in indexes and not os.environ.get("PYTHONHASHSEED", "").strip().strip("0"):
        # a node cache's engines must hash alike (the connector refuses otherwise); the bench is its own deployment
        os.environ["PYTHONHASHSEED"] = str(secrets.randbelow(2**32 - 1) + 1)
    results: list[SchedulerTiming] = []
    for preset, family in PRESETS:
        for index in indexes:
            gc.collect()
            gc.freeze()  # as vLLM's engine core does after start-up: collections then skip the long-lived heap
            try:
                if index == INDEXES[0]:
                    results += bench_lookup(preset, family, repeats)
                    results += bench_meta(preset, family)
                    continue
                with node_service(LOOKUP_ARENA_CHUNKS) as node:
                    results += bench_lookup(preset, family, repeats, node)
                with node_service(META_ARENA_CHUNKS) as node:
                    results += bench_meta(preset, family, node)
            finally:
                gc.unfreeze()
    return results


def render_scheduler_bench(results: list[SchedulerTiming]) -> Any:
    from rich.table import Table

    table = Table(title="connector scheduler half: host time per call (vLLM 0.23 objects, this machine)")
    for col in ("operation", "preset", "index", "requests", "tokens each", "median µs", "p99 µs", "max µs",
                "target µs"):
        table.add_column(col, justify="left" if col in ("operation", "preset", "index") else "right")
    for r in results:
        table.add_row(r.operation, r.preset, r.index, str(r.requests), f"{r.tokens:,}", f"{r.median_us:,.1f}",
                      f"{r.p99_us:,.1f}", f"{r.max_us:,.1f}", "-" if r.target_us is None else f"{r.target_us:,.0f}")
    return table
