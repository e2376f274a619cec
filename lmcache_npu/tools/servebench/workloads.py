"""The three workloads of a serving sweep as `vllm bench serve` datasets: vLLM's `prefix_repetition`, the replay's
multi-turn chat written as a `timed_trace` file, and `random` (no reuse at all), also a `timed_trace` of hash ids
used once: vLLM's own `random` dataset makes each prompt a run of consecutive token ids from a random start, so with
a small vocabulary (gemma3-demo's 2048) two prompts often start alike and hit (about one point in four, measured).

The chat trace names blocks of `BLOCK` tokens by hash id (vLLM expands each id to the same random tokens every
time): turn n of a conversation re-sends the shared system prompt, every earlier user message and answer, then its
own message. An answer is the trace's tokens, not the model's (a static dataset cannot feed answers back), so a
next turn reuses the earlier prompt and re-computes the answer's few tokens. The requests go wave by wave (every
conversation's turn 1, then turn 2, ...), so under a concurrency cap a turn usually follows its predecessor.
Each point of a sweep draws new tokens (its own seed or hash ids), so a point never hits an earlier point's cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..replay.sizing import longest_request_tokens, working_set_tokens
from ..replay.workload import FIRST_TOKEN, Conversation, Turn, multi_turn_chat, prefix_repetition

BLOCK = 16  # timed_trace's tokens per hash id (its --timed-trace-chunk-hash-size default)
POINT_IDS = 1_000_000  # hash ids one point may use: point k's ids start at (k + 1) * POINT_IDS
RANDOM_IDS = 1_000_000_000  # random's ids start here, far above any chat point's: the two never share a block
MAX_POINT = 998  # the highest point index, so no workload's ids reach another's
WORKLOADS = ("prefix_repetition", "chat", "random")


def _blocks(tokens: int, what: str) -> int:
    if tokens < 0 or tokens % BLOCK:
        raise ValueError(f"{what} must be a non-negative multiple of {BLOCK} tokens (the trace's block), got {tokens}")
    return tokens // BLOCK


@dataclass(frozen=True)
class ChatShape:
    """The replay's chat: `conversations` x `turns` after one shared system prompt."""

    # 16 conversations of 3 turns after a 128-token system prompt: a working set (3968 tokens) over 10 times the
    # longest request (368), so `--working-set-ratio 4` can hold; 48 requests give a p99
    conversations: int = 16
    turns: int = 3
    system_tokens: int = 128
    user_tokens: int = 64
    output_tokens: int = 16

    def conversations_for_sizing(self, vocab: int) -> list[Conversation]:
        return multi_turn_chat(self.conversations, self.turns, self.system_tokens, self.user_tokens,
                               self.output_tokens, vocab)

    def trace_lines(self, point: int) -> list[dict[str, object]]:
        """One timed_trace record per request, wave by wave; hash ids unique to `point`."""
        if self.conversations < 1 or self.turns < 1:
            raise ValueError(f"chat needs >= 1 conversation and turn, got {self.conversations} x {self.turns}")
        if not 0 <= point <= MAX_POINT:
            raise ValueError(f"a chat point must be in 0..{MAX_POINT} (its hash ids stay below random's), got {point}")
        system, user, answer = (_blocks(self.system_tokens, "--chat-system-tokens"),
                                _blocks(self.user_tokens, "--chat-user-tokens"),
                                _blocks(self.output_tokens, "--chat-output-tokens"))
        if user < 1 or answer < 1:
            raise ValueError(f"chat turns need a user message and an answer of >= {BLOCK} tokens")
        next_id = (point + 1) * POINT_IDS
        system_ids = list(range(next_id, next_id + system))
        next_id += system
        histories = [list(system_ids) for _ in range(self.conversations)]
        lines = []
        for turn in range(self.turns):
            for history in histories:
                history += range(next_id, next_id + user)
                next_id += user
                lines.append({"timestamp": float(len(lines)), "input_length": len(history) * BLOCK,
                              "output_length": self.output_tokens, "hash_ids": list(history)})
                history += range(next_id, next_id + answer)  # what the next turn re-sends as this turn's answer
                next_id += answer
        if next_id >= (point + 2) * POINT_IDS:
            raise ValueError(f"a chat of {len(lines)} requests needs more than {POINT_IDS} hash ids per point")
        return lines


@dataclass(frozen=True)
class PrefixShape:
    """vLLM's prefix_repetition: `num_prompts` prompts over `num_prefixes` shared prefixes."""

    # 8 prefixes of 256 tokens (two 128-token chunks), 4 prompts each: working set 3584 tokens, the longest 304
    num_prompts: int = 32
    num_prefixes: int = 8
    prefix_tokens: int = 256
    suffix_tokens: int = 32
    output_tokens: int = 16

    def conversations_for_sizing(self, vocab: int) -> list[Conversation]:
        if self.num_prompts < self.num_prefixes:
            raise ValueError(f"prefix_repetition needs --num-prompts >= its prefixes, got {self.num_prompts} < "
                             f"{self.num_prefixes}")
        return prefix_repetition(self.num_prefixes, self.num_prompts // self.num_prefixes, self.prefix_tokens,
                                 self.suffix_tokens, self.output_tokens, vocab)


