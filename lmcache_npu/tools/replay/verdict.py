"""The replay's verdict line: the gain (or its absence) and where the prompt tokens came from, from the very numbers
the table prints, and a refusal to compare runs that were timed cold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .accounting import TIERS
from .spread import Spread

TIER_NAMES = {"arena": "host arena", "disk": "disk", "mooncake": "Mooncake"}


@dataclass(frozen=True)
class Summary:
    """Totals of a baseline and a candidate configuration over a replay's repeats."""

    baseline: str
    candidate: str
    repeats: int
    ttft_p50: tuple[Spread, Spread]  # (baseline, candidate), seconds
    ttft_p90: tuple[Spread, Spread]
    wall: tuple[Spread, Spread]
    prompt_tokens: int
    baseline_hits: Mapping[str, float]  # source -> median tokens ("vllm", tiers, "computed")
    candidate_hits: Mapping[str, float]
    vllm_prefix_cache: bool
    working_set_ratio: float = 0.0  # working set / device KV capacity (0: not known)
    cold: list[str] = field(default_factory=list)  # runs timed without a warm-up
    baseline_connector: str = ""  # "" (vLLM alone), "plugin" or "peer": whose hits the baseline's connector had
    candidate_connector: str = "plugin"


def seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 10 else f"{value:.1f} s"


def change(base: Spread, candidate: Spread) -> str:
    """"1.8x faster" when the candidate's whole range lies below the baseline's, "slower" above it, otherwise the
    difference is inside the run-to-run spread and is called that."""
    ratio = base.median / candidate.median if candidate.median > 0 else float("inf")
    if candidate.high < base.low:
        return f"{ratio:.2f}x faster"
    if candidate.low > base.high:
        return f"{1 / ratio:.2f}x slower" if ratio > 0 else "slower"
    return f"{ratio:.2f}x, within the run-to-run spread"


def _measure(name: str, pair: tuple[Spread, Spread], repeats: int) -> str:
    base, cand = pair
    ranges = (f" [{seconds(base.low)}-{seconds(base.high)} vs {seconds(cand.low)}-{seconds(cand.high)}]"
              if repeats > 1 else "")
    return f"{name} {seconds(base.median)} -> {seconds(cand.median)} ({change(base, cand)}){ranges}"


def _share(tokens: float, total: int) -> str:
    return f"{tokens:,.0f} ({tokens / total:.0%})" if total else f"{tokens:,.0f}"


def _connector_share(connector: str, hits: Mapping[str, float], total: int, lead: str) -> str:
    """What a run's connector contributed: the plugin per tier, a peer's external hits, nothing for vLLM alone."""
    if connector == "plugin":
        tiers = ", ".join(f"{TIER_NAMES[t]} {hits.get(t, 0):,.0f}" for t in TIERS)
        return f"{lead} the plugin {_share(sum(hits.get(t, 0) for t in TIERS), total)} ({tiers})"
    if connector == "peer":
        return f"{lead} the peer connector {_share(hits.get('peer', 0), total)}"
    if connector:
        raise ValueError(f"unknown connector kind {connector!r}; known: '', 'plugin', 'peer'")
    return ""


def verdict_line(summary: Summary) -> tuple[str, str]:
    """(text, rich style) of the verdict: red when runs were cold (not comparable), green when the candidate is
    faster beyond the spread in TTFT p50 and wall time, yellow otherwise."""
    if summary.cold:
        return (f"not comparable: {', '.join(summary.cold)} ran without a warm-up, so engine start-up costs are in "
                f"its timings", "red")
    p50, p90, wall = summary.ttft_p50, summary.ttft_p90, summary.wall
    runs = f"medians of {summary.repeats} runs each" if summary.repeats > 1 else "one run each (no spread)"
    cache = "vLLM's prefix cache on in both" if summary.vllm_prefix_cache else "vLLM's prefix cache off in both"
    if summary.working_set_ratio:
        cache += f"; the workload's working set is {summary.working_set_ratio:.1f}x the device KV cache"
    total = summary.prompt_tokens
    base, cand = summary.baseline_hits, summary.candidate_hits
    text = (f"{summary.candidate} against {summary.baseline} ({cache}), {runs}: "
            f"{_measure('TTFT p50', p50, summary.repeats)}, {_measure('p90', p90, summary.repeats)}, "
            f"{_measure('the workload', wall, summary.repeats)}. Of {total:,} prompt tokens, {summary.baseline} "
            f"hit {_share(base.get('vllm', 0), total)} in vLLM's own cache"
            f"{_connector_share(summary.baseline_connector, base, total, ',')} and computed "
            f"{_share(base.get('computed', 0), total)}; {summary.candidate}: vLLM's own cache "
            f"{_share(cand.get('vllm', 0), total)}{_connector_share(summary.candidate_connector, cand, total, ',')}, "
            f"computed {_share(cand.get('computed', 0), total)}.")
    faster = all(c.high < b.low for b, c in (p50, wall))
    return text, "green" if faster else "yellow"


def _short(outcome: str) -> str:
    return outcome.replace(", within the run-to-run spread", " ~")


def turn_verdict(baseline: str, candidate: str, step_name: str, turns: list[tuple[Spread, Spread, Spread, Spread]],
                 repeats: int) -> tuple[str, str]:
    """"Never slower", turn by turn (issue 40): per turn the (baseline, candidate) TTFT p50 and p90 spreads as
    (p50 base, p50 candidate, p90 base, p90 candidate); a turn is slower only where the candidate's whole range lies
    above the baseline's. Red when some turn is, green otherwise."""
    slower, cells = [], []
    for number, (p50_base, p50_cand, p90_base, p90_cand) in enumerate(turns, 1):
        p50, p90 = change(p50_base, p50_cand), change(p90_base, p90_cand)
        cells.append(f"{step_name} {number} p50 {seconds(p50_base.median)} -> {seconds(p50_cand.median)} "
                     f"({_short(p50)}), p90 {_short(p90)}")
        if p50_cand.low > p50_base.high or p90_cand.low > p90_base.high:  # change()'s rule for "slower"
            slower.append(str(number))
    head = f"{candidate} against {baseline}, per {step_name} (TTFT; ~: within the run-to-run spread"
    head += f" of {repeats} runs)" if repeats > 1 else ", one run each: no spread)"
    if slower:
        return f"{head}: SLOWER on {step_name} {', '.join(slower)}. " + "; ".join(cells), "red"
    return f"{head}: never slower. " + "; ".join(cells), "green"
