"""Runs a workload on one engine, turn by turn: every conversation's turn n is submitted together, as concurrent
users would send them, and each answer becomes part of that conversation's next prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .engine import Completion, Engine
from .workload import Conversation, prompt_of


@dataclass(frozen=True)
class TurnRun:
    """One turn of every conversation that has it."""

    turn: int
    conversations: tuple[int, ...]  # which conversations took part, in the order of `completions`
    completions: tuple[Completion, ...]
    wall_s: float


def run_workload(engine: Engine, conversations: Sequence[Conversation],
                 on_turn: Optional[Callable[[TurnRun], None]] = None) -> list[TurnRun]:
    """Every turn of every conversation; `on_turn` sees each turn as it completes."""
    answers: list[list[tuple[int, ...]]] = [[] for _ in conversations]
    runs = []
    for turn in range(max(len(c.turns) for c in conversations)):
        taking_part = tuple(i for i, c in enumerate(conversations) if turn < len(c.turns))
        prompts = [prompt_of(conversations[i], answers[i], turn) for i in taking_part]
        # one generate per output length: vLLM takes one SamplingParams per call
        lengths = sorted({conversations[i].turns[turn].output_tokens for i in taking_part})
        completions: dict[int, Completion] = {}
        started = time.perf_counter()
        for length in lengths:
            group = [k for k, i in enumerate(taking_part) if conversations[i].turns[turn].output_tokens == length]
            for k, done in zip(group, engine.generate([prompts[k] for k in group], length)):
                completions[k] = done
        run = TurnRun(turn, taking_part, tuple(completions[k] for k in range(len(taking_part))),
                      time.perf_counter() - started)
        for i, done in zip(taking_part, run.completions):
            answers[i].append(done.token_ids)
        runs.append(run)
        if on_turn is not None:
            on_turn(run)
    return runs
