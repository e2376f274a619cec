"""Warming an engine up before anything is timed, and telling a run that was not.

The first requests an engine serves pay for lazy initialisation (kernels, allocator pools, the plugin's arena pages);
a timed run that starts cold charges that to whichever configuration runs first. Every engine therefore serves a few
requests of tokens unrelated to the workload (a separate seed: nothing of them is a prefix of a timed prompt) in
the shapes of its first wave, twice, then empties vLLM's prefix cache; the run records that it did, and a
comparison refuses runs without that record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from .workload import FIRST_TOKEN, Conversation

WARMUP_SEED = 0x5EED_0FF  # unrelated to any workload seed a user picks from small integers


@dataclass(frozen=True)
class WarmUp:
    """What an engine served before its timed run."""

    requests: int
    prompt_tokens: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "seconds": self.seconds}


def warmup_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids from a seed no workload uses."""
    if count < 1 or length < 1:
        raise ValueError(f"a warm-up needs at least one request of at least one token, got {count} of {length}")
    rng = np.random.default_rng(WARMUP_SEED)
    return [[int(t) for t in rng.integers(FIRST_TOKEN, vocab, length)] for _ in range(count)]


def shadow_first_turn(conversations: Sequence[Conversation], vocab: int) -> list[list[int]]:
    """The first wave's prompts with every token replaced by an unrelated one: the same lengths, batch and sharing
    (a system prompt shared by conversations stays shared), so the warm-up runs the shapes the timed run starts with
    while nothing of it is a prefix of a timed prompt."""
    first = [c for c in conversations if c.start == 0]
    if not first:
        raise ValueError("a workload without a conversation starting in wave 0 has nothing to warm up with")
    rng = np.random.default_rng(WARMUP_SEED)
    systems: dict[tuple[int, ...], list[int]] = {}
    prompts = []
    for conversation in first:
        if conversation.system not in systems:
            systems[conversation.system] = [int(t) for t in rng.integers(FIRST_TOKEN, vocab, len(conversation.system))]
        user = [int(t) for t in rng.integers(FIRST_TOKEN, vocab, len(conversation.turns[0].user))]
        prompts.append(systems[conversation.system] + user)
    return prompts


def warm_up(engine: Any, prompts: Sequence[Sequence[int]], output_tokens: int = 4,
            logprobs: int = 0) -> WarmUp:
    """Serves `prompts` (unrelated to the timed workload) on `engine` (a `replay.engine.Engine`): the first alone,
    then all of them twice (computed, then found in the caches), then empties vLLM's prefix cache (when on) so the
    timed run starts with nothing of vLLM's cached but warm code paths and kernels for its shapes. `logprobs`: the
    top logprobs the timed run asks for (vLLM sets their path up on the first request asking for them: seconds on
    a CPU engine, which a warm-up without them would leave to the timed run's first wave)."""
    if not prompts:
        raise ValueError("a warm-up needs at least one prompt")
    started = time.perf_counter()
    engine.generate(prompts[:1], output_tokens, logprobs)  # one alone first: the lazy set-up of a single request
    for _ in range(2):
        engine.generate(prompts, output_tokens, logprobs)
    if engine.settings.prefix_caching:
        engine.reset_prefix_cache()
    tokens = 2 * sum(len(p) for p in prompts) + len(prompts[0])
    return WarmUp(2 * len(prompts) + 1, tokens, time.perf_counter() - started)


def cold_runs(warmups: Sequence[tuple[str, Optional[WarmUp]]]) -> list[str]:
    """The runs (by label) that were timed without a warm-up; a comparison including one is not fair."""
    return [label for label, warm in warmups if warm is None or warm.requests < 1]
