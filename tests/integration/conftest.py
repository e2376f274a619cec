"""Engines for the connector tests, closed after each test, and the leak check every scenario ends with."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest

from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.node.service import NodeCacheService, ServiceOptions

from .engine import Engine, EngineSpec

# (preset, family) -> engine settings that keep each model's mix of KV-cache kinds at test size
PRESET_ENGINES: dict[tuple[str, str], dict] = {}
for _family in ("ascend", "cuda"):
    PRESET_ENGINES.update({
        ("llama3-8b", _family): {"max_layers": 2},
        ("qwen3-32b", _family): {"max_layers": 2},
        ("deepseek-v3", _family): {"max_layers": 2},
        ("deepseek-v3.2-c8", _family): {"max_layers": 2},
        ("deepseek-v4-flash", _family): {"max_layers": 6, "num_blocks": 600},  # SWA-only, c4, c128 layers
        ("gemma3-27b", _family): {"max_layers": 6, "num_blocks": 400},  # 5 sliding-window + 1 global
        ("gpt-oss-120b", _family): {"max_layers": 2},  # sliding window 128 + full
        ("qwen3-next-80b", _family): {"max_layers": 4, "num_blocks": 64},  # 3 Gated DeltaNet + 1 full
    })
PRESET_ENGINES[("llama3-8b-310p", "ascend")] = {"max_layers": 2, "extra_config": {"backend_options": {"soc": "310p"}}}
PRESET_ENGINES[("deepseek-v4-flash-a5", "ascend")] = {"max_layers": 6, "num_blocks": 600}  # 950: fp8, padded pages


def private_prom_metrics(engines: int = 1) -> tuple[Any, Any]:
    """The connector's Prometheus metrics as vLLM builds them, in a registry of their own (labels model_name and
    engine, engines "0", "1", ...), and that registry."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from lmcache_npu.integration.vllm import LMCacheNPUConnector

    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry,
                                                                                             **k)})

    types = {cls: bound(cls) for cls in (Counter, Gauge, Histogram)}
    metrics = LMCacheNPUConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                                     ["model_name", "engine"],
                                                     {e: ["m", str(e)] for e in range(engines)})
    return metrics, registry


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 30000, length).tolist()


def assert_engine_settled(engine: Engine) -> None:
    """vLLM's scheduler is empty with every block free, the scheduler half tracks no request or command, and the
    page fence counts no store in flight (whether or not its index is still there)."""
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "vLLM blocks still held"
    half = engine.connector.scheduler_half
    assert not half.requests, f"scheduler half still tracks {list(half.requests)}"
    assert not half._owner and not half._loads and not half._delayed_free
    assert len(half.fence.reads) == 0, "the page fence still counts stores in flight"


def assert_quiescent(engine: Engine) -> None:
    """Nothing leaked: vLLM's scheduler is empty with every block free, the connector tracks no request, the index
    has no command in flight, no reservation or pin, and every arena slot is free or ready; workers wait for
    nothing."""
    assert_engine_settled(engine)
    half = engine.connector.scheduler_half
    assert not half.fence.step_reads, "the page fence still counts stores in flight"
    index = half.index
    assert index is not None
    index.check_invariants()
    assert index.in_flight == 0 and not index.queued_commands()
    chunks = index.chunks()
    assert not any(c.reservations for c in chunks), "reservations left"
    assert all(c.readers == 0 for c in chunks), "pinned chunks left"
    from lmcache_npu.store.index.contract import SlotState

    states = [c.slot_state for c in chunks]
    assert SlotState.WRITING not in states and SlotState.READING not in states
    assert index.free_slots + sum(s is SlotState.READY for s in states) == index.num_slots
    for worker in engine.workers:
        wh = worker.worker_half
        assert not wh._recv and not wh._sends and not wh._owner and not wh._stores, "worker still tracks transfers"
        assert wh.executor.context.outstanding == 0


@pytest.fixture
def node() -> Iterator[tuple[NodeCacheService, str]]:
    """A node-cache service of 256 MiB and its socket path, closed after the test."""
    path = os.path.join(tempfile.mkdtemp(prefix="lmc-node-"), "node.sock")  # socket paths must stay short
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(256 << 20))).start()
    yield service, path
    service.close()


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    engines: list[Engine] = []

    def make(worker_factory: Optional[Callable[..., Any]] = None, **settings) -> Engine:
        engine = Engine(EngineSpec(**settings), worker_factory)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def preset_engine(make: Callable[..., Engine], preset: str, family: str, **overrides) -> Engine:
    settings = {"preset": preset, "family": family, **PRESET_ENGINES[(preset, family)]}
    extra = {**settings.pop("extra_config", {}), **overrides.pop("extra_config", {})}
    if overrides.get("backend", "emu") != "emu":
        extra.pop("backend_options", None)  # SoC options are the emulator's
    return make(**{**settings, **overrides}, extra_config=extra)


def _expected_hit(chunk: int, stored_tokens: int, next_prompt: int) -> int:
    """Whole chunks of the first request, short of the next prompt's last token."""
    return min(stored_tokens // chunk, (next_prompt - 1) // chunk) * chunk


def prefix_is_loaded_exactly(engine: Engine) -> None:
    """A request computes and stores a prompt; a second one with that prefix loads it, every page it reads checked
    against the simulated model; nothing leaks (the preset scenario, also run by the NPU suite)."""
    chunk = engine.connector.scheduler_half.chunk_tokens
    if engine.connector.scheduler_half.has_end_state:
        # a recurrent state exists only where a step ends: one chunk per step keeps every chunk complete
        engine.spec.max_num_batched_tokens = chunk
        engine.scheduler.max_num_scheduled_tokens = chunk
    first = prompt(2 * chunk + chunk // 2, seed=1)
    engine.add(first, max_tokens=2, request_id="first")
    engine.run()
    engine.evict_device_cache()
    second = first + prompt(chunk // 2, seed=2)
    engine.add(second, max_tokens=3, request_id="second")
    engine.run()
    assert engine.loaded_tokens.get("second", 0) == _expected_hit(chunk, len(first) + 1, len(second))
    assert engine.loaded_tokens["second"] > 0
    assert len(engine.output_tokens("second")) == 3
    assert_quiescent(engine)
