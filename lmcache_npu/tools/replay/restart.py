"""The restart phase: what no prefix cache can do. After the timed runs, a fresh engine with the plugin starts on the
disk tier the last run with it wrote (its host arena empty, vLLM's cache empty) and every conversation sends its next
turn; a fresh engine without the plugin (vLLM's prefix cache on but empty: a cold restart) sends the same prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .configs import BASELINE, RunConfig
from .engine import EngineSettings
from .turns import TurnReport, compare_turns
from .runs import RunResult, start_engine, timed_run
from .workload import Conversation, Turn, _Tokens, prompt_of

NEXT_TURN_SEED_OFFSET = 7919  # the next turn's user messages: a seed apart from the workload's own


@dataclass
class RestartResult:
    """The next turn after a restart: cold without the plugin, and with the plugin on its disk tier."""

    disk_path: str
    cold: RunResult
    restarted: RunResult
    identity: TurnReport  # the restarted engine's tokens against the cold one's

    def to_json(self) -> dict[str, Any]:
        identical = self.identity.matching == self.identity.requests
        out: dict[str, Any] = {"disk_path": self.disk_path, "identical": identical}
        for name, run in (("cold", self.cold), ("restarted", self.restarted)):
            times, hits = run.total_times(), run.total_hits()
            out[name] = {"config": run.config, "ttft_p50_s": times.ttft_p50_s, "ttft_p90_s": times.ttft_p90_s,
                         "prefill_s": times.prefill_s, "wall_s": times.wall_s, "hits": hits.by_source(),
                         "prompt_tokens": hits.prompt_tokens}
        return out


def next_turns(conversations: Sequence[Conversation], answers: Sequence[Sequence[Sequence[int]]], vocab: int,
               seed: int) -> list[Conversation]:
    """Each conversation's next turn as a one-turn conversation: its whole history (system prompt, every user message
    and answer so far) as the prefix, then a new user message as long as its last one."""
    tokens = _Tokens(vocab, seed + NEXT_TURN_SEED_OFFSET)
    out = []
    for conversation, said in zip(conversations, answers, strict=True):
        if len(said) != len(conversation.turns):
            raise ValueError(f"a conversation of {len(conversation.turns)} turns has {len(said)} answers")
        last = len(conversation.turns) - 1
        history = prompt_of(conversation, said, last) + list(said[last])
        out.append(Conversation(tuple(history), (Turn(tokens(len(conversation.turns[last].user)),
                                                      conversation.turns[last].output_tokens),)))
    return out


def run_restart(settings: EngineSettings, plugin: RunConfig, disk_path: str, conversations: Sequence[Conversation],
                answers: Sequence[Sequence[Sequence[int]]], vocab: int, seed: int, tolerance: float,
                on_phase: Optional[Callable[[str], None]] = None) -> RestartResult:
    """The next turn on a cold engine without the plugin, then on a restarted one with it over `disk_path`; each
    engine warmed up first (its warm-up prompts are unrelated to the conversations)."""
    if not plugin.plugin:
        raise ValueError(f"the restart phase needs the plugin's configuration, got {plugin.name!r}")
    following = next_turns(conversations, answers, vocab, seed)
    results = []
    for config, extra in ((RunConfig(BASELINE), None), (plugin, {**plugin.extra_config, "disk_path": disk_path})):
        if on_phase is not None:
            on_phase(f"restart: starting {config.name}")
        engine = start_engine(settings, config, extra)
        try:
            results.append(timed_run(engine, config, 0, len(results), following, vocab))
        finally:
            engine.close()
    cold, restarted = results
    identity = compare_turns(cold.turns, restarted.turns, tolerance)[0]
    return RestartResult(disk_path, cold, restarted, identity)

