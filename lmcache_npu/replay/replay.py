"""`lmcache-npu replay`: one workload on a real vLLM engine, without the plugin and then with it, compared turn by
turn: how much of each prompt the plugin loaded instead of computing, what that did to prefill time and TTFT, and
whether every conversation got the same tokens."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from .compare import compare, tolerance_for
from .engine import Engine, EngineSettings
from .runner import TurnRun, run_workload
from .workload import Conversation

RUNS = ("without", "with")  # the order they run in: the baseline first, so the plugin starts cold too
COMPARED_LOGPROBS = 2  # per step, enough to tell a near tie from a difference


@dataclass(frozen=True)
class TurnReport:
    """One turn of every conversation that has it, both runs."""

    turn: int
    requests: int
    prompt_tokens: int
    loaded_tokens: int  # prompt tokens the plugin loaded (with vLLM's prefix cache on: its hits too)
    computed_tokens: int
    prefill_s: dict[str, float]  # run -> the turn's prefill: from its submission until every request had a token
    ttft_s: dict[str, float]  # run -> median over the requests (arrival to first token, queueing included)
    wall_s: dict[str, float]  # run -> the whole turn, every request's prefill and decode
    identical: int  # conversations whose tokens were the same in both runs (logprobs within the tolerance)
    first_difference: str = ""  # the first departure beyond the tolerance, when some departed
    near_ties: int = 0  # conversations that took the other token of a near tie in the model's precision
    first_near_tie: str = ""

    @property
    def matching(self) -> int:
        """Conversations without a difference beyond the tolerance (near ties count as matching)."""
        return self.identical + self.near_ties

    @property
    def hit_rate(self) -> float:
        return self.loaded_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ReplayReport:
    """Every turn's comparison, and what the runs were."""

    model: str
    workload: str
    settings: dict[str, Any]
    turns: list[TurnReport] = field(default_factory=list)
    plugin_stats: dict[str, float] = field(default_factory=dict)  # the connector's counters over the run with it
    step_name: str = "turn"  # what a row is: a chat's turn, or a wave of concurrent requests
    ttft_p50: dict[str, float] = field(default_factory=dict)  # run -> median TTFT over every request

    @property
    def all_match(self) -> bool:
        """No conversation departed beyond its model dtype's tolerance (near ties aside)."""
        return all(t.matching == t.requests for t in self.turns)

    def totals(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        loaded = sum(t.loaded_tokens for t in self.turns)
        return {"requests": sum(t.requests for t in self.turns), "prompt_tokens": prompt, "loaded_tokens": loaded,
                "computed_tokens": prompt - loaded, "hit_rate": loaded / prompt if prompt else 0.0,
                "prefill_s": {run: sum(t.prefill_s[run] for t in self.turns) for run in RUNS},
                "ttft_s": dict(self.ttft_p50) or {run: statistics.median(t.ttft_s[run] for t in self.turns)
                                                  for run in RUNS},
                "wall_s": {run: sum(t.wall_s[run] for t in self.turns) for run in RUNS},
                "identical": self.all_match, "near_ties": sum(t.near_ties for t in self.turns)}

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "workload": self.workload, "settings": self.settings, "rows": self.step_name,
                "turns": [{**asdict(t), "hit_rate": t.hit_rate} for t in self.turns], "totals": self.totals(),
                "plugin_stats": self.plugin_stats}


def compare_turns(without: Sequence[TurnRun], with_plugin: Sequence[TurnRun],
                  tolerance: float = tolerance_for("float32")) -> list[TurnReport]:
    """Turn reports from the two runs of one workload; `tolerance`: the model dtype's (`compare.tolerance_for`)."""
    if [r.conversations for r in without] != [r.conversations for r in with_plugin]:
        raise ValueError("the two runs did not run the same turns")
    reports = []
    for base, run in zip(without, with_plugin):
        # tokens, as a user sees them (a near tie excused); the engine tests also hold logprobs and rows to account
        verdicts = [(conv, compare(a, b, tolerance, logprobs=False))
                    for conv, a, b in zip(run.conversations, base.completions, run.completions)]
        differences = [f"conversation {conv}: {v.difference}" for conv, v in verdicts if v.difference]
        ties = [f"conversation {conv} {v.near_tie}" for conv, v in verdicts if v.near_tie and not v.difference]
        prompt = sum(c.prompt_tokens for c in run.completions)
        loaded = sum(c.cached_tokens for c in run.completions)
        reports.append(TurnReport(
            turn=run.turn + 1, requests=len(run.completions), prompt_tokens=prompt, loaded_tokens=loaded,
            computed_tokens=prompt - loaded,
            prefill_s={name: max(c.ttft_s for c in r.completions) for name, r in zip(RUNS, (base, run))},
            ttft_s={name: statistics.median(c.ttft_s for c in r.completions) for name, r in zip(RUNS, (base, run))},
            wall_s={"without": base.wall_s, "with": run.wall_s},
            identical=len(run.completions) - len(differences) - len(ties),
            first_difference=differences[0] if differences else "", near_ties=len(ties),
            first_near_tie=ties[0] if ties else ""))
    return reports


