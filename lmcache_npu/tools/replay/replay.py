"""`lmcache-npu replay`: one workload on a real vLLM engine in every configuration (vLLM alone, vLLM with the
plugin, ...), each run on a fresh, warmed-up engine, repeated with the order alternating; per turn and in total:
where the prompt tokens came from, TTFT p50/p90, prefill and wall time (medians, min-max), identical tokens; then a
restart phase on the plugin's disk tier."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from .accounting import SOURCES
from .compare import tolerance_for
from .configs import PLUGIN_CONNECTOR, RunConfig, run_order
from .connectors import ConnectorServices
from .engine import EngineSettings
from .turns import TurnReport, compare_turns
from .restart import RestartResult, run_restart
from .runner import TurnRun
from .runs import RunResult, start_engine, timed_run
from .spread import Spread, spread_of
from .steps import StepCounts
from .verdict import Summary, seconds, turn_verdict, verdict_line
from .warmup import cold_runs
from .workload import Conversation

logger = logging.getLogger(__name__)

TIMES = ("ttft_p50_s", "ttft_p90_s", "prefill_s", "wall_s")
TIME_COLUMNS = {"ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90", "prefill_s": "prefill", "wall_s": "wall"}
SOURCE_COLUMNS = {"vllm": "vLLM cache hit", "arena": "plugin: arena", "disk": "disk", "mooncake": "Mooncake",
                  "peer": "peer connector", "computed": "computed"}


@dataclass
class ReplayReport:
    """Every run of every configuration, their comparison, and the restart phase."""

    model: str
    workload: str
    settings: dict[str, Any]
    configs: list[str]  # the first is the baseline and the tokens' reference
    runs: list[RunResult]
    working_set_tokens: int = 0
    step_name: str = "turn"  # what a row is: a chat's turn, or a wave of concurrent requests
    restart: Optional[RestartResult] = None
    identity: dict[str, list[list[TurnReport]]] = field(default_factory=dict)  # config -> per run, per turn

    def runs_of(self, config: str) -> list[RunResult]:
        found = [r for r in self.runs if r.config == config]
        if not found:
            raise ValueError(f"no runs of configuration {config!r}; ran: {', '.join(self.configs)}")
        return found

    @property
    def repeats(self) -> int:
        return min(len(self.runs_of(c)) for c in self.configs)

    @property
    def capacity_tokens(self) -> int:
        return max((r.capacity_tokens for r in self.runs), default=0)

    @property
    def working_set_ratio(self) -> float:
        return self.working_set_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def turn_spreads(self, config: str) -> list[dict[str, Spread]]:
        """Per turn: each timing and each source's tokens over the configuration's runs."""
        runs = self.runs_of(config)
        rows = []
        for turn in range(len(runs[0].turns)):
            row = {name: spread_of(getattr(r.times()[turn], name) for r in runs) for name in TIMES}
            row.update({s: spread_of(r.hits[turn].by_source()[s] for r in runs) for s in SOURCES})
            rows.append(row)
        return rows

    def total_spreads(self, config: str) -> dict[str, Spread]:
        runs = self.runs_of(config)
        row = {name: spread_of(getattr(r.total_times(), name) for r in runs) for name in TIMES}
        row.update({s: spread_of(r.total_hits().by_source()[s] for r in runs) for s in SOURCES})
        return row

    def matching(self, config: str, turn: Optional[int] = None) -> tuple[int, int, int]:
        """(matching, requests, near ties) of every run of `config` against the reference, one turn or all."""
        reports = [t for run in self.identity.get(config, []) for i, t in enumerate(run) if turn in (None, i)]
        return (sum(t.matching for t in reports), sum(t.requests for t in reports),
                sum(t.near_ties for t in reports))

    @property
    def all_match(self) -> bool:
        tokens = all(m == n for m, n, _ in (self.matching(c) for c in self.configs))
        return tokens and (self.restart is None or self.restart.identity.matching == self.restart.identity.requests)

    def first_difference(self) -> str:
        for config, runs in self.identity.items():
            for run, turns in zip(self.runs_of(config), runs):
                for t in turns:
                    if t.first_difference:
                        return f"{run.label}, {self.step_name} {t.turn}: {t.first_difference}"
        if self.restart is not None and self.restart.identity.first_difference:
            return f"restart: {self.restart.identity.first_difference}"
        return ""

    def step_counts(self, config: str) -> StepCounts:
        """Scheduler steps from admission to first token of the plugin's hits, over every run of `config`."""
        return StepCounts.merged([r.total_steps() for r in self.runs_of(config)])

    def load_mode(self, config: str) -> str:
        """"" for vLLM alone or a peer, else the plugin configuration's load_mode (auto by default)."""
        if self.connector_kind(config) != "plugin":
            return ""
        return str(self.settings.get("configs", {}).get(config, {}).get("extra_config", {}).get("load_mode", "auto"))

    def connector_kind(self, config: str) -> str:
        """"" for vLLM alone, "plugin" or "peer": how the verdict names a configuration's connector hits."""
        connector = self.settings.get("configs", {}).get(config, {}).get("connector", "")
        return "" if not connector else "plugin" if connector == PLUGIN_CONNECTOR else "peer"

    def summary(self, candidate: Optional[str] = None, baseline: Optional[str] = None) -> Summary:
        """The verdict's numbers: `baseline` (default: the first configuration) against `candidate` (default: the
        second)."""
        if len(self.configs) < 2:
            raise ValueError("a verdict needs a baseline and a candidate configuration")
        base, cand = baseline or self.configs[0], candidate or self.configs[1]
        b, c = self.total_spreads(base), self.total_spreads(cand)
        return Summary(base, cand, self.repeats, (b["ttft_p50_s"], c["ttft_p50_s"]), (b["ttft_p90_s"], c["ttft_p90_s"]),
                       (b["wall_s"], c["wall_s"]), self.runs_of(base)[0].total_hits().prompt_tokens,
                       {s: b[s].median for s in SOURCES}, {s: c[s].median for s in SOURCES},
                       bool(self.settings.get("prefix_caching")), self.working_set_ratio,
                       cold_runs([(r.label, r.warmup) for r in self.runs]), self.connector_kind(base),
                       self.connector_kind(cand))

    def turn_verdict(self, candidate: str, baseline: str) -> tuple[str, str]:
        """Whether `candidate` is ever slower than `baseline` on a turn (TTFT p50 or p90 beyond the spread)."""
        base, cand = self.turn_spreads(baseline), self.turn_spreads(candidate)
        return turn_verdict(baseline, candidate, self.step_name,
                            [(b["ttft_p50_s"], c["ttft_p50_s"], b["ttft_p90_s"], c["ttft_p90_s"])
                             for b, c in zip(base, cand)], self.repeats)

    def verdict_pairs(self) -> list[tuple[str, str]]:
        """(baseline, candidate) of every verdict: each configuration against the first, then the plugin against
        the peer when both ran (the comparison users make)."""
        pairs = [(self.configs[0], c) for c in self.configs[1:]]
        plugins = [c for c in self.configs[1:] if self.connector_kind(c) == "plugin"]
        peers = [c for c in self.configs[1:] if self.connector_kind(c) == "peer"]
        # issue 41: each other load mode against today's asynchronous loads
        modes = [(a, c) for a in plugins if self.load_mode(a) == "async" for c in plugins if c != a]
        return pairs + modes + [(peer, plugin) for plugin in plugins for peer in peers]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "workload": self.workload, "settings": self.settings, "rows": self.step_name,
            "configs": self.configs, "repeats": self.repeats, "working_set_tokens": self.working_set_tokens,
            "device_capacity_tokens": self.capacity_tokens, "working_set_ratio": self.working_set_ratio,
            "identical": self.all_match, "first_difference": self.first_difference(), "per_config": {},
            "runs": [{"config": r.config, "repeat": r.repeat, "position": r.position,
                      "warmup": None if r.warmup is None else r.warmup.to_json(),
                      "turns": [{**asdict(t), "hits": h.by_source(), "prompt_tokens": h.prompt_tokens}
                                for t, h in zip(r.times(), r.hits)],
                      "plugin_stats": r.plugin_stats, "reloaded_tokens": r.reloaded_tokens,
                      "admission_to_first_token_steps": [t.to_json() for t in r.steps],
                      "accounting_mismatches": r.mismatches} for r in self.runs]}
        for config in self.configs:
            matching, requests, ties = self.matching(config)
            out["per_config"][config] = {
                "turns": [{k: v.to_json() for k, v in row.items()} for row in self.turn_spreads(config)],
                "totals": {k: v.to_json() for k, v in self.total_spreads(config).items()},
                "matching": matching, "requests": requests, "near_ties": ties, "load_mode": self.load_mode(config),
                "admission_to_first_token_steps": self.step_counts(config).to_json()}
        if len(self.configs) > 1:
            out["verdict"] = verdict_line(self.summary())[0]
            out["verdicts"] = [{"baseline": b, "candidate": c, "text": verdict_line(self.summary(c, b))[0],
                                "per_step": self.turn_verdict(c, b)[0]} for b, c in self.verdict_pairs()]
        if self.restart is not None:
            out["restart"] = self.restart.to_json()
        return out


