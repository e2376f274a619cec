"""The sweep's accounting and verdict: hits vLLM's own cache served are never credited to the plugin, a baseline
that reports connector hits is refused, and the no-reuse verdict notices a miss of either target, judged on the
medians over random's repeats (one outlier run does not flip it, a loss in every run does)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.tools.servebench.load import LoadResult
from lmcache_npu.tools.servebench.metrics import ServerCounters
from lmcache_npu.tools.servebench.report import COLUMNS, connector_hits, check_baseline, overheads, table_rows, \
    to_json, verdict_line
from lmcache_npu.tools.servebench.sweep import Pace, Point, SweepResult, SweepSettings, grid

BASE, PLUGIN, PEER = "vLLM alone", "vLLM + lmcache-npu", "vLLM + MooncakeStoreConnector"
PACE = Pace(max_concurrency=4)


def load(throughput: float = 2.0, ttft_p99: float = 1000.0) -> LoadResult:
    return LoadResult(16, 0, 8.0, throughput, 32 * throughput, 8192, 512, 500.0, ttft_p99, 20.0, 30.0)


def point(config: str, workload: str = "random", counters: ServerCounters = ServerCounters(), pace: Pace = PACE,
          repeat: int = 0, **numbers: float) -> Point:
    return Point(config, config == PLUGIN, workload, pace, load(**numbers), counters, repeat)


def repeated(config: str, throughputs: list[float], ttft_p99s: list[float], pace: Pace = PACE) -> list[Point]:
    """One configuration's runs of random at `pace`, repeat k with the k-th numbers."""
    return [point(config, pace=pace, repeat=k, throughput=tp, ttft_p99=ttft)
            for k, (tp, ttft) in enumerate(zip(throughputs, ttft_p99s))]


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
    assert [p["repeat"] for p in data["points"]] == [0, 0]


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


def test_one_outlier_repeat_does_not_flip_a_good_median() -> None:
    base = repeated(BASE, [2.0, 2.0, 2.0], [1000.0, 1000.0, 1000.0])
    # repeat 1 of the plugin is 25 % slower with a 50 % worse TTFT p99: the medians are 0.5 % and 1 % off
    mine = repeated(PLUGIN, [1.99, 1.5, 1.99], [1010.0, 1500.0, 1010.0])
    (found,) = overheads(SweepResult([BASE, PLUGIN], base + mine))
    assert found.throughput_loss_pct == pytest.approx(0.5) and found.ttft_p99_increase_pct == pytest.approx(1.0)
    assert found.met and found.repeats == 3
    assert (found.throughput_loss_by_repeat.low, found.throughput_loss_by_repeat.high) == pytest.approx((0.5, 25.0))
    assert found.ttft_p99_increase_by_repeat.high == pytest.approx(50.0)
    assert found.baseline_throughput_spread_pct == 0.0
    line = verdict_line([found])
    assert "MET" in line and "MISSED" not in line and "3 repeats, medians" in line
    assert "range +0.5..+25.0%" in line and "range +1.0..+50.0%" in line
    # negative control: the old single-run verdict on repeat 1 alone would have missed both targets
    single = overheads(SweepResult([BASE, PLUGIN], [base[1], mine[1]]))
    assert not single[0].met


def test_a_loss_in_every_repeat_is_missed_even_over_a_noisy_baseline() -> None:
    base = repeated(BASE, [1.9, 2.0, 2.1], [950.0, 1000.0, 1050.0])
    mine = repeated(PLUGIN, [b * 0.97 for b in (1.9, 2.0, 2.1)], [1000.0, 1000.0, 1000.0])  # 3 % slower each time
    (found,) = overheads(SweepResult([BASE, PLUGIN], base + mine))
    assert found.throughput_loss_pct == pytest.approx(3.0)
    assert found.throughput_loss_by_repeat.low == pytest.approx(3.0) == found.throughput_loss_by_repeat.high
    assert found.baseline_throughput_spread_pct == pytest.approx(10.0)  # (2.1 - 1.9) / 2.0
    assert found.baseline_ttft_p99_spread_pct == pytest.approx(10.0)
    assert not found.met
    assert verdict_line([found]) == (
        "no-reuse overhead (random, 1 pace(s), 3 repeats, medians): MISSED: throughput loss +3.0% at worst "
        "(concurrency 4; range +3.0..+3.0%; vLLM alone's own spread 10.0%; target <= 2%), TTFT p99 +0.0% at worst "
        "(concurrency 4; range -4.8..+5.3%; vLLM alone's own spread 10.0%; target <= 5%)")


@given(st.floats(0.5, 50.0), st.floats(0.0, 0.019), st.floats(0.01, 100.0), st.integers(0, 2))
def test_the_verdict_follows_the_median_whatever_the_outlier(base_tp: float, loss: float, outlier: float,
                                                             where: int) -> None:
    good = [base_tp * (1 - loss)] * 3
    good[where] = outlier  # one run anywhere, of any size
    result = SweepResult([BASE, PLUGIN], repeated(BASE, [base_tp] * 3, [1000.0] * 3)
                         + repeated(PLUGIN, good, [1000.0] * 3))
    (found,) = overheads(result)
    assert found.met and found.throughput_loss_pct == pytest.approx(loss * 100)
    # negative control: the same outlier with a 2.5 % loss in the other two runs misses
    bad = [base_tp * 0.975] * 3
    bad[where] = outlier
    result = SweepResult([BASE, PLUGIN], repeated(BASE, [base_tp] * 3, [1000.0] * 3)
                         + repeated(PLUGIN, bad, [1000.0] * 3))
    assert not overheads(result)[0].met