def run_replay(model: str, conversations: Sequence[Conversation], workload: str, settings: EngineSettings,
               extra_config: Mapping[str, Any], on_turn: Optional[Callable[[str, TurnRun], None]] = None,
               on_phase: Optional[Callable[[str], None]] = None) -> ReplayReport:
    """The workload without the plugin, then with it (`extra_config`: the connector's config), each on a fresh
    engine. `on_turn(run, turn)` sees each turn as it completes; `on_phase` each engine start."""
    tolerance = tolerance_for(settings.dtype)  # an unknown dtype fails before either run, not after both
    runs: dict[str, list[TurnRun]] = {}
    stats: dict[str, float] = {}
    for name in RUNS:
        if on_phase is not None:
            on_phase(f"starting the engine {name} the plugin")
        started = time.perf_counter()
        plugin = name == "with"
        engine = Engine(replace(settings, plugin=plugin, extra_config=dict(extra_config) if plugin else {}))
        try:
            if on_phase is not None:
                on_phase(f"engine {name} the plugin up in {time.perf_counter() - started:.1f} s")
            runs[name] = run_workload(engine, conversations,
                                      None if on_turn is None else (lambda turn, n=name: on_turn(n, turn)),
                                      logprobs=COMPARED_LOGPROBS)
            if plugin:
                stats = engine.plugin_stats()
        finally:
            engine.close()
    waves = any(c.start for c in conversations)
    report = ReplayReport(model=model, workload=workload, settings=_settings_json(settings, extra_config),
                          step_name="wave" if waves else "turn")
    report.turns = compare_turns(runs["without"], runs["with"], tolerance)
    report.ttft_p50 = {name: statistics.median(c.ttft_s for turn in runs[name] for c in turn.completions)
                       for name in RUNS}
    report.plugin_stats = stats
    return report


def _settings_json(settings: EngineSettings, extra_config: Mapping[str, Any]) -> dict[str, Any]:
    values = asdict(settings)
    values.pop("plugin")
    values["extra_config"] = dict(extra_config)
    return values


def _matching_cell(matching: int, requests: int, near_ties: int) -> str:
    if matching != requests:
        return f"[red]{matching}/{requests}[/red]"
    return f"yes, {near_ties} near tie{'s' if near_ties > 1 else ''}" if near_ties else "yes"


def render_report(report: ReplayReport) -> list[Any]:
    """Rich renderables: the per-turn table and a one-line verdict."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{report.workload} on {report.model}: without the plugin vs with it", title_justify="left")
    for column in (report.step_name, "requests", "prompt tokens", "loaded", "computed", "hit rate", "prefill without",
                   "prefill with", "TTFT p50 without", "TTFT p50 with", "identical"):
        table.add_column(column, justify="right")

    def seconds(value: float) -> str:
        return f"{value * 1e3:.0f} ms" if value < 10 else f"{value:.1f} s"

    for t in report.turns:
        table.add_row(str(t.turn), str(t.requests), str(t.prompt_tokens), str(t.loaded_tokens),
                      str(t.computed_tokens), f"{t.hit_rate:.0%}", seconds(t.prefill_s["without"]),
                      seconds(t.prefill_s["with"]), seconds(t.ttft_s["without"]), seconds(t.ttft_s["with"]),
                      _matching_cell(t.matching, t.requests, t.near_ties))
    totals = report.totals()
    table.add_section()
    table.add_row("all", str(totals["requests"]), str(totals["prompt_tokens"]), str(totals["loaded_tokens"]),
                  str(totals["computed_tokens"]), f"{totals['hit_rate']:.0%}", seconds(totals["prefill_s"]["without"]),
                  seconds(totals["prefill_s"]["with"]), seconds(totals["ttft_s"]["without"]),
                  seconds(totals["ttft_s"]["with"]),
                  _matching_cell(sum(t.matching for t in report.turns), totals["requests"], totals["near_ties"]))
    if report.all_match and not totals["near_ties"]:
        verdict = Text("every conversation's tokens were identical with and without the plugin", style="green")
    elif report.all_match:
        first = next(t.first_near_tie for t in report.turns if t.first_near_tie)
        verdict = Text(f"every conversation's tokens were identical with and without the plugin up to "
                       f"{totals['near_ties']} near tie(s) of the model's {report.settings.get('dtype')} logits, "
                       f"where either token is right ({first})", style="yellow")
    else:
        first = next(t.first_difference for t in report.turns if t.first_difference)
        verdict = Text(f"tokens differed with the plugin: {first}", style="red")
    ttft, wall = totals["ttft_s"], totals["wall_s"]
    summary = Text(f"TTFT p50 {seconds(ttft['without'])} without the plugin, {seconds(ttft['with'])} with it "
                   f"({ttft['without'] / max(ttft['with'], 1e-9):.1f}x); the whole workload {seconds(wall['without'])} "
                   f"without, {seconds(wall['with'])} with. Prefill: from a {report.step_name}'s submission until "
                   f"each of its requests had its first token.")
    return [table, summary, verdict]