def run_replay(model: str, conversations: Sequence[Conversation], workload: str, settings: EngineSettings,
               configs: Sequence[RunConfig], vocab: int, repeats: int = 3, working_set_tokens: int = 0,
               restart: bool = True, warmup: bool = True,
               on_turn: Optional[Callable[[str, TurnRun], None]] = None,
               on_phase: Optional[Callable[[str], None]] = None,
               services: Optional[ConnectorServices] = None) -> ReplayReport:
    """Every configuration `repeats` times in alternating order, each run on a fresh engine (a run with the plugin on
    a disk directory of its own, a peer's under a key prefix of its own, so no run finds an earlier run's KV), then
    the restart phase on the last plugin run's disk directory. `services`: what `connector_services(configs)`
    started (a peer configuration needs them)."""
    tolerance = tolerance_for(settings.dtype)  # an unknown dtype fails before any run, not after all
    runs: list[RunResult] = []
    order = run_order(configs, repeats)
    last_disk = ""
    several = sum(c.plugin for c in configs) > 1  # each plugin configuration's runs need disk directories of their own
    for step, (repeat, config) in enumerate(order):
        extra = dict(config.extra_config)
        if config.plugin and extra.get("disk_path"):
            mode = config.extra_config.get("load_mode", "auto")
            run_dir = f"{configs.index(config)}-{mode}-run-{repeat + 1}" if several else f"run-{repeat + 1}"
            disk = os.path.join(str(extra["disk_path"]), run_dir)
            extra["disk_path"] = disk
            if config is next(c for c in configs if c.plugin):  # the restart phase reopens the first plugin's
                last_disk = disk
            if os.path.isdir(disk) and os.listdir(disk):
                raise ValueError(f"{disk} is not empty: a timed run's disk tier must start empty (choose another "
                                 f"--disk-path or empty it)")
        if config.peer:  # the master outlives the runs: each run's objects under their own prefix
            extra["cache_prefix"] = f"{extra.get('cache_prefix') or 'replay'}-run-{repeat + 1}"
        if on_phase is not None:
            on_phase(f"run {step + 1}/{len(order)}: starting {config.name}")
        started = time.perf_counter()
        engine = start_engine(settings, config, extra, services)
        try:
            logger.info("%s up in %.1f s", config.name, time.perf_counter() - started)
            position = step - next(i for i, (r, _) in enumerate(order) if r == repeat)
            runs.append(timed_run(engine, config, repeat, position, conversations, vocab, warmup,
                                  None if on_turn is None else (lambda turn, n=config.name: on_turn(n, turn))))
        finally:
            engine.close()
    waves = any(c.start for c in conversations)
    report = ReplayReport(model, workload, _settings_json(settings, configs), [c.name for c in configs], runs,
                          working_set_tokens, "wave" if waves else "turn")
    reference = report.runs_of(configs[0].name)[0]
    for config in configs:
        report.identity[config.name] = [compare_turns(reference.turns, r.turns, tolerance)
                                        for r in report.runs_of(config.name)]
    plugin = next((c for c in configs if c.plugin), None)
    if restart and plugin is not None and last_disk and not waves:
        last = report.runs_of(plugin.name)[-1]
        report.restart = run_restart(settings, plugin, last_disk, conversations, last.answers(len(conversations)),
                                     vocab, settings.seed, tolerance, on_phase)
    return report


