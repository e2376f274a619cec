"""The sweep's accounting and verdict: hits vLLM's own cache served are never credited to the plugin, a baseline
that reports connector hits is refused, and the no-reuse verdict notices a miss of either target."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.servebench.load import LoadResult
from lmcache_npu.servebench.metrics import ServerCounters
from lmcache_npu.servebench.report import connector_hits, check_baseline, overheads, table_rows, to_json, \
    verdict_line
from lmcache_npu.servebench.sweep import Pace, Point, SweepResult, SweepSettings, grid

BASE, PLUGIN, PEER = "vLLM alone", "vLLM + lmcache-npu", "vLLM + MooncakeStoreConnector"
PACE = Pace(max_concurrency=4)


def load(throughput: float = 2.0, ttft_p99: float = 1000.0) -> LoadResult:
    return LoadResult(16, 0, 8.0, throughput, 32 * throughput, 8192, 512, 500.0, ttft_p99, 20.0, 30.0)


def point(config: str, workload: str = "random", counters: ServerCounters = ServerCounters(), pace: Pace = PACE,
          **numbers: float) -> Point:
    return Point(config, config == PLUGIN, workload, pace, load(**numbers), counters)


def test_hits_from_vllms_cache_are_not_the_plugins() -> None:
    only_vllm = point(PLUGIN, "chat", ServerCounters(prompt_tokens=8192, vllm_hits=4096, connector_hits=0))
    assert connector_hits(only_vllm) == 0
    both = point(PLUGIN, "chat", ServerCounters(prompt_tokens=8192, vllm_hits=4096, connector_hits=2048,
                                                plugin_hits=2048))
    assert connector_hits(both) == 2048
    # a peer's hits are vLLM's external count; the plugin's counter (absent there) is never read for it
    peer = point(PEER, "chat", ServerCounters(vllm_hits=4096, connector_hits=1024))
    assert connector_hits(peer) == 1024
    row = table_rows(SweepResult([BASE, PLUGIN], [only_vllm]))[0]
    assert row[10:12] == ("4096", "0")


def test_a_baseline_with_connector_hits_is_refused() -> None:
    good = SweepResult([BASE, PLUGIN], [point(BASE, counters=ServerCounters(vllm_hits=512)),
                                        point(PLUGIN, counters=ServerCounters(plugin_hits=512, connector_hits=512))])
    check_baseline(good)
    bad = SweepResult([BASE, PLUGIN], [point(BASE, counters=ServerCounters(connector_hits=256))])
    with pytest.raises(ValueError, match="runs no connector"):
        check_baseline(bad)


def test_overhead_within_the_targets_is_met() -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE, throughput=2.0, ttft_p99=1000.0),
                                          point(PLUGIN, throughput=1.98, ttft_p99=1040.0)])
    (found,) = overheads(result)
    assert found.throughput_loss_pct == pytest.approx(1.0)
    assert found.ttft_p99_increase_pct == pytest.approx(4.0)
    assert found.met
    assert "MET" in verdict_line([found]) and "MISSED" not in verdict_line([found])


@pytest.mark.parametrize("throughput,ttft_p99,what", [(1.9, 1000.0, "throughput loss +5.0%"),
                                                      (2.0, 1100.0, "TTFT p99 +10.0%")])
def test_a_missed_target_is_reported(throughput: float, ttft_p99: float, what: str) -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE), point(PLUGIN, throughput=throughput, ttft_p99=ttft_p99)])
    line = verdict_line(overheads(result))
    assert "MISSED" in line and what in line


def test_one_bad_pace_misses_the_verdict() -> None:
    other = Pace(max_concurrency=1)
    result = SweepResult([BASE, PLUGIN], [point(BASE), point(PLUGIN, throughput=2.0),
                                          point(BASE, pace=other), point(PLUGIN, pace=other, ttft_p99=2000.0)])
    assert "MISSED" in verdict_line(overheads(result))
    assert "concurrency 1" in verdict_line(overheads(result))


@given(st.floats(0.1, 100.0), st.floats(0.1, 100.0), st.floats(10.0, 1e5), st.floats(10.0, 1e5))
def test_overhead_signs(base_tp: float, mine_tp: float, base_ttft: float, mine_ttft: float) -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE, throughput=base_tp, ttft_p99=base_ttft),
                                          point(PLUGIN, throughput=mine_tp, ttft_p99=mine_ttft)])
    (found,) = overheads(result)
    assert (found.throughput_loss_pct > 0) == (mine_tp < base_tp)
    assert (found.ttft_p99_increase_pct > 0) == (mine_ttft > base_ttft)


def test_reuse_workloads_and_missing_plugin_give_no_verdict() -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE, "chat"), point(PLUGIN, "chat")])
    assert overheads(result) == []
    assert "not measured" in verdict_line([])
    assert overheads(SweepResult([BASE], [point(BASE)])) == []


def test_a_zero_baseline_is_refused() -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE, throughput=0.0), point(PLUGIN)])
    with pytest.raises(ValueError, match="request throughput of vLLM alone is 0.0"):
        overheads(result)


def test_json_carries_points_and_verdict() -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE), point(PLUGIN, counters=ServerCounters(plugin_hits=7))])
    data = to_json(result, {"model": "m"})
    assert [p["connector_hits"] for p in data["points"]] == [0, 7]
    assert data["points"][0]["request_rate"] is None and data["points"][0]["max_concurrency"] == 4
    assert data["verdict"].startswith("no-reuse overhead")


def test_the_grid_takes_one_kind_of_pace() -> None:
    assert [p.label for p in grid([1, 4], [])] == ["concurrency 1", "concurrency 4"]
    assert [p.label for p in grid([], [0.5])] == ["0.5 req/s"]
    for concurrencies, rates in (([], []), ([1], [1.0]), ([0], []), ([], [-1.0])):
        with pytest.raises(ValueError):
            grid(concurrencies, rates)


def test_random_sweeps_every_pace_and_the_reusing_workloads_their_own() -> None:
    one, four = Pace(max_concurrency=1), Pace(max_concurrency=4)
    sweep = SweepSettings(paces=(one, four), reuse_paces=(four,))
    assert sweep.paces_for("random") == (one, four)
    assert sweep.paces_for("chat") == sweep.paces_for("prefix_repetition") == (four,)
    assert sweep.all_paces == (four, one)  # prefix_repetition's first, in the order the workloads run
    same = SweepSettings(paces=(one, four), reuse_paces=None)
    assert same.paces_for("chat") == (one, four)  # negative control: None gives the reusing workloads random's paces
    with pytest.raises(ValueError, match="unknown workload"):
        sweep.paces_for("randm")


@pytest.mark.parametrize("settings,message", [
    ({"reuse_paces": ()}, "at least one pace"),
    ({"paces": ()}, "at least one pace"),
    ({"reuse_paces": (Pace(request_rate=1.0),)}, "concurrency or every one by request rate"),
    ({"warmup_prompts": -1}, "warmup_prompts"),
])
def test_sweep_settings_refuse_what_cannot_run(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SweepSettings(**settings)  # type: ignore[arg-type]
