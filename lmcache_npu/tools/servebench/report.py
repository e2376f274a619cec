"""The sweep's table, its JSON, and the no-reuse verdict: on `random` nothing can hit, so whatever the plugin costs
shows as throughput lost and TTFT p99 gained against vLLM alone at the same pace (targets: <= 2% and <= 5%).

`random` runs several times per pace (SweepSettings.random_repeats): the verdict compares the MEDIAN over the
repeats of each configuration's request throughput and TTFT p99, so one noisy run neither passes nor fails it; next
to it stand vLLM alone's own repeat-to-repeat range at that pace ((max - min) / median, the noise floor) and the range
of the plugin's change over each repeat pair (repeat k of the plugin against repeat k of vLLM alone, which ran the
same prompts). Where the noise floor exceeds a target, the median alone cannot tell a miss from noise: then the
pairs decide if they all agree, and otherwise the verdict says INCONCLUSIVE instead of MET or MISSED.

The table has one row per configuration, workload and pace; where a pace ran several times (`runs` > 1) every
throughput and latency column is the median over the runs, each column on its own (the row need not be one run),
while prompt tokens, both hit columns and failed requests are summed over the runs, so a hit or a failure in any
run shows. The plots draw the same medians. The JSON keeps every run as its own point.

A point's connector hits are the plugin's own counter for the plugin and vLLM's external-hit counter for a peer;
vLLM's own prefix-cache hits are a column of their own and never credited to a connector."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..replay.spread import Spread, spread_of
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
    """The plugin against vLLM alone at one pace of the no-reuse workload, from the medians over the repeats."""

    pace: Pace
    throughput_loss_pct: float  # > 0: the plugin's median request throughput is lower than vLLM alone's median
    ttft_p99_increase_pct: float  # > 0: the plugin's median TTFT p99 is higher
    repeats: int
    throughput_loss_by_repeat: Spread  # the loss of each repeat pair (the same prompts), in %
    ttft_p99_increase_by_repeat: Spread
    baseline_throughput: Spread  # requests/s over vLLM alone's repeats
    plugin_throughput: Spread
    baseline_ttft_p99_ms: Spread
    plugin_ttft_p99_ms: Spread

    @property
    def throughput_outcome(self) -> str:
        return _outcome(self.throughput_loss_pct, self.throughput_loss_by_repeat, self.baseline_throughput_spread_pct,
                        self.repeats, THROUGHPUT_LOSS_TARGET_PCT)

    @property
    def ttft_p99_outcome(self) -> str:
        return _outcome(self.ttft_p99_increase_pct, self.ttft_p99_increase_by_repeat,
                        self.baseline_ttft_p99_spread_pct, self.repeats, TTFT_P99_TARGET_PCT)

    @property
    def outcome(self) -> str:
        """missed if either target is, met if both are, else inconclusive."""
        return _combined([self.throughput_outcome, self.ttft_p99_outcome])

    @property
    def met(self) -> bool:
        return self.outcome == MET

    @property
    def baseline_throughput_spread_pct(self) -> float:
        """vLLM alone's own repeat-to-repeat range of request throughput, relative to its median: the noise floor."""
        return _range_pct(self.baseline_throughput)

    @property
    def baseline_ttft_p99_spread_pct(self) -> float:
        """vLLM alone's own repeat-to-repeat range of TTFT p99, relative to its median."""
        return _range_pct(self.baseline_ttft_p99_ms)

    def to_json(self) -> dict[str, Any]:
        return {"pace": self.pace.label, "repeats": self.repeats, "throughput_loss_pct": self.throughput_loss_pct,
                "ttft_p99_increase_pct": self.ttft_p99_increase_pct, "met": self.met, "outcome": self.outcome,
                "throughput_outcome": self.throughput_outcome, "ttft_p99_outcome": self.ttft_p99_outcome,
                "throughput_loss_pct_by_repeat": self.throughput_loss_by_repeat.to_json(),
                "ttft_p99_increase_pct_by_repeat": self.ttft_p99_increase_by_repeat.to_json(),
                "baseline_throughput_spread_pct": self.baseline_throughput_spread_pct,
                "baseline_ttft_p99_spread_pct": self.baseline_ttft_p99_spread_pct,
                "baseline_request_throughput": self.baseline_throughput.to_json(),
                "plugin_request_throughput": self.plugin_throughput.to_json(),
                "baseline_ttft_p99_ms": self.baseline_ttft_p99_ms.to_json(),
                "plugin_ttft_p99_ms": self.plugin_ttft_p99_ms.to_json()}


