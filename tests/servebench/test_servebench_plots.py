"""The sweep's PNGs draw the median over random's repeats at each pace, with whiskers from the runs' min to max."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcache_npu.tools.servebench import plots
from lmcache_npu.tools.servebench.load import LoadResult
from lmcache_npu.tools.servebench.metrics import ServerCounters
from lmcache_npu.tools.servebench.sweep import Pace, Point, SweepResult

BASE = "vLLM alone"
ONE, TWO = Pace(max_concurrency=1), Pace(max_concurrency=2)


def run(pace: Pace, repeat: int, throughput: float) -> Point:
    load = LoadResult(32, 0, 10.0, throughput, 16 * throughput, 8192, 512, 200.0, 300.0, 14.0, 15.0)
    return Point(BASE, False, "random", pace, load, ServerCounters(), repeat)


def drawn(monkeypatch: pytest.MonkeyPatch, result: SweepResult, path: Path) -> list[tuple[list[float], ...]]:
    """(x, y, whisker bottoms, whisker tops) of every line the throughput plot draws; the PNG is still written."""
    seen: list[tuple[list[float], ...]] = []
    save = plots._save

    def capture(fig: Any, plt: Any, where: Path) -> Path:
        for ax in fig.axes:
            for container in ax.containers:
                line, (low, high), _ = container.lines
                seen.append((list(line.get_xdata()), list(line.get_ydata()), list(low.get_ydata()),
                             list(high.get_ydata())))
        return save(fig, plt, where)

    monkeypatch.setattr(plots, "_save", capture)
    written = plots.plot_metric(result, "throughput", path)
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return seen


def test_the_plot_draws_medians_with_min_max_whiskers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    points = [run(ONE, 0, 2.0), run(TWO, 0, 3.0), run(ONE, 1, 1.0), run(TWO, 1, 3.2), run(ONE, 2, 2.2),
              run(TWO, 2, 2.9)]
    ((x, y, low, high),) = drawn(monkeypatch, SweepResult([BASE], points), tmp_path / "a.png")
    assert x == [1.0, 2.0] and y == pytest.approx([2.0, 3.0])
    assert low == pytest.approx([1.0, 2.9]) and high == pytest.approx([2.2, 3.2])
    # negative control: a wilder outlier moves a whisker, not the median; a second slow run moves the median
    points[2] = run(ONE, 1, 0.1)
    ((_, y, low, _),) = drawn(monkeypatch, SweepResult([BASE], points), tmp_path / "b.png")
    assert y == pytest.approx([2.0, 3.0]) and low[0] == pytest.approx(0.1)
    points[0] = run(ONE, 0, 0.5)
    ((_, y, _, _),) = drawn(monkeypatch, SweepResult([BASE], points), tmp_path / "c.png")
    assert y[0] == pytest.approx(0.5)
