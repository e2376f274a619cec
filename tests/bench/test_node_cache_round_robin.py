"""The round-robin node cache study's pure parts: the run order (configurations rotating per repeat), the spreads
over repeats, the memory a workload took, the metrics the services expose, the CPUs per engine, and the report's
verdicts and 120-column tables."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, strategies as st

from lmcache_npu.tools.bench.studies import node_cache_round_robin as study
from lmcache_npu.tools.bench.studies.node_cache_round_robin import (CHAT, MOONCAKE, NODE, PRIVATE, UNIQUE, ConfigRun,
                                                                    cpu_sets, held_delta, render, schedule, summarize,
                                                                    verdicts)
from lmcache_npu.tools.mooncake_local import master_allocated_bytes
from lmcache_npu.tools.node_local import node_used_bytes
from lmcache_npu.tools.status import parse_metrics
from tests.replay.test_report import broken_cells_of


def first_counts(order: list[tuple[str, int, str]], workload: str) -> Counter:
    """How often each configuration ran first in its repeat of `workload`."""
    firsts: dict[int, str] = {}
    for w, repeat, config in order:
        if w == workload:
            firsts.setdefault(repeat, config)
    return Counter(firsts.values())


@given(st.integers(1, 4))
def test_each_repeat_runs_every_configuration_once_and_the_first_rotates(cycles: int) -> None:
    repeats = 3 * cycles
    order = schedule([CHAT, UNIQUE], [NODE, PRIVATE, MOONCAKE], repeats)
    for repeat in range(repeats):
        assert [c for w, r, c in order if (w, r) == (CHAT, repeat)] in (
            [NODE, PRIVATE, MOONCAKE], [PRIVATE, MOONCAKE, NODE], [MOONCAKE, NODE, PRIVATE])
        assert sorted(c for w, r, c in order if (w, r) == (UNIQUE, repeat)) == [NODE, PRIVATE]  # no Mooncake
    assert first_counts(order, CHAT) == {NODE: cycles, PRIVATE: cycles, MOONCAKE: cycles}
    assert first_counts(order, UNIQUE) == {NODE: 3 * cycles - 3 * cycles // 2, PRIVATE: 3 * cycles // 2}
    # the repeats run in order, each repeat's workloads together
    assert [r for _, r, _ in order] == sorted(r for _, r, _ in order)


def test_negative_control_an_order_that_never_rotates_is_seen() -> None:
    fixed = [(CHAT, r, c) for r in range(3) for c in (NODE, PRIVATE, MOONCAKE)]
    assert first_counts(fixed, CHAT) == {NODE: 3}
    assert first_counts(schedule([CHAT], [NODE, PRIVATE, MOONCAKE], 3), CHAT) != first_counts(fixed, CHAT)


def test_the_schedule_refuses_unknown_names_and_a_workload_left_without_configurations() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        schedule(["chats"], [NODE], 1)
    with pytest.raises(ValueError, match="take none of the configurations"):
        schedule([UNIQUE], [MOONCAKE], 1)
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        schedule([CHAT], [NODE], 0)


def run(config: str, repeat: int, wall: float, ttfts: list[float], computed: int, memory: dict[str, int],
        workload: str = CHAT, arena: int = 0, mooncake: int = 0, steps: int = 10,
        connector_s: float = 0.001) -> ConfigRun:
    prompt = 1000
    hits = {"vllm": prompt - computed - arena - mooncake, "arena": arena, "disk": 0, "mooncake": mooncake, "peer": 0,
            "computed": computed}
    return ConfigRun(workload, config, repeat, 0, prompt, hits, ttfts, wall, connector_s, steps, len(ttfts),
                     memory)


def three_configs() -> list[ConfigRun]:
    return [run(NODE, 0, 10.0, [0.1, 0.2, 0.3], 300, {"node": 100 << 20}, arena=400),
            run(NODE, 1, 12.0, [0.1, 0.2, 0.5], 320, {"node": 101 << 20}, arena=380),
            run(NODE, 2, 11.0, [0.2, 0.2, 0.4], 310, {"node": 99 << 20}, arena=390),
            run(PRIVATE, 0, 14.0, [0.3, 0.4, 0.6], 600, {"arena 0": 80 << 20, "arena 1": 82 << 20}),
            run(PRIVATE, 1, 15.0, [0.3, 0.4, 0.7], 620, {"arena 0": 81 << 20, "arena 1": 80 << 20}),
            run(PRIVATE, 2, 16.0, [0.4, 0.5, 0.8], 610, {"arena 0": 79 << 20, "arena 1": 81 << 20}),
            run(MOONCAKE, 0, 13.0, [0.2, 0.3, 0.5], 310, {"arena 0": 90 << 20, "arena 1": 90 << 20,
                                                           "mooncake": 100 << 20}, mooncake=300),
            run(MOONCAKE, 1, 13.5, [0.2, 0.3, 0.6], 320, {"arena 0": 91 << 20, "arena 1": 90 << 20,
                                                           "mooncake": 100 << 20}, mooncake=290),
            run(MOONCAKE, 2, 11.5, [0.2, 0.4, 0.5], 300, {"arena 0": 90 << 20, "arena 1": 89 << 20,
                                                           "mooncake": 100 << 20}, mooncake=310)]


def test_the_spreads_are_each_configurations_median_min_and_max_over_its_repeats() -> None:
    summary = summarize(three_configs())[CHAT]
    node, private = summary[NODE], summary[PRIVATE]
    assert (node["wall_s"].median, node["wall_s"].low, node["wall_s"].high) == (11.0, 10.0, 12.0)
    assert (node["hit_tokens"].median, node["hit_tokens"].low, node["hit_tokens"].high) == (690, 680, 700)
    assert node["connector_tokens"].median == 390
    assert node["ttft_p50_s"].median == pytest.approx(0.2)
    assert node["ttft_p90_s"].high == pytest.approx(0.44)  # 0.2 + 0.8 x (0.5 - 0.2): numpy's linear percentile
    assert node["memory_bytes"].median == 100 << 20
    assert private["memory_bytes"].median == 161 << 20 and private["memory_bytes"].high == 162 << 20
    assert summary[MOONCAKE]["memory_bytes"].low == 279 << 20
    assert node["connector_us_per_step"].median == pytest.approx(100.0)


def test_negative_control_another_configurations_run_never_enters_a_spread() -> None:
    runs = three_configs()
    runs[3] = run(PRIVATE, 0, 99.0, [9.0, 9.0, 9.0], 999, {"arena 0": 1 << 30})  # a private outlier
    summary = summarize(runs)[CHAT]
    assert summary[NODE]["wall_s"].high == 12.0 and summary[PRIVATE]["wall_s"].high == 99.0


def test_a_holder_that_evicted_during_the_workload_is_refused() -> None:
    assert held_delta(10, 25, "node") == 15
    with pytest.raises(ValueError, match="evicted"):
        held_delta(25, 10, "engine 0's arena")


def test_cpus_are_split_disjointly_or_not_pinned_when_too_few() -> None:
    assert cpu_sets(2, 1, [0, 1]) == [(0,), (1,)]
    assert cpu_sets(2, 2, [3, 1, 0, 2, 7]) == [(0, 1), (2, 3)]
    assert cpu_sets(2, 2, [0, 1, 2]) == [(), ()]
    with pytest.raises(ValueError, match=">= 1"):
        cpu_sets(2, 0, [0, 1])


NODE_METRICS = """# TYPE lmcache_npu:cpu_used_chunks gauge
lmcache_npu:cpu_used_chunks{engine="node",namespace="a"} 10
lmcache_npu:chunk_bytes{engine="node",namespace="a"} 1000
lmcache_npu:cpu_used_chunks{engine="node",namespace="b"} 3
lmcache_npu:chunk_bytes{engine="node",namespace="b"} 7
lmcache_npu:cpu_used_chunks{engine="e1/dp0",namespace="a"} 500
lmcache_npu:node_lookup_hit_chunks_total{engine="e1/dp0",namespace="a"} 4
"""


def test_the_nodes_used_bytes_are_its_pools_chunks_times_their_size() -> None:
    assert node_used_bytes(parse_metrics(NODE_METRICS)) == 10 * 1000 + 3 * 7  # the engine's series left out
    without_size = NODE_METRICS.replace('lmcache_npu:chunk_bytes{engine="node",namespace="b"} 7\n', "")
    with pytest.raises(ValueError, match=r"\['b'\] lack"):
        node_used_bytes(parse_metrics(without_size))


def test_the_masters_used_bytes_are_its_one_allocated_gauge() -> None:
    text = "# HELP x\nmaster_allocated_bytes 4096\nmaster_total_capacity_bytes 1048576\n"
    assert master_allocated_bytes(parse_metrics(text)) == 4096
    with pytest.raises(ValueError, match="found 0"):
        master_allocated_bytes(parse_metrics("master_total_capacity_bytes 1048576\n"))


def test_the_verdicts_say_whether_the_node_cache_beats_each_configuration_beyond_the_spread() -> None:
    runs = three_configs() + [run(NODE, r, 20.0 + r * 0.2, [0.5, 0.6], 1000, {"node": 1 << 20}, UNIQUE,
                                  connector_s=0.002) for r in range(3)] + [
        run(PRIVATE, r, 20.1 + r * 0.2, [0.5, 0.6], 1000, {"arena 0": 1 << 20}, UNIQUE) for r in range(3)]
    lines = verdicts(summarize(runs))
    assert len(lines) == 3
    against_private, against_mooncake, ipc = lines
    assert against_private.startswith("node cache against private arenas: hit tokens 690 vs 390")
    assert "wall 15.0 s -> 11.0 s (1.36x faster)" in against_private  # ranges 10-12 and 14-16 do not overlap
    assert "memory 100.0 MiB vs 161.0 MiB" in against_private
    assert "wall 13.0 s -> 11.0 s (1.18x faster)" not in against_mooncake  # 10-12 overlaps 11.5-13.5
    assert "wall 13.0 s -> 11.0 s (1.18x, within the run-to-run spread)" in against_mooncake
    assert "+100 µs per step" in ipc and "within the run-to-run spread" in ipc


def test_the_report_fits_120_columns_with_every_median_and_range_whole() -> None:
    runs = three_configs() + [run(NODE, r, 20.0 + r, [0.5, 0.6], 1000, {"node": 1 << 20}, UNIQUE)
                              for r in range(3)] + [
        run(PRIVATE, r, 20.5 + r, [0.5, 0.6], 1000, {"arena 0": 1 << 20}, UNIQUE) for r in range(3)]
    for r in runs:
        r.matching = (3, 3, 0)
    descriptions = {CHAT: "chat: 16 conversations x 4 turns after a 512-token system prompt, turns alternating "
                          "between 2 engines", UNIQUE: "no reuse: 4 waves x 8 unique prompts of 640 tokens"}
    items = render(runs, 3, descriptions)
    broken, widest = broken_cells_of(items, 120)
    assert broken == [] and widest <= 120
    assert any("\n" in str(cell) for column in items[0].columns for cell in column.cells)  # ranges are there
    narrow, _ = broken_cells_of(items, 60)  # negative control: a narrow console does break cells
    assert narrow


def test_a_run_whose_tokens_differed_is_reported_in_red() -> None:
    from rich.console import Console

    runs = three_configs()
    runs[4].first_difference = "wave 2: conversation 1 token 3"
    runs[4].matching = (2, 3, 0)
    console = Console(record=True, width=120)
    for item in render(runs, 3, {CHAT: "chat"}):
        console.print(item)
    text = console.export_text()
    assert "tokens differed: private arenas (repeat 2, chat): wave 2: conversation 1 token 3" in text
    assert "every run's tokens" not in text


def test_the_study_refuses_sizes_below_one() -> None:
    with pytest.raises(SystemExit):
        study.parse(["--turns", "0"])
    args = study.parse(["--cpu-bytes", "1GiB"])
    assert args.node_cpu_bytes == str(2 << 30) and args.mooncake_segment_bytes == 1 << 30
