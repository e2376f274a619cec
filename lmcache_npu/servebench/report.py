"""The sweep's table, its JSON, and the no-reuse verdict: on `random` nothing can hit, so whatever the plugin costs
shows as throughput lost and TTFT p99 gained against vLLM alone at the same pace (targets: <= 2% and <= 5%).

A point's connector hits are the plugin's own counter for the plugin and vLLM's external-hit counter for a peer;
vLLM's own prefix-cache hits are a column of their own and never credited to a connector."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .sweep import NO_REUSE, Pace, Point, SweepResult

THROUGHPUT_LOSS_TARGET_PCT = 2.0
TTFT_P99_TARGET_PCT = 5.0


def connector_hits(point: Point) -> float:
    """Tokens the point's connector loaded: the plugin's own counter for the plugin, vLLM's external-hit counter
    for any other connector; a baseline (no connector) that reports some is a measurement error."""
    if point.plugin:
        return point.counters.plugin_hits
    return point.counters.connector_hits


def check_baseline(result: SweepResult) -> None:
    """vLLM alone has no connector: external hits on it mean the counters were read from the wrong server."""
    baseline = result.configs[0] if result.configs else None
    for point in result.points:
        if point.config == baseline and (point.counters.connector_hits or point.counters.plugin_hits):
            raise ValueError(f"{baseline} at {point.workload}, {point.pace.label} reports "
                             f"{point.counters.connector_hits:.0f} connector hits: it runs no connector")


@dataclass(frozen=True)
class Overhead:
    """The plugin against vLLM alone at one pace of the no-reuse workload."""

    pace: Pace
    throughput_loss_pct: float  # > 0: the plugin served fewer requests per second
    ttft_p99_increase_pct: float  # > 0: the plugin's TTFT p99 is higher

    @property
    def met(self) -> bool:
        return (self.throughput_loss_pct <= THROUGHPUT_LOSS_TARGET_PCT
                and self.ttft_p99_increase_pct <= TTFT_P99_TARGET_PCT)


def _relative_pct(new: float, old: float, what: str) -> float:
    if not old > 0 or math.isinf(old):
        raise ValueError(f"{what} of vLLM alone is {old}: no relative change can be taken from it")
    return (new - old) / old * 100.0


def overheads(result: SweepResult, plugin_config: Optional[str] = None) -> list[Overhead]:
    """Per pace of `random`: the plugin's throughput loss and TTFT p99 increase against the baseline."""
    if not result.configs:
        return []
    baseline = result.configs[0]
    plugins = sorted({p.config for p in result.points if p.plugin})
    name = plugin_config or (plugins[0] if plugins else None)
    found = []
    for base in [p for p in result.points if p.config == baseline and p.workload == NO_REUSE]:
        mine = result.point(name, NO_REUSE, base.pace) if name else None
        if mine is None:
            continue
        found.append(Overhead(
            base.pace,
            -_relative_pct(mine.load.request_throughput, base.load.request_throughput, "request throughput"),
            _relative_pct(mine.load.ttft_p99_ms, base.load.ttft_p99_ms, "TTFT p99")))
    return found


def verdict_line(found: Sequence[Overhead]) -> str:
    """One line: met or missed, with the worst pace's numbers (the targets hold at every pace or not at all)."""
    if not found:
        return "no-reuse overhead: not measured (random needs vLLM alone and the plugin at the same paces)"
    worst_tp = max(found, key=lambda o: o.throughput_loss_pct)
    worst_ttft = max(found, key=lambda o: o.ttft_p99_increase_pct)
    met = all(o.met for o in found)
    return (f"no-reuse overhead (random, {len(found)} pace(s)): {'MET' if met else 'MISSED'}: throughput loss "
            f"{worst_tp.throughput_loss_pct:+.1f}% at worst ({worst_tp.pace.label}; target <= "
            f"{THROUGHPUT_LOSS_TARGET_PCT:g}%), TTFT p99 {worst_ttft.ttft_p99_increase_pct:+.1f}% at worst "
            f"({worst_ttft.pace.label}; target <= {TTFT_P99_TARGET_PCT:g}%)")


COLUMNS = ("workload", "pace", "configuration", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "TPOT p99 ms", "prompt tok", "vLLM cache hits", "connector hits", "failed")


def table_rows(result: SweepResult) -> list[tuple[str, ...]]:
    """One row per point, grouped by workload then pace, configurations in their order."""
    rows = []
    workloads = list(dict.fromkeys(p.workload for p in result.points))
    paces = list(dict.fromkeys(p.pace for p in result.points))
    for workload in workloads:
        for pace in paces:
            for config in result.configs:
                point = result.point(config, workload, pace)
                if point is None:
                    continue
                load, counters = point.load, point.counters
                rows.append((workload, pace.label, config, f"{load.request_throughput:.2f}",
                             f"{load.output_throughput:.1f}", f"{load.ttft_p50_ms:.0f}", f"{load.ttft_p99_ms:.0f}",
                             f"{load.tpot_p50_ms:.1f}", f"{load.tpot_p99_ms:.1f}", f"{counters.prompt_tokens:.0f}",
                             f"{counters.vllm_hits:.0f}", f"{connector_hits(point):.0f}", str(load.failed)))
    return rows


def render(result: SweepResult, title: str) -> list[Any]:
    """Rich renderables: the table, then the verdict line and any configuration that did not run."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in COLUMNS[:3] else "right")
    for row in table_rows(result):
        table.add_row(*row)
    items: list[Any] = [table, verdict_line(overheads(result))]
    items += [f"{name} did not run: {why}" for name, why in result.unavailable.items()]
    return items


def to_json(result: SweepResult, settings: dict[str, Any]) -> dict[str, Any]:
    found = overheads(result)
    return {"settings": settings, "configs": result.configs, "unavailable": result.unavailable,
            "points": [p.to_json() | {"connector_hits": connector_hits(p)} for p in result.points],
            "overhead": [{"pace": o.pace.label, "throughput_loss_pct": o.throughput_loss_pct,
                          "ttft_p99_increase_pct": o.ttft_p99_increase_pct, "met": o.met} for o in found],
            "verdict": verdict_line(found)}
