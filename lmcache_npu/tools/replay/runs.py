"""One timed run of a workload on a fresh engine: warm-up, every turn, and where each turn's prompt tokens came
from (vLLM's prefix cache, the plugin's tiers, computed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from .accounting import EXTERNAL_HITS, HitLedger, PluginHits, TurnHits, split_hits
from .configs import RunConfig
from .connectors import ConnectorServices, transfer_config
from .engine import Completion, Engine, EngineSettings
from .runner import TurnRun, run_workload
from .sizing import device_capacity_tokens
from .spread import percentile
from .steps import StepCounter, StepCounts
from .warmup import WarmUp, shadow_first_turn, warm_up
from .workload import Conversation

logger = logging.getLogger(__name__)

COMPARED_LOGPROBS = 2  # per step, enough to tell a near tie from a difference


@dataclass(frozen=True)
class TurnTimes:
    """A turn's timings on one run."""

    ttft_p50_s: float
    ttft_p90_s: float
    prefill_s: float  # from the turn's submission until every request had its first token
    wall_s: float  # the whole turn, every request's prefill and decode

    @classmethod
    def of(cls, run: TurnRun) -> "TurnTimes":
        ttfts = [c.ttft_s for c in run.completions]
        return cls(percentile(ttfts, 50), percentile(ttfts, 90), max(ttfts), run.wall_s)


@dataclass
class RunResult:
    """One configuration's timed run of the whole workload."""

    config: str
    repeat: int
    position: int  # where it ran within its repeat (0: first)
    warmup: Optional[WarmUp]
    turns: list[TurnRun]
    hits: list[TurnHits]
    capacity_tokens: int = 0  # vLLM's device KV capacity in tokens
    plugin_stats: dict[str, float] = field(default_factory=dict)
    reloaded_tokens: int = 0  # plugin loads for preempted requests (not in `hits`: vLLM counts a request once)
    mismatches: list[str] = field(default_factory=list)  # where the hit ledger and the plugin's counters disagreed
    steps: list[StepCounts] = field(default_factory=list)  # per turn: the plugin's hits, admission to first token

    @property
    def label(self) -> str:
        return f"{self.config} (repeat {self.repeat + 1})"

    def times(self) -> list[TurnTimes]:
        return [TurnTimes.of(t) for t in self.turns]

    def total_times(self) -> TurnTimes:
        ttfts = [c.ttft_s for t in self.turns for c in t.completions]
        return TurnTimes(percentile(ttfts, 50), percentile(ttfts, 90), sum(max(c.ttft_s for c in t.completions)
                                                                           for t in self.turns),
                         sum(t.wall_s for t in self.turns))

    def total_hits(self) -> TurnHits:
        return TurnHits.summed(self.hits)

    def total_steps(self) -> StepCounts:
        return StepCounts.merged(self.steps)

    def answers(self, conversations: int) -> list[list[tuple[int, ...]]]:
        """Each conversation's answers in turn order (what its next prompt re-sends)."""
        out: list[list[tuple[int, ...]]] = [[] for _ in range(conversations)]
        for turn in self.turns:
            for conversation, completion in zip(turn.conversations, turn.completions):
                out[conversation].append(completion.token_ids)
        return out


def start_engine(settings: EngineSettings, config: RunConfig, extra_config: Optional[dict[str, Any]] = None,
                 services: Optional[ConnectorServices] = None) -> Engine:
    """A fresh engine of `config` over `settings` (`extra_config` replaces the configuration's connector config),
    its connector set up by replay.connectors (`services`: what `connector_services` started; a peer needs them)."""
    connector_config = dict(config.extra_config if extra_config is None else extra_config)
    transfer = transfer_config(replace(config, extra_config=connector_config), services or ConnectorServices())
    return Engine(replace(settings, plugin=config.plugin, extra_config=connector_config if config.plugin else {}),
                  transfer)


class TurnAccounting:
    """Splits each turn's prompt tokens on one engine by source: the plugin's by its ledger, a peer's by vLLM's
    external-hit counter (which also checks the plugin's ledger and that vLLM alone had none). The replay's timed
    runs and the two-engine round robin (tools/replay/pair.py) both account turns through it."""

    def __init__(self, engine: Engine, config: RunConfig) -> None:
        self.engine = engine
        self.config = config
        self.ledger = HitLedger()
        self.steps = StepCounter()  # scheduler steps from admission to first token of the plugin's hits
        if config.plugin:
            self.ledger.attach(engine.scheduler_connector)
            self.steps.attach(engine.scheduler_connector)
        self.reloaded_tokens = 0
        self.mismatches: list[str] = []
        self._external = engine.vllm_counter(EXTERNAL_HITS)  # the counter so far: each turn takes its growth

    def restart(self) -> None:
        """Forgets what was loaded so far (a warm-up's loads are not the workload's)."""
        self.ledger.take()
        self.steps.restart()
        self._external = self.engine.vllm_counter(EXTERNAL_HITS)

    def turn(self, number: int, completions: Sequence[Completion]) -> TurnHits:
        """The tokens by source of turn `number` (0-based), whose requests gave `completions`."""
        plugin: PluginHits = self.ledger.take()
        self.reloaded_tokens += plugin.reloaded_tokens
        self.mismatches.extend(plugin.mismatches)
        now = self.engine.vllm_counter(EXTERNAL_HITS)
        grown, self._external = int(now - self._external), now
        if not self.config.peer and grown != plugin.total:
            self.mismatches.append(f"turn {number + 1}: vLLM counted {grown} external hit tokens, the plugin's ledger "
                                   f"{plugin.total}")
        return split_hits(sum(c.prompt_tokens for c in completions), sum(c.cached_tokens for c in completions),
                          plugin, grown if self.config.peer else 0)


def timed_run(engine: Engine, config: RunConfig, repeat: int, position: int, conversations: Sequence[Conversation],
              vocab: int, warmup: bool = True, on_turn: Optional[Callable[[TurnRun], None]] = None) -> RunResult:
    """Warms `engine` up (unless told not to: a cold run, which comparisons refuse), then runs every turn and
    splits each turn's prompt tokens by source (`TurnAccounting`)."""
    accounting = TurnAccounting(engine, config)
    warm = None
    if warmup:
        warm = warm_up(engine, shadow_first_turn(conversations, vocab), logprobs=COMPARED_LOGPROBS)
        accounting.restart()
    hits: list[TurnHits] = []
    steps: list[StepCounts] = []

    def turn_done(turn: TurnRun) -> None:
        hits.append(accounting.turn(turn.turn, turn.completions))
        steps.append(accounting.steps.take())
        if on_turn is not None:
            on_turn(turn)

    turns = run_workload(engine, conversations, turn_done, logprobs=COMPARED_LOGPROBS)
    return RunResult(config.name, repeat, position, warm, turns, hits, device_capacity_tokens(engine),
                     engine.plugin_stats() if config.plugin else {}, accounting.reloaded_tokens,
                     accounting.mismatches, steps)
