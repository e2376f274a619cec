"""The sweep's PNG plots (the replay's matplotlib style): request throughput and TTFT p99 against the pace, one
panel per workload, one line per configuration; where a pace ran several times (random's repeats) the point is the
median over the runs, as in the table, with whiskers from the runs' min to their max."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from ..replay.plots import _pyplot, _save
from ..replay.spread import spread_of
from .sweep import SweepResult

METRICS = {"throughput": ("request_throughput", "requests/s"), "ttft-p99": ("ttft_p99_ms", "TTFT p99 (ms)")}


def plot_metric(result: SweepResult, metric: str, path: Union[str, Path]) -> Path:
    """`metric` ("throughput" or "ttft-p99") against the pace, a panel per workload, a line per configuration."""
    if metric not in METRICS:
        raise ValueError(f"unknown plot metric {metric!r}; choose from {', '.join(METRICS)}")
    if not result.points:
        raise ValueError("no points to plot: the sweep ran nothing")
    field, label = METRICS[metric]
    plt = _pyplot()
    workloads = list(dict.fromkeys(p.workload for p in result.points))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4), squeeze=False)
    concurrency = result.points[0].pace.max_concurrency is not None
    for ax, workload in zip(axes[0], workloads):
        for k, config in enumerate(result.configs):
            paces = sorted(dict.fromkeys(p.pace for p in result.points if p.config == config
                                         and p.workload == workload), key=lambda pace: pace.x)
            if paces:
                spreads = [spread_of(getattr(p.load, field) for p in result.repeats(config, workload, pace))
                           for pace in paces]
                ax.errorbar([pace.x for pace in paces], [s.median for s in spreads],
                            yerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
                            fmt="-o", capsize=3, color=f"C{k}", label=config)
        ax.set_title(workload, fontsize=10)
        ax.set_xlabel("max concurrency" if concurrency else "request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, plt, path)


def write_plots(result: SweepResult, directory: Union[str, Path]) -> list[Path]:
    """serve-throughput.png and serve-ttft-p99.png into `directory`."""
    directory = Path(directory)
    return [plot_metric(result, name, directory / f"serve-{name}.png") for name in METRICS]