def _settings_json(settings: EngineSettings, configs: Sequence[RunConfig]) -> dict[str, Any]:
    values = asdict(settings)
    values.pop("plugin")
    values.pop("extra_config")
    values["configs"] = {c.name: {"connector": c.connector, "extra_config": dict(c.extra_config)} for c in configs}
    plugin = next((c for c in configs if c.plugin), None)
    values["extra_config"] = dict(plugin.extra_config) if plugin is not None else {}
    return values


def _spread_table(report: ReplayReport, title: str, headers: Sequence[str],
                  cells: Callable[[dict[str, Spread], tuple[int, int, int]], list[str]]) -> Any:
    """A row per step and configuration, then the totals: `cells` of the row's spreads and token matching. Only a
    configuration's name may wrap (at its spaces), so a number or its range is never split across lines."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column(report.step_name, justify="right", no_wrap=True)
    table.add_column("run", justify="right")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    spreads = {c: report.turn_spreads(c) for c in report.configs}
    for turn in range(len(report.runs[0].turns)):
        for config in report.configs:
            table.add_row(str(turn + 1), config, *cells(spreads[config][turn], report.matching(config, turn)))
        table.add_section()
    for config in report.configs:
        table.add_row("all", config, *cells(report.total_spreads(config), report.matching(config)))
    return table


def spread_cell(spread: Spread, repeats: int, unit: str = "s") -> str:
    """The median, and the min-max on a second line (the unit once where both ends share it): a cell as narrow as
    its widest number, so the demo's tables fit 120 columns."""
    value = seconds(spread.median) if unit == "s" else f"{spread.median:,.0f}"
    if repeats < 2 or spread.low == spread.high:
        return value
    if unit != "s":
        return f"{value}\n{spread.low:,.0f}-{spread.high:,.0f}"
    low, high = seconds(spread.low), seconds(spread.high)
    low_number, _, low_unit = low.partition(" ")
    return f"{value}\n{low_number if low_unit == high.partition(' ')[2] else low}-{high}"


