"""The sweep's order and its handling of a server that never comes up: a configuration other than the baseline is
recorded as not run (with the log's reason) and the rest still run; a baseline that cannot start stops the sweep.
random runs its repeats in rounds, each run on prompts no other run (nor the warm-up) shares."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.tools.replay.configs import BASELINE, PLUGIN, PLUGIN_CONNECTOR, RunConfig
from lmcache_npu.tools.servebench import sweep as sweep_module
from lmcache_npu.tools.servebench.load import LoadResult, LoadSpec
from lmcache_npu.tools.servebench.metrics import ServerCounters
from lmcache_npu.tools.servebench.server import ServerSettings, ServerStartError
from lmcache_npu.tools.servebench.sweep import LAST_MEASURED_POINT, Pace, Point, Run, SweepSettings, run_sweep
from lmcache_npu.tools.servebench.workloads import MAX_POINT, RandomShape

CONFIGS = [RunConfig(BASELINE), RunConfig(PLUGIN, PLUGIN_CONNECTOR, {"cpu_bytes": "1GiB"})]
SERVER = ServerSettings("model", tokenizer="tok")
LOG = "vllm serve exited with 1:\nloading\nTraceback (most recent call last):\nRuntimeError: no segment"


def _fake(monkeypatch: pytest.MonkeyPatch, failing: str) -> list[tuple[str, str, str]]:
    """Servers whose args carry `failing` do not start; every point is recorded (config, workload, pace)."""
    ran: list[tuple[str, str, str]] = []

    @contextlib.contextmanager
    def server(model: str, args: list[str], log_path: Path, env: Any = None) -> Iterator[str]:
        if failing in " ".join(args):
            raise ServerStartError(LOG)
        yield "http://127.0.0.1:1"

    def point(base: str, server: ServerSettings, sweep: SweepSettings, config: RunConfig, name: str, run: Run,
              folder: Path) -> Point:
        ran.append((config.name, name, run.pace.label))
        return Point(config.name, config.plugin, name, run.pace, LoadResult(1, 0, 1.0, 1.0, 1.0, 1, 1, 1, 1, 1, 1),
                     ServerCounters(), run.repeat)

    monkeypatch.setattr(sweep_module, "vllm_server", server)
    monkeypatch.setattr(sweep_module, "_run_point", point)
    monkeypatch.setattr(sweep_module, "_warm_up", lambda *args: None)
    return ran


def test_a_connector_server_that_does_not_start_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    ran = _fake(monkeypatch, "LMCacheNPUConnector")
    result = run_sweep(CONFIGS, SERVER, SweepSettings(names=("chat", "random")), tmp_path)
    assert result.configs == [BASELINE]
    assert result.unavailable[PLUGIN].startswith("vllm serve exited with 1")
    assert "RuntimeError: no segment" in result.unavailable[PLUGIN]
    # the baseline ran chat at the reusing pace once, random at both paces in three rounds
    assert ran == [(BASELINE, "chat", "concurrency 4")] + [(BASELINE, "random", "concurrency 1"),
                                                           (BASELINE, "random", "concurrency 2")] * 3


def test_every_configuration_runs_when_all_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ran = _fake(monkeypatch, "no server has this argument")  # negative control: nothing fails, nothing is skipped
    result = run_sweep(CONFIGS, SERVER, SweepSettings(names=("random",), random_repeats=1), tmp_path)
    assert result.configs == [BASELINE, PLUGIN] and result.unavailable == {}
    # each run on every server in turn, the order rotating: the baseline first at concurrency 1, second at 2
    assert ran == [(BASELINE, "random", "concurrency 1"), (PLUGIN, "random", "concurrency 1"),
                   (PLUGIN, "random", "concurrency 2"), (BASELINE, "random", "concurrency 2")]


def test_every_server_is_up_before_the_first_run_and_each_goes_first_in_turn(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def server(model: str, args: list[str], log_path: Path, env: Any = None) -> Iterator[str]:
        events.append(f"up {log_path.parent.name}")
        yield "http://127.0.0.1:1"
        events.append(f"down {log_path.parent.name}")

    def point(base: str, server: ServerSettings, sweep: SweepSettings, config: RunConfig, name: str, run: Run,
              folder: Path) -> Point:
        events.append(f"run {folder.name} {run.index}")
        return Point(config.name, config.plugin, name, run.pace, LoadResult(1, 0, 1.0, 1.0, 1.0, 1, 1, 1, 1, 1, 1),
                     ServerCounters(), run.repeat)

    monkeypatch.setattr(sweep_module, "vllm_server", server)
    monkeypatch.setattr(sweep_module, "_run_point", point)
    monkeypatch.setattr(sweep_module, "_warm_up", lambda *args: None)
    configs = [*CONFIGS, RunConfig("third", PLUGIN_CONNECTOR, {"cpu_bytes": "2GiB"})]
    run_sweep(configs, SERVER, SweepSettings(names=("random",), random_repeats=2), tmp_path)
    folders = ["vLLM_alone", "vLLM_plus_lmcache-npu", "third"]
    assert events[:3] == [f"up {f}" for f in folders] and sorted(events[-3:]) == sorted(f"down {f}" for f in folders)
    runs = [e.split()[1:] for e in events if e.startswith("run")]
    assert len(runs) == 12  # 2 paces x 2 repeats x 3 servers
    turns = [runs[i:i + 3] for i in range(0, 12, 3)]
    for k, turn in enumerate(turns):
        assert {index for _, index in turn} == {str(k)}  # one run (the same prompts) on every server
        assert turn[0][0] == folders[k % 3]  # the order rotates: each server goes first in turn


def test_a_baseline_that_does_not_start_stops_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake(monkeypatch, "--enable-prefix-caching")  # every server has it: the baseline fails first
    with pytest.raises(ServerStartError, match="no segment"):
        run_sweep(CONFIGS, SERVER, SweepSettings(names=("random",)), tmp_path)


def _fake_load(monkeypatch: pytest.MonkeyPatch) -> list[LoadSpec]:
    """The real _run_point over a fake `vllm bench serve` and /metrics: every load spec it sends is recorded."""
    specs: list[LoadSpec] = []

    @contextlib.contextmanager
    def server(model: str, args: list[str], log_path: Path, env: Any = None) -> Iterator[str]:
        yield "http://127.0.0.1:1"

    def run_load(spec: LoadSpec, base: str, model: str, tokenizer: str, result: Path, log: Path) -> LoadResult:
        specs.append(spec)
        return LoadResult(1, 0, 1.0, 1.0, 1.0, 1, 1, 1, 1, 1, 1)

    monkeypatch.setattr(sweep_module, "vllm_server", server)
    monkeypatch.setattr(sweep_module, "run_load", run_load)
    monkeypatch.setattr(sweep_module, "settled_counters", lambda read: ServerCounters())
    return specs


def _hash_ids(spec: LoadSpec) -> list[int]:
    """Every hash id of the trace file a load spec names (its --dataset-path)."""
    path = Path(spec.dataset_args[spec.dataset_args.index("--dataset-path") + 1])
    return [i for line in path.read_text().splitlines() for i in json.loads(line)["hash_ids"]]


def test_random_repeats_run_in_rounds_on_prompts_of_their_own(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    specs = _fake_load(monkeypatch)
    one, two = Pace(max_concurrency=1), Pace(max_concurrency=2)
    result = run_sweep(CONFIGS[:1], SERVER, SweepSettings(names=("chat", "random"), paces=(one, two),
                                                          random_repeats=3, warmup_prompts=2), tmp_path)
    random = [p for p in result.points if p.workload == "random"]
    assert [(p.pace, p.repeat) for p in random] == [(one, 0), (two, 0), (one, 1), (two, 1), (one, 2), (two, 2)]
    assert [p.repeat for p in result.points if p.workload == "chat"] == [0]
    warmup, measured = specs[0], specs[2:]  # specs[1] is chat's
    assert warmup.seed == sweep_module.WARMUP_SEED and len(measured) == 6
    ids = [_hash_ids(spec) for spec in measured]
    # every run of random has prompts no other run (nor the warm-up) shares: 6 runs x 32 prompts x 16 blocks
    assert len(set().union(*map(set, ids))) == sum(map(len, ids)) == 6 * 32 * 16
    assert not set(_hash_ids(warmup)) & set().union(*map(set, ids))
    assert len({spec.seed for spec in measured}) == 6
    # run k's trace is exactly workloads' point k (round 2's first run is point 2), so ids are read, not assumed
    for k in (0, 2, 5):
        assert _hash_ids(measured[k]) == [i for line in RandomShape().trace_lines(k)
                                          for i in line["hash_ids"]]  # type: ignore[union-attr]
    assert result.point(BASELINE, "random", two) is random[1]  # point() is still the first run
    assert result.point(BASELINE, "random", two, repeat=2) is random[5]
    assert result.repeats(BASELINE, "random", two) == [random[1], random[3], random[5]]
    assert result.repeats(BASELINE, "random", Pace(max_concurrency=3)) == []


@given(st.integers(1, 6), st.integers(1, 5))
def test_run_indices_are_unique_and_below_the_warm_up(paces: int, repeats: int) -> None:
    sweep = SweepSettings(paces=tuple(Pace(max_concurrency=c) for c in range(1, paces + 1)), random_repeats=repeats)
    runs = sweep.runs_of("random")
    assert len(runs) == paces * repeats and len({r.index for r in runs}) == len(runs)
    assert max(r.index for r in runs) < sweep_module.WARMUP_POINT
    # rounds: each round holds every pace once, in the grid's order
    assert [r.pace for r in runs] == list(sweep.paces) * repeats
    assert [r.repeat for r in runs] == [k for k in range(repeats) for _ in range(paces)]
    assert [r.repeat for r in sweep.runs_of("chat")] == [0]  # the reusing workloads run once per pace


def test_the_last_measured_index_shares_nothing_with_the_warm_up() -> None:
    most = SweepSettings(paces=(Pace(max_concurrency=1),), random_repeats=LAST_MEASURED_POINT + 1)
    last = most.runs_of("random")[-1].index
    assert last == LAST_MEASURED_POINT < MAX_POINT == sweep_module.WARMUP_POINT
    shape = RandomShape()
    ids = {i for line in shape.trace_lines(last) for i in line["hash_ids"]}  # type: ignore[union-attr]
    warm = {i for line in shape.trace_lines(MAX_POINT) for i in line["hash_ids"]}  # type: ignore[union-attr]
    assert ids and warm and not ids & warm


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True, "3"])
def test_random_repeats_must_be_a_positive_integer(repeats: object) -> None:
    with pytest.raises(ValueError, match="random_repeats must be an integer >= 1"):
        SweepSettings(random_repeats=repeats)  # type: ignore[arg-type]


def test_a_grid_past_the_last_point_index_is_refused() -> None:
    two = (Pace(max_concurrency=1), Pace(max_concurrency=2))
    SweepSettings(paces=two, random_repeats=(LAST_MEASURED_POINT + 1) // 2)  # the most that fits
    with pytest.raises(ValueError, match=r"random would run 1000 times \(2 pace\(s\) x 500 repeat\(s\)\)"):
        SweepSettings(paces=two, random_repeats=500)