MET, MISSED, INCONCLUSIVE = "met", "missed", "inconclusive"


def _outcome(value_pct: float, by_repeat: Spread, noise_pct: float, repeats: int, target: float) -> str:
    """One target at one pace. The median decides where it can: one run, or vLLM alone's own spread within the
    target. Over a noisier baseline the repeat pairs (same prompts, adjacent in time) decide only when all agree:
    every pair over the target is a miss, every pair within it a pass; anything else cannot be told from noise."""
    over = value_pct > target
    if repeats == 1 or noise_pct <= target:
        return MISSED if over else MET
    if over and by_repeat.low > target:
        return MISSED
    if not over and by_repeat.high <= target:
        return MET
    return INCONCLUSIVE


def _combined(outcomes: Sequence[str]) -> str:
    """Several outcomes as one: missed if any is, met if all are, else inconclusive."""
    return MISSED if MISSED in outcomes else MET if all(o == MET for o in outcomes) else INCONCLUSIVE


def _range_pct(spread: Spread) -> float:
    return (spread.high - spread.low) / spread.median * 100.0 if spread.median > 0 else math.inf


def _relative_pct(new: float, old: float, what: str) -> float:
    if not old > 0 or math.isinf(old):
        raise ValueError(f"{what} of vLLM alone is {old}: no relative change can be taken from it")
    return (new - old) / old * 100.0


def _overhead(pace: Pace, base: Sequence[Point], mine: Sequence[Point]) -> Overhead:
    """The medians' comparison and the per-repeat-pair changes at one pace (`base` and `mine` ordered by repeat)."""
    if [p.repeat for p in base] != [p.repeat for p in mine]:
        raise ValueError(f"random at {pace.label}: vLLM alone ran repeats {[p.repeat for p in base]} but the plugin "
                         f"{[p.repeat for p in mine]}; the repeats must pair up")
    tp = [(m.load.request_throughput, b.load.request_throughput) for b, m in zip(base, mine)]
    ttft = [(m.load.ttft_p99_ms, b.load.ttft_p99_ms) for b, m in zip(base, mine)]
    base_tp, mine_tp = spread_of(b for _, b in tp), spread_of(m for m, _ in tp)
    base_ttft, mine_ttft = spread_of(b for _, b in ttft), spread_of(m for m, _ in ttft)
    return Overhead(
        pace,
        -_relative_pct(mine_tp.median, base_tp.median, "request throughput"),
        _relative_pct(mine_ttft.median, base_ttft.median, "TTFT p99"),
        len(tp),
        spread_of(-_relative_pct(m, b, "request throughput") for m, b in tp),
        spread_of(_relative_pct(m, b, "TTFT p99") for m, b in ttft),
        base_tp, mine_tp, base_ttft, mine_ttft)


def overheads(result: SweepResult, plugin_config: Optional[str] = None) -> list[Overhead]:
    """Per pace of `random`: the plugin's throughput loss and TTFT p99 increase against the baseline, medians over
    the repeats."""
    if not result.configs:
        return []
    baseline = result.configs[0]
    plugins = sorted({p.config for p in result.points if p.plugin})
    name = plugin_config or (plugins[0] if plugins else None)
    if name is None:
        return []
    found = []
    paces = dict.fromkeys(p.pace for p in result.points if p.config == baseline and p.workload == NO_REUSE)
    for pace in paces:
        mine = result.repeats(name, NO_REUSE, pace)
        if mine:
            found.append(_overhead(pace, result.repeats(baseline, NO_REUSE, pace), mine))
    return found