@dataclass(frozen=True)
class RandomShape:
    """`num_prompts` prompts of fresh tokens, nothing shared: each a run of hash ids no other request uses."""

    # 32 prompts per pace for a p99; 256 tokens hold two of the CPU backend's 128-token chunks, so the plugin
    # looks up and stores on every request as it would on longer ones
    num_prompts: int = 32
    input_tokens: int = 256
    output_tokens: int = 16

    def trace_lines(self, point: int) -> list[dict[str, object]]:
        """One timed_trace record per prompt, every hash id new (unique to `point` and to this workload)."""
        if self.num_prompts < 1 or self.output_tokens < 1:
            raise ValueError(f"random needs >= 1 prompt and output token, got {self.num_prompts} and "
                             f"{self.output_tokens}")
        blocks = _blocks(self.input_tokens, "--random-input-len")
        if blocks < 1 or not 0 <= point <= MAX_POINT:
            raise ValueError(f"random needs a prompt of >= {BLOCK} tokens and a point in 0..{MAX_POINT}, got "
                             f"{self.input_tokens} tokens at point {point}")
        if self.num_prompts * blocks > POINT_IDS:
            raise ValueError(f"random's {self.num_prompts} x {blocks} blocks exceed the {POINT_IDS} hash ids of a "
                             f"point")
        first = RANDOM_IDS + point * POINT_IDS
        return [{"timestamp": float(i), "input_length": self.input_tokens, "output_length": self.output_tokens,
                 "hash_ids": list(range(first + i * blocks, first + (i + 1) * blocks))}
                for i in range(self.num_prompts)]


@dataclass(frozen=True)
class Workloads:
    """The shapes of the three workloads; `dataset(name, point, scratch)` gives one point's bench arguments."""

    chat: ChatShape = ChatShape()
    prefix: PrefixShape = PrefixShape()
    random: RandomShape = RandomShape()

    def dataset(self, name: str, point: int, scratch: Path) -> tuple[tuple[str, ...], int]:
        """(`vllm bench serve` dataset arguments, number of prompts) of workload `name` at sweep point `point`."""
        if name == "prefix_repetition":
            p = self.prefix
            return (("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(p.prefix_tokens),
                     "--prefix-repetition-suffix-len", str(p.suffix_tokens), "--prefix-repetition-num-prefixes",
                     str(p.num_prefixes), "--prefix-repetition-output-len", str(p.output_tokens)), p.num_prompts)
        if name == "chat":
            lines = self.chat.trace_lines(point)
            path = scratch / f"chat-trace-{point}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            return (("--dataset-name", "timed_trace", "--dataset-path", str(path), "--no-self-timed",
                     "--timed-trace-chunk-hash-size", str(BLOCK)), len(lines))
        if name == "random":
            lines = self.random.trace_lines(point)
            path = scratch / f"random-trace-{point}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            return (("--dataset-name", "timed_trace", "--dataset-path", str(path), "--no-self-timed",
                     "--timed-trace-chunk-hash-size", str(BLOCK)), len(lines))
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")

    def largest_conversations(self, names: Sequence[str], vocab: int) -> list[Conversation]:
        """The reusing workload (of `names`) with the largest working set, as conversations (the replay's sizing
        takes them); [] when only `random` runs."""
        candidates = []
        if "chat" in names:
            candidates.append(self.chat.conversations_for_sizing(vocab))
        if "prefix_repetition" in names:
            candidates.append(self.prefix.conversations_for_sizing(vocab))
        if not candidates:  # random alone: one request is all a cache could hold of it
            r = self.random
            return [Conversation((), (Turn(tuple([FIRST_TOKEN] * r.input_tokens), r.output_tokens),))]
        return max(candidates, key=working_set_tokens)

    def sizing(self, names: Sequence[str], vocab: int) -> tuple[int, int]:
        """(the largest working set, the longest request) in tokens over the workloads `names`."""
        working, longest = 0, 0
        for name in names:
            if name == "chat":
                conversations = self.chat.conversations_for_sizing(vocab)
            elif name == "prefix_repetition":
                conversations = self.prefix.conversations_for_sizing(vocab)
            elif name == "random":
                longest = max(longest, self.random.input_tokens + self.random.output_tokens)
                continue
            else:
                raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
            working = max(working, working_set_tokens(conversations))
            longest = max(longest, longest_request_tokens(conversations))
        return working, longest
