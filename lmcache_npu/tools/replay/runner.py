"""Runs a workload on one engine, wave by wave: the turns a wave holds (every conversation's turn n, when they all
start in wave 0) are submitted together, as concurrent users would send them, and each answer becomes part of that
conversation's next prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .engine import Completion, Engine
from .workload import Conversation, prompt_of


@dataclass(frozen=True)
class TurnRun:
    """One wave: a turn of every conversation that sends one in it."""

    turn: int  # the wave
    conversations: tuple[int, ...]  # which conversations took part, in the order of `completions`
    completions: tuple[Completion, ...]
    wall_s: float


def generate_wave(engine: Engine, prompts: Sequence[Sequence[int]], outputs: Sequence[int],
                  logprobs: int = 0) -> list[Completion]:
    """One wave's completions, in the order of `prompts` (`outputs[k]`: the tokens prompt k generates): one
    generate per output length, since vLLM takes one SamplingParams per call."""
    if len(prompts) != len(outputs):
        raise ValueError(f"a wave of {len(prompts)} prompts needs as many output lengths, got {len(outputs)}")
    completions: dict[int, Completion] = {}
    for length in sorted(set(outputs)):
        group = [k for k, n in enumerate(outputs) if n == length]
        for k, done in zip(group, engine.generate([prompts[k] for k in group], length, logprobs)):
            completions[k] = done
    return [completions[k] for k in range(len(prompts))]


def run_workload(engine: Engine, conversations: Sequence[Conversation],
                 on_turn: Optional[Callable[[TurnRun], None]] = None, logprobs: int = 0) -> list[TurnRun]:
    """Every turn of every conversation; `on_turn` sees each turn as it completes; `logprobs`: the top logprobs
    each step records (a comparison needs two to tell a near tie)."""
    answers: list[list[tuple[int, ...]]] = [[] for _ in conversations]
    runs = []
    for wave in range(max(c.start + len(c.turns) for c in conversations)):
        sending = [(i, turn) for i, c in enumerate(conversations) if (turn := c.turn_in(wave)) is not None]
        if not sending:
            continue
        taking_part, turns = tuple(i for i, _ in sending), [turn for _, turn in sending]
        prompts = [prompt_of(conversations[i], answers[i], t) for i, t in zip(taking_part, turns)]
        outputs = [conversations[i].turns[t].output_tokens for i, t in zip(taking_part, turns)]
        started = time.perf_counter()
        completions = generate_wave(engine, prompts, outputs, logprobs)
        run = TurnRun(wave, taking_part, tuple(completions), time.perf_counter() - started)
        for i, done in zip(taking_part, run.completions):
            answers[i].append(done.token_ids)
        runs.append(run)
        if on_turn is not None:
            on_turn(run)
    return runs
