"""Stats are reported only when something changed (get_kv_connector_stats returns None on a quiet step, as vLLM
allows), and the counts still add up exactly: the sum of every report over many steps and ranks equals what the
halves counted; the negative controls prove the check notices a lost report and a missed change."""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any, Callable

import pytest

from lmcache_npu.integration.vllm import adapter
from lmcache_npu.integration.vllm.stats import ARENA_METRICS, GAUGES, INDEX_METRICS, STORE_INFO, CounterDeltas
from lmcache_npu.store.tier import TierCounters

from .conftest import preset_engine, prompt


class Tally:
    """What the engine's connectors counted (the truth) and what their stats reported (summed over calls)."""

    def __init__(self) -> None:
        self.counted: Counter[str] = Counter()
        self.reported: Counter[str] = Counter()
        self.quiet = 0  # calls that returned None
        self.calls = 0
        self._lock = threading.Lock()  # worker counters are added on the transfer thread too

    def count(self, counters: TierCounters) -> None:
        add = counters.add

        def counted(name: str, amount: float = 1) -> None:
            add(name, amount)
            with self._lock:
                self.counted[name] += amount
        counters.add = counted  # type: ignore[method-assign]

    def report(self, stats_of: Callable[[], Any]) -> Callable[[], Any]:
        def reported() -> Any:
            stats = stats_of()
            self.calls += 1
            if stats is None or stats.is_empty():  # None where adapter.WORKER_STATS_MAY_BE_NONE (or the scheduler)
                self.quiet += 1
                return stats
            self.reported.update({k: v for k, v in stats.data.items() if k not in GAUGES and k != STORE_INFO})
            return stats
        return reported


def _replay(engine: Any, tally: Tally) -> None:
    """Three turns of four conversations, vLLM's own cache dropped between turns so later turns load."""
    half = engine.connector.scheduler_half
    tally.count(half.counters)
    engine.connector.get_kv_connector_stats = tally.report(engine.connector.get_kv_connector_stats)
    for worker in engine.workers:
        tally.count(worker.worker_half.counters)
        worker.get_kv_connector_stats = tally.report(worker.get_kv_connector_stats)
    history = [prompt(300, seed=90 + c) for c in range(4)]
    for turn in range(3):
        ids = []
        for c in range(4):
            history[c] = history[c] + prompt(100, seed=100 + 10 * turn + c)
            ids.append(engine.add(history[c], max_tokens=8))
        engine.run()
        for c, request_id in enumerate(ids):
            history[c] = history[c] + engine.output_tokens(request_id)
        engine.evict_device_cache()
    engine.connector.get_kv_connector_stats()  # what no step asked for yet (vLLM would on its next step)
    for worker in engine.workers:
        worker.get_kv_connector_stats()


def _mismatches(engine: Any, tally: Tally) -> list[str]:
    """Every counter whose reported sum differs from what was counted (the index's and arena's counters are never
    drained: their totals are read directly)."""
    truth = Counter(tally.counted)
    index = engine.connector.scheduler_half.index.counters.snapshot()
    truth.update({exported: index.get(own, 0) for exported, (own, _) in INDEX_METRICS.items()})
    for worker in engine.workers:
        truth.update(worker.worker_half.executor.arena.segment_stats())
    names = {n for n in truth.keys() | tally.reported.keys() if not n.startswith("rank")}
    # seconds are floats, summed in another order by a report than by the tally
    return [f"{n}: reported {tally.reported.get(n, 0)}, counted {truth.get(n, 0)}" for n in sorted(names)
            if not math.isclose(tally.reported.get(n, 0), truth.get(n, 0), rel_tol=1e-9)]


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def engine(request, make_engine, monkeypatch):
    monkeypatch.setattr(adapter, "WORKER_STATS_MAY_BE_NONE", True)  # the vLLM >= 0.28 path, on this vLLM too
    return preset_engine(make_engine, "llama3-8b", "ascend", world=request.param, num_blocks=64,
                         extra_config={"chunk_tokens": 256, "cpu_bytes": "12MiB"})  # a few slots: evictions


def test_quiet_steps_report_none_and_every_count_adds_up(engine):
    tally = Tally()
    _replay(engine, tally)
    assert tally.reported["store_chunks"] > 0 and tally.reported["hit_tokens"] > 0 and tally.reported["lookups"] == 12
    assert set(ARENA_METRICS) <= set(tally.reported) and tally.reported["evictions"] > 0
    assert tally.quiet > tally.calls // 2, f"only {tally.quiet} of {tally.calls} calls were quiet"
    assert _mismatches(engine, tally) == []


def test_the_check_notices_a_lost_report(engine):
    tally = Tally()
    half = engine.connector.scheduler_half
    stats, seen = half.stats, []

    def loses_the_third_report() -> Any:  # a report built and then dropped: its counts never reach vLLM
        out = stats()
        seen.append(not out.is_empty())
        return type(out)() if sum(seen) == 3 and seen[-1] else out
    half.stats = loses_the_third_report
    _replay(engine, tally)
    assert _mismatches(engine, tally), "a dropped report went unnoticed"


def test_the_check_notices_a_missed_change(engine):
    tally = Tally()
    index = engine.connector.scheduler_half.index.counters
    add = index.add

    def unannounced(name: str, amount: float = 1) -> None:  # an add that does not bump the version: never taken
        version = index.version
        add(name, amount)
        index.version = version
    index.add = unannounced
    _replay(engine, tally)
    assert any(m.startswith(tuple(INDEX_METRICS)) for m in _mismatches(engine, tally)), "a missed change went unnoticed"


def test_counter_deltas_skip_quiet_counters_and_lose_nothing_under_concurrent_adds():
    counters = TierCounters()
    deltas = CounterDeltas()
    deltas.watch(counters, {"evictions": ("evictions", "")})
    assert deltas.take() == {}
    counters.add("evictions", 3)
    assert deltas.take() == {"evictions": 3} and deltas.take() == {}

    taken: list[float] = []

    def adds() -> None:
        for _ in range(20000):
            counters.add("evictions")
    threads = [threading.Thread(target=adds) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        taken.append(deltas.take().get("evictions", 0))
    for t in threads:
        t.join()
    taken.append(deltas.take().get("evictions", 0))
    assert sum(taken) == 80000 and counters["evictions"] == 80003
    assert TierCounters().drain() == {}


def test_a_worker_on_an_older_vllm_reports_every_step(make_engine, monkeypatch):
    """Before vLLM 0.28 the scheduler's stats were asked for only when a worker reported some: a None would hold
    the scheduler's counts back."""
    monkeypatch.setattr(adapter, "WORKER_STATS_MAY_BE_NONE", False)
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24, extra_config={"chunk_tokens": 256})
    worker = engine.workers[0]
    worker.get_kv_connector_stats()
    quiet = worker.get_kv_connector_stats()
    assert quiet is not None and quiet.is_empty()
    engine.connector.get_kv_connector_stats()
    assert engine.connector.get_kv_connector_stats() is None
