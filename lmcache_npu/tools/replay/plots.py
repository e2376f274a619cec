"""The replay's PNG plots (matplotlib's Agg backend, no display): TTFT per turn in every configuration (medians,
min-max as error bars), and each turn's prompt tokens by source (vLLM's prefix cache, the plugin's tiers, computed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Union

from .accounting import SOURCES
from .replay import ReplayReport

logger = logging.getLogger(__name__)

SOURCE_LABELS = {"vllm": "vLLM prefix cache", "arena": "plugin: host arena", "disk": "plugin: disk",
                 "mooncake": "plugin: Mooncake", "peer": "peer connector", "computed": "computed"}
SOURCE_COLOURS = {"vllm": "#4c72b0", "arena": "#55a868", "disk": "#8fbc8f", "mooncake": "#c4ad66",
                  "peer": "#8172b2", "computed": "#c44e52"}


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(report: ReplayReport, path: Union[str, Path]) -> Path:
    """TTFT p50 and p90 per turn, one line per configuration, min-max over the repeats as error bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {c: f"C{k}" for k, c in enumerate(report.configs)}  # one colour per configuration, p50 and p90
    for config in report.configs:
        rows = report.turn_spreads(config)
        turns = list(range(1, len(rows) + 1))
        for name, style in (("ttft_p50_s", "-o"), ("ttft_p90_s", "--^")):
            med = [r[name].median for r in rows]
            err = [[m - r[name].low for m, r in zip(med, rows)], [r[name].high - m for m, r in zip(med, rows)]]
            ax.errorbar(turns, med, yerr=err, fmt=style, capsize=3, color=colours[config],
                        label=f"{config}, {name[5:8]}")
    ticks = list(range(1, len(report.runs[0].turns) + 1))
    labels = [str(t) for t in ticks]
    if report.restart is not None:
        x = len(ticks) + 1
        for run, marker in ((report.restart.cold, "o"), (report.restart.restarted, "o")):
            times = run.total_times()
            colour = colours.get(run.config, "grey")
            ax.plot([x], [times.ttft_p50_s], marker, markersize=8, color=colour)
            ax.plot([x], [times.ttft_p90_s], "^", markersize=8, color=colour)
        ax.axvline(x - 0.5, color="grey", linewidth=0.8, linestyle=":")
        ticks.append(x)
        labels.append("after\nrestart")
    ax.set_xticks(ticks, labels)
    ax.set_xlabel(report.step_name + (" (after restart: cold without the plugin, on its disk tier with it)"
                                      if report.restart else ""))
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"TTFT per {report.step_name}: medians of {report.repeats} run(s), min-max bars", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def plot_sources(report: ReplayReport, path: Union[str, Path]) -> Path:
    """Per turn, one stacked bar per configuration: prompt tokens by source (medians over the repeats)."""
    plt = _pyplot()
    configs = report.configs
    spreads = {c: report.turn_spreads(c) for c in configs}
    turns = len(spreads[configs[0]])
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, config in enumerate(configs):
        xs = [t + 1 + (k - (len(configs) - 1) / 2) * width for t in range(turns)]
        bottom = [0.0] * turns
        for source in SOURCES:
            values = [spreads[config][t][source].median for t in range(turns)]
            ax.bar(xs, values, width * 0.95, bottom=bottom, color=SOURCE_COLOURS[source],
                   label=SOURCE_LABELS[source] if k == 0 else None, edgecolor="white", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, values)]
        for x in xs:
            ax.text(x, 0, config.replace("vLLM + ", "+").replace("vLLM alone", "alone"), rotation=90, fontsize=6,
                    ha="center", va="bottom", color="white")
    ticks, labels = list(range(1, turns + 1)), [str(t) for t in range(1, turns + 1)]
    if report.restart is not None:  # the next turn after a restart: cold without the plugin, on the disk tier with it
        x = turns + 1
        pair = (report.restart.cold, report.restart.restarted)
        for k, run in enumerate(pair):
            bar_x = x + (k - 0.5) * 0.4
            bottom = 0.0
            for source in SOURCES:
                value = run.total_hits().by_source()[source]
                ax.bar([bar_x], [value], 0.38, bottom=[bottom], color=SOURCE_COLOURS[source], edgecolor="white",
                       linewidth=0.5)
                bottom += value
            ax.text(bar_x, 0, "cold" if k == 0 else "restarted", rotation=90, fontsize=6, ha="center",
                    va="bottom", color="white")
        ax.axvline(x - 0.5, color="grey", linewidth=0.8, linestyle=":")
        ticks.append(x)
        labels.append("after\nrestart")
    ax.set_xticks(ticks, labels)
    ax.set_xlabel(report.step_name)
    ax.set_ylabel("prompt tokens")
    ax.set_title("where each turn's prompt tokens came from (bars: " + ", ".join(configs) + ")", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, plt, path)


def _save(fig, plt, path: Union[str, Path]) -> Path:  # type: ignore[no-untyped-def]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path


def write_plots(report: ReplayReport, directory: Union[str, Path]) -> list[Path]:
    """Both plots into `directory`: replay-ttft.png and replay-sources.png."""
    directory = Path(directory)
    return [plot_ttft(report, directory / "replay-ttft.png"), plot_sources(report, directory / "replay-sources.png")]