def matching_cell(matching: int, requests: int, near_ties: int) -> str:
    if matching != requests:
        return f"[red]{matching}/{requests}[/red]"
    return f"yes, {near_ties} near tie{'s' if near_ties > 1 else ''}" if near_ties else "yes"


def render_report(report: ReplayReport) -> list[Any]:
    """Rich renderables: the per-turn times and the per-turn token sources (medians, min-max below each), the restart
    phase, the verdict, the token check."""
    from rich.text import Text

    repeats = report.repeats
    spread_note = f"medians of {repeats} runs each, min-max below" if repeats > 1 else "one run each"
    totals = {c: report.total_spreads(c) for c in report.configs}
    # a source no run of any configuration drew from is left out (a narrower table), and said so below it
    sources = [s for s in SOURCES if s == "computed" or any(totals[c][s].high for c in report.configs)]
    times = _spread_table(report, f"{report.workload} on {report.model}: times per {report.step_name}; {spread_note}",
                          [TIME_COLUMNS[t] for t in TIMES],
                          lambda row, _: [spread_cell(row[t], repeats) for t in TIMES])
    tokens = _spread_table(report, f"prompt tokens by where they came from, per {report.step_name}; {spread_note}",
                           [*(SOURCE_COLUMNS[s] for s in sources), "identical"],
                           lambda row, matching: [*(spread_cell(row[s], repeats, "tokens") for s in sources),
                                                  matching_cell(*matching)])
    out: list[Any] = [times, tokens]
    steps = render_steps(report)
    if steps is not None:
        out.append(steps)
    unused = [SOURCE_COLUMNS[s] for s in SOURCES if s not in sources]
    if unused:
        out.append(Text(f"no tokens came from: {', '.join(unused)} (columns left out)"))
    context = (f"prompt tokens: {report.runs[0].total_hits().prompt_tokens:,} per run; working set "
               f"{report.working_set_tokens:,} tokens")
    if report.capacity_tokens:
        context += (f", device KV cache {report.capacity_tokens:,} tokens (vLLM's count): the working set is "
                    f"{report.working_set_ratio:.1f}x what the device holds")
    out.append(Text(context + ". TTFT: arrival to first token; prefill: a turn's submission until each of its "
                    "requests had its first token; identical: every run's tokens against the first run of "
                    f"{report.configs[0]}."))
    mismatches = [m for r in report.runs for m in r.mismatches]
    if mismatches:
        out.append(Text(f"hit accounting: {len(mismatches)} load(s) where the plugin's counters and the ledger "
                        f"disagreed, first: {mismatches[0]}", style="red"))
    if report.restart is not None:
        out.append(render_restart(report.restart))
    for baseline, candidate in report.verdict_pairs():
        text, style = verdict_line(report.summary(candidate, baseline))
        out.append(Text(text, style=style))
        if not report.summary(candidate, baseline).cold:
            out.append(Text(*report.turn_verdict(candidate, baseline)))
    difference = report.first_difference()
    if difference:
        out.append(Text(f"tokens differed: {difference}", style="red"))
    else:
        ties = sum(report.matching(c)[2] for c in report.configs)
        out.append(Text("every conversation's tokens were identical in every run" +
                        (f", up to {ties} near tie(s) of the model's {report.settings.get('dtype')} logits"
                         if ties else ""), style="green" if not ties else "yellow"))
    return out