def _worst(value_pct: float, pace: Pace, by_repeat: Spread, noise_pct: float, repeats: int, target: float) -> str:
    """One target's worst pace: the median-based change, then (with repeats) its per-pair range and the noise floor."""
    if repeats == 1:
        return f"{value_pct:+.1f}% at worst ({pace.label}; one run, no spread; target <= {target:g}%)"
    return (f"{value_pct:+.1f}% at worst ({pace.label}; range {by_repeat.low:+.1f}..{by_repeat.high:+.1f}%; "
            f"vLLM alone's own spread {noise_pct:.1f}%; target <= {target:g}%)")


def verdict_line(found: Sequence[Overhead]) -> str:
    """One line: met, missed or inconclusive (`_outcome`, every pace), with the worst pace's numbers and their spread
    (the targets hold at every pace or not at all)."""
    if not found:
        return "no-reuse overhead: not measured (random needs vLLM alone and the plugin at the same paces)"
    worst_tp = max(found, key=lambda o: o.throughput_loss_pct)
    worst_ttft = max(found, key=lambda o: o.ttft_p99_increase_pct)
    outcome = _combined([o.outcome for o in found])
    counts = sorted({o.repeats for o in found})
    runs = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    how = f"{runs} repeat{'s' if counts[-1] > 1 else ''}" + (", medians" if counts[-1] > 1 else "")
    line = (f"no-reuse overhead (random, {len(found)} pace(s), {how}): {outcome.upper()}: throughput "
            f"loss " + _worst(worst_tp.throughput_loss_pct, worst_tp.pace, worst_tp.throughput_loss_by_repeat,
                              worst_tp.baseline_throughput_spread_pct, worst_tp.repeats, THROUGHPUT_LOSS_TARGET_PCT)
            + ", TTFT p99 " + _worst(worst_ttft.ttft_p99_increase_pct, worst_ttft.pace,
                                     worst_ttft.ttft_p99_increase_by_repeat, worst_ttft.baseline_ttft_p99_spread_pct,
                                     worst_ttft.repeats, TTFT_P99_TARGET_PCT))
    if outcome == INCONCLUSIVE:
        line += ("; vLLM alone's own runs vary more than a target and the repeat pairs disagree: rerun on a quieter "
                 "machine or with more --random-repeats")
    return line


COLUMNS = ("workload", "pace", "configuration", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "TPOT p99 ms", "prompt tok", "vLLM cache hits", "connector hits", "failed", "runs")


def median_load(points: Sequence[Point], field: str) -> float:
    """The median over `points` (one configuration's runs at one workload and pace) of LoadResult's `field`."""
    if not points:
        raise ValueError(f"median of {field} over no points")
    return spread_of(getattr(p.load, field) for p in points).median


def table_rows(result: SweepResult) -> list[tuple[str, ...]]:
    """One row per configuration, workload and pace (grouped by workload then pace, configurations in their order):
    medians of the runs' throughputs and latencies, sums of their counters and failures, and the number of runs."""
    rows = []
    workloads = list(dict.fromkeys(p.workload for p in result.points))
    paces = list(dict.fromkeys(p.pace for p in result.points))
    for workload in workloads:
        for pace in paces:
            for config in result.configs:
                runs = result.repeats(config, workload, pace)
                if not runs:
                    continue
                numbers = [median_load(runs, f) for f in ("request_throughput", "output_throughput", "ttft_p50_ms",
                                                          "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")]
                rows.append((workload, pace.label, config, f"{numbers[0]:.2f}", f"{numbers[1]:.1f}",
                             f"{numbers[2]:.0f}", f"{numbers[3]:.0f}", f"{numbers[4]:.1f}", f"{numbers[5]:.1f}",
                             f"{sum(p.counters.prompt_tokens for p in runs):.0f}",
                             f"{sum(p.counters.vllm_hits for p in runs):.0f}",
                             f"{sum(connector_hits(p) for p in runs):.0f}", str(sum(p.load.failed for p in runs)),
                             str(len(runs))))
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
            "overhead": [o.to_json() for o in found],
            "verdict": verdict_line(found)}