def test_one_repeat_still_gives_a_verdict() -> None:
    result = SweepResult([BASE, PLUGIN], [point(BASE), point(PLUGIN, throughput=1.9)])
    (found,) = overheads(result)
    assert found.repeats == 1 and found.throughput_loss_by_repeat.low == pytest.approx(5.0)
    line = verdict_line([found])
    assert "(random, 1 pace(s), 1 repeat)" in line and "one run, no spread" in line and "MISSED" in line


def test_repeats_that_do_not_pair_up_are_refused() -> None:
    base = repeated(BASE, [2.0, 2.0, 2.0], [1000.0] * 3)
    mine = repeated(PLUGIN, [2.0, 2.0], [1000.0] * 2)
    with pytest.raises(ValueError, match=r"vLLM alone ran repeats \[0, 1, 2\] but the plugin \[0, 1\]"):
        overheads(SweepResult([BASE, PLUGIN], base + mine))


def test_the_table_shows_medians_and_sums_of_the_repeats() -> None:
    runs = [point(PLUGIN, repeat=k, throughput=tp, ttft_p99=ttft,
                  counters=ServerCounters(prompt_tokens=8192, plugin_hits=hits, connector_hits=hits))
            for k, (tp, ttft, hits) in enumerate([(2.0, 1000.0, 0), (1.0, 9000.0, 0), (3.0, 1100.0, 16)])]
    chat = point(PLUGIN, "chat", ServerCounters(prompt_tokens=100))
    (random_row, chat_row) = table_rows(SweepResult([BASE, PLUGIN], [*runs, chat]))
    assert dict(zip(COLUMNS, random_row)) == {
        "workload": "random", "pace": "concurrency 4", "configuration": PLUGIN, "req/s": "2.00", "out tok/s": "64.0",
        "TTFT p50 ms": "500", "TTFT p99 ms": "1100", "TPOT p50 ms": "20.0", "TPOT p99 ms": "30.0",
        "prompt tok": "24576", "vLLM cache hits": "0", "connector hits": "16", "failed": "0", "runs": "3"}
    # negative control: a hit in one run of three shows (a median would hide it); the chat row is its one run
    assert dict(zip(COLUMNS, chat_row))["runs"] == "1" and dict(zip(COLUMNS, chat_row))["prompt tok"] == "100"


def test_json_overhead_entries_carry_medians_and_spreads() -> None:
    base = repeated(BASE, [1.9, 2.0, 2.1], [900.0, 1000.0, 1200.0])
    mine = repeated(PLUGIN, [2.0, 1.96, 2.2], [1000.0, 1020.0, 1100.0])
    data = to_json(SweepResult([BASE, PLUGIN], base + mine), {"random_repeats": 3})
    (entry,) = data["overhead"]
    assert entry["repeats"] == 3
    # a 30 % noisy baseline and pairs from -8 % to +11 %: the 2 % TTFT median cannot be told from noise
    assert (entry["outcome"], entry["ttft_p99_outcome"]) == ("inconclusive", "inconclusive")
    assert entry["met"] is False
    assert entry["throughput_loss_pct"] == pytest.approx(0.0)  # both medians 2.0 req/s
    assert entry["ttft_p99_increase_pct"] == pytest.approx(2.0)
    assert entry["baseline_request_throughput"] == pytest.approx({"median": 2.0, "min": 1.9, "max": 2.1})
    assert entry["plugin_ttft_p99_ms"] == pytest.approx({"median": 1020.0, "min": 1000.0, "max": 1100.0})
    assert entry["baseline_ttft_p99_spread_pct"] == pytest.approx(30.0)
    pairs = entry["ttft_p99_increase_pct_by_repeat"]
    assert pairs["min"] == pytest.approx((1100 - 1200) / 1200 * 100) and pairs["max"] == pytest.approx(100 / 9)
    assert [p["repeat"] for p in data["points"]] == [0, 1, 2, 0, 1, 2]
    assert json.loads(json.dumps(data, allow_nan=False))["overhead"] == data["overhead"]


def test_a_noisy_baseline_with_disagreeing_pairs_is_inconclusive() -> None:
    # vLLM alone varies 13 %; the plugin's pairs range from -10 % to +7 % around a 2.1 % median loss
    base = repeated(BASE, [0.88, 1.01, 0.98], [1790.0, 1410.0, 1472.0])
    mine = repeated(PLUGIN, [0.96, 0.96, 0.91], [1568.0, 1562.0, 1520.0])
    (found,) = overheads(SweepResult([BASE, PLUGIN], base + mine))
    assert found.throughput_loss_pct > 2.0 and found.baseline_throughput_spread_pct > 2.0
    assert found.throughput_outcome == "inconclusive" and found.outcome == "inconclusive" and not found.met
    line = verdict_line([found])
    assert "INCONCLUSIVE" in line and "rerun on a quieter machine" in line and "MISSED" not in line
    # negative control: the same plugin runs over a quiet baseline are a clear miss
    quiet = repeated(BASE, [0.98, 0.98, 0.98], [1472.0, 1472.0, 1472.0])
    (decided,) = overheads(SweepResult([BASE, PLUGIN], quiet + mine))
    assert decided.throughput_outcome == "missed" and "MISSED" in verdict_line([decided])
    # and pairs that all agree decide even over the noisy baseline
    agreeing = repeated(PLUGIN, [b * 0.99 for b in (0.88, 1.01, 0.98)], [t * 1.01 for t in (1790.0, 1410.0, 1472.0)])
    (paired,) = overheads(SweepResult([BASE, PLUGIN], base + agreeing))
    assert paired.outcome == "met" and "MET" in verdict_line([paired])