def render_steps(report: ReplayReport) -> Any:
    """Per plugin configuration: its load mode, TTFT over every run, and the scheduler steps from admission to first
    token of its hits (issue 41: a sliced hit computes in the step that admits it); None without the plugin."""
    from rich.table import Table

    plugins = [c for c in report.configs if report.connector_kind(c) == "plugin"]
    if not plugins:
        return None
    table = Table(title="the plugin's hits per load mode: scheduler steps from admission (blocks allocated with "
                  "external tokens) to the step that samples the first token, over every run", title_justify="left")
    for column in ("run", "load_mode", "TTFT p50", "TTFT p90", "hit requests", "steps median", "p90", "max",
                   "steps: requests", "loaded sliced"):
        table.add_column(column, justify="right", no_wrap=column != "run")
    for config in plugins:
        counts, totals = report.step_counts(config), report.total_spreads(config)
        histogram = ", ".join(f"{k}: {v}" for k, v in counts.histogram().items()) or "-"
        summary = counts.to_json()
        table.add_row(config, report.load_mode(config), seconds(totals["ttft_p50_s"].median),
                      seconds(totals["ttft_p90_s"].median), f"{counts.hits}", f"{summary['median']:g}",
                      f"{summary['p90']:g}", f"{summary['max']}", histogram, f"{counts.sliced}")
    return table


def render_restart(restart: RestartResult) -> Any:
    """The restart phase as one table; a source neither engine drew from is left out, and only an engine's name may
    wrap, so the table fits 120 columns."""
    from rich.table import Table

    runs = (("cold restart, " + restart.cold.config, restart.cold),
            ("restart on the disk tier, " + restart.restarted.config, restart.restarted))
    hits = {name: run.total_hits().by_source() for name, run in runs}
    sources = [s for s in SOURCES if s == "computed" or any(h[s] for h in hits.values())]
    table = Table(title="restart: every conversation's next turn on a fresh engine (host arena and vLLM's cache "
                  "empty)", title_justify="left")
    table.add_column("engine", justify="right")
    for column in ("TTFT p50", "TTFT p90", "prefill", *(SOURCE_COLUMNS[s] for s in sources), "identical"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, run in runs:
        times = run.total_times()
        identical = (matching_cell(restart.identity.matching, restart.identity.requests, restart.identity.near_ties)
                     if run is restart.restarted else "reference")
        table.add_row(name, seconds(times.ttft_p50_s), seconds(times.ttft_p90_s), seconds(times.prefill_s),
                      *(f"{hits[name][s]:,}" for s in sources), identical)
    return table


__all__ = ["ReplayReport", "run_replay", "render_report", "render_restart", "render_steps"]
