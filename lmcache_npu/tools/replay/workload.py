"""Workloads the replay runs: conversations whose turns re-send the whole history, as chat clients and agents do.

A conversation is a shared system prompt and a list of turns; turn n's prompt is the system prompt, every earlier
turn's user message and the model's answer to it, then turn n's user message. Token ids stand for text (the engine
runs without a tokenizer), so a workload is lengths plus a seed, or token ids from a trace file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

from ...checks import check_int

FIRST_TOKEN = 10  # ids below it are left to special tokens


@dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class Conversation:
    system: tuple[int, ...]
    turns: tuple[Turn, ...]
    start: int = 0  # the wave (the runner's round of concurrent requests) its first turn is sent in

    def turn_in(self, wave: int) -> int | None:
        """Which of its turns this conversation sends in `wave`, if any."""
        return wave - self.start if self.start <= wave < self.start + len(self.turns) else None


class _Tokens:
    """Random token ids in [FIRST_TOKEN, vocab) from one seeded generator."""

    def __init__(self, vocab: int, seed: int) -> None:
        if vocab <= FIRST_TOKEN:
            raise ValueError(f"vocab must be larger than {FIRST_TOKEN}, got {vocab}")
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, length: int) -> tuple[int, ...]:
        if length < 0:
            raise ValueError(f"a token count must be >= 0, got {length}")
        return tuple(int(t) for t in self.rng.integers(FIRST_TOKEN, self.vocab, length))


def multi_turn_chat(conversations: int, turns: int, system_tokens: int, user_tokens: int, output_tokens: int,
                    vocab: int, seed: int = 0) -> list[Conversation]:
    """`conversations` chats of `turns` turns after one shared system prompt."""
    if conversations < 1 or turns < 1:
        raise ValueError(f"conversations and turns must be >= 1, got {conversations} and {turns}")
    tokens = _Tokens(vocab, seed)
    system = tokens(system_tokens)
    return [Conversation(system, tuple(Turn(tokens(user_tokens), output_tokens) for _ in range(turns)))
            for _ in range(conversations)]


def prefix_repetition(num_prefixes: int, prompts_per_prefix: int, prefix_tokens: int, suffix_tokens: int,
                      output_tokens: int, vocab: int, seed: int = 0) -> list[Conversation]:
    """vLLM's `bench serve --dataset-name prefix_repetition`: `num_prefixes` shared prefixes, each followed by
    `prompts_per_prefix` different suffixes. They are sent in `prompts_per_prefix` waves of one prompt per prefix:
    requests that arrive together cannot find each other's prefix (it is stored once computed), later ones can."""
    if num_prefixes < 1 or prompts_per_prefix < 1:
        raise ValueError(f"num_prefixes and prompts_per_prefix must be >= 1, got {num_prefixes} and "
                         f"{prompts_per_prefix}")
    tokens = _Tokens(vocab, seed)
    prefixes = [tokens(prefix_tokens) for _ in range(num_prefixes)]
    return [Conversation(prefixes[p], (Turn(tokens(suffix_tokens), output_tokens),), start=wave)
            for wave in range(prompts_per_prefix) for p in range(num_prefixes)]


def unique_prompts(waves: int, per_wave: int, prompt_tokens: int, output_tokens: int, vocab: int,
                   seed: int = 0) -> list[Conversation]:
    """No reuse: `waves` waves of `per_wave` one-turn conversations of `prompt_tokens` random tokens each, no two
    sharing a prefix, so a cache can only store them and every lookup misses: what a connector costs per step when
    it cannot help."""
    if waves < 1 or per_wave < 1 or prompt_tokens < 1:
        raise ValueError(f"waves, per_wave and prompt_tokens must be >= 1, got {waves}, {per_wave} and {prompt_tokens}")
    tokens = _Tokens(vocab, seed)
    return [Conversation((), (Turn(tokens(prompt_tokens), output_tokens),), start=wave)
            for wave in range(waves) for _ in range(per_wave)]


def load_trace(path: Union[str, Path], vocab: int, seed: int = 0) -> list[Conversation]:
    """A JSONL file, one conversation per line: {"system": S, "turns": [{"user": U, "output": N}, ...]}, where S
    and U are token id lists or lengths (random ids) and N the tokens to generate."""
    tokens = _Tokens(vocab, seed)
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from exc
            conversations.append(_conversation(record, tokens, where))
    if not conversations:
        raise ValueError(f"{path}: no conversations")
    return conversations


def _conversation(record: Any, tokens: _Tokens, where: str) -> Conversation:
    if not isinstance(record, dict) or not isinstance(record.get("turns"), list) or not record["turns"]:
        raise ValueError(f"{where}: expected {{\"system\": ..., \"turns\": [{{\"user\": ..., \"output\": N}}, ...]}}")
    turns = []
    for i, turn in enumerate(record["turns"]):
        if not isinstance(turn, dict) or "user" not in turn:
            raise ValueError(f"{where}: turn {i} needs a \"user\" (token ids or a length)")
        output = check_int(f"{where}: turn {i}: \"output\" (tokens)", turn.get("output", 64), lo=1)
        turns.append(Turn(_tokens_of(turn["user"], tokens, f"{where}: turn {i} \"user\""), output))
    return Conversation(_tokens_of(record.get("system", 0), tokens, f"{where}: \"system\""), tuple(turns))


def _tokens_of(value: Any, tokens: _Tokens, where: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return tokens(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < tokens.vocab]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:3]} are outside the model's vocabulary of {tokens.vocab}")
        return tuple(value)
    raise ValueError(f"{where}: expected a list of token ids or a length, got {type(value).__name__}")


def prompt_of(conversation: Conversation, answers: Sequence[Sequence[int]], turn: int) -> list[int]:
    """Turn `turn`'s prompt: the system prompt, then every earlier turn's user message and answer, then its own."""
    prompt = list(conversation.system)
    for earlier, answer in zip(conversation.turns[:turn], answers):
        prompt += list(earlier.user) + list(answer)
    return prompt + list(conversation.turns[turn].user)
