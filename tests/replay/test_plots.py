"""The replay's PNGs are written from a report (no engine): both files, real PNGs, and they change with the data."""

from __future__ import annotations

from lmcache_npu.tools.replay.accounting import TurnHits
from lmcache_npu.tools.replay.engine import Completion
from lmcache_npu.tools.replay.turns import compare_turns
from lmcache_npu.tools.replay.plots import write_plots
from lmcache_npu.tools.replay.replay import ReplayReport
from lmcache_npu.tools.replay.restart import RestartResult
from lmcache_npu.tools.replay.runner import TurnRun
from lmcache_npu.tools.replay.runs import RunResult
from lmcache_npu.tools.replay.warmup import WarmUp


def report(ttft: float) -> ReplayReport:
    def run(config, repeat, t, hits):
        turns = [TurnRun(i, (0, 1), (Completion(100, (1,), ({1: -0.1},), 0, t), Completion(100, (2,), ({2: -0.1},),
                                                                                         0, t * 2)), 1.0)
                 for i in range(2)]
        return RunResult(config, repeat, 0, WarmUp(3, 300, 1.0), turns, [hits, hits])

    runs = [run("vLLM alone", r, 1.0, TurnHits(200, 100, 0, 0, 0, 100)) for r in range(2)]
    runs += [run("vLLM + lmcache-npu", r, ttft, TurnHits(200, 50, 40, 10, 0, 100)) for r in range(2)]
    out = ReplayReport("m", "w", {}, ["vLLM alone", "vLLM + lmcache-npu"], runs, 400)
    cold, restarted = runs[0], runs[2]
    out.restart = RestartResult("/d", cold, restarted, compare_turns(cold.turns, restarted.turns)[0])
    return out


def test_both_plots_are_pngs_that_follow_the_numbers(tmp_path):
    paths = write_plots(report(0.5), tmp_path / "a")
    assert [p.name for p in paths] == ["replay-ttft.png", "replay-sources.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    other = write_plots(report(0.9), tmp_path / "b")
    # negative control: another TTFT draws another picture, the same sources the same one
    assert paths[0].read_bytes() != other[0].read_bytes()
    assert paths[1].read_bytes() == other[1].read_bytes()
