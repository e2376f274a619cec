"""The two-engine round robin's pure parts: which engine serves which turn, a wave's split, the driver's waves over
engines that answer without vLLM (each answer must reach the conversation's next prompt on the other engine), and
the clock on the connector's hooks."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
from hypothesis import given, strategies as st

from lmcache_npu.tools.replay.accounting import PluginHits, split_hits
from lmcache_npu.tools.replay.engine import Completion
from lmcache_npu.tools.replay.pair import STEP_HOOK, EngineWave, HookClock, engine_for, run_round_robin, split_wave
from lmcache_npu.tools.replay.workload import multi_turn_chat, prompt_of, unique_prompts


def alternates(assign: Callable[[int, int, int], int], conversations: int, turns: int, engines: int) -> bool:
    """Whether every conversation's consecutive turns go to different engines and each wave uses every engine
    (when it has at least as many conversations as there are engines)."""
    for c in range(conversations):
        if any(assign(c, k, engines) == assign(c, k + 1, engines) for k in range(turns - 1)):
            return False
    return all(len({assign(c, k, engines) for c in range(conversations)}) == min(engines, conversations)
               for k in range(turns))


@given(st.integers(1, 12), st.integers(1, 6))
def test_turn_k_of_conversation_c_goes_to_engine_c_plus_k_mod_2(conversations: int, turns: int) -> None:
    assert all(engine_for(c, k, 2) == (c + k) % 2 for c in range(conversations) for k in range(turns))
    assert alternates(engine_for, conversations, turns, 2)


def test_negative_control_a_sticky_router_does_not_alternate() -> None:
    sticky = lambda conversation, turn, engines: conversation % engines  # noqa: E731 (each conversation stays put)
    assert not alternates(sticky, 4, 3, 2)
    assert alternates(engine_for, 4, 3, 2)


def test_a_round_robin_needs_an_engine_and_counts_from_zero() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        engine_for(0, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        engine_for(-1, 0, 2)


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 5)), max_size=30), st.integers(1, 4))
def test_a_wave_splits_into_every_position_once_in_order(sending: list[tuple[int, int]], engines: int) -> None:
    shares = split_wave(sending, engines)
    assert sorted(p for share in shares for p in share) == list(range(len(sending)))
    for index, share in enumerate(shares):
        assert share == sorted(share)
        assert all(engine_for(*sending[p], engines) == index for p in share)


class AnsweringEngine:
    """Stands for an engine process: answers each prompt with tokens that name this engine and the prompt's length,
    and records what it was sent."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.received: list[list[list[int]]] = []
        self._pending: list[tuple[list[list[int]], list[int]]] = []

    def send_wave(self, prompts: Sequence[Sequence[int]], outputs: Sequence[int]) -> None:
        self._pending.append(([list(p) for p in prompts], list(outputs)))
        self.received.append([list(p) for p in prompts])

    def wave_result(self) -> EngineWave:
        prompts, outputs = self._pending.pop(0)
        completions = tuple(Completion(len(p), tuple([1000 + self.number, len(p)] + [7] * (n - 2)), (), 0, 0.01)
                            for p, n in zip(prompts, outputs))
        hits = split_hits(sum(len(p) for p in prompts), 0, PluginHits())
        return EngineWave(completions, hits, 0.02, 0.001 * len(prompts), len(prompts), 2 * len(prompts))


def test_the_driver_sends_each_turn_to_its_engine_and_the_answer_into_the_next_prompt_elsewhere() -> None:
    chats = multi_turn_chat(conversations=3, turns=3, system_tokens=6, user_tokens=3, output_tokens=4, vocab=300)
    engines = [AnsweringEngine(0), AnsweringEngine(1)]
    run = run_round_robin(engines, chats)
    assert [t.conversations for t in run.turns] == [(0, 1, 2)] * 3
    answers: list[list[tuple[int, ...]]] = [[] for _ in chats]
    for wave, turn in enumerate(run.turns):
        expected: list[list[list[int]]] = [[], []]
        for c in range(len(chats)):
            expected[engine_for(c, wave, 2)].append(prompt_of(chats[c], answers[c], wave))
        assert [e.received[wave] if wave < len(e.received) else [] for e in engines] == expected
        for c, completion in zip(turn.conversations, turn.completions):
            assert completion.token_ids[0] == 1000 + engine_for(c, wave, 2)  # answered by its engine
            answers[c].append(completion.token_ids)
    # conversation 0's second turn ran on engine 1 and re-sent what engine 0 answered (the cross-engine history)
    first_answer = run.turns[0].completions[0].token_ids
    assert first_answer[0] == 1000 and engines[1].received[1][0][-3 - len(first_answer):-3] == list(first_answer)
    assert run.connector() == (pytest.approx(0.009), 9, 18) and run.hits().prompt_tokens == sum(
        len(p) for e in engines for wave in e.received for p in wave)


def test_negative_control_a_driver_that_drops_the_other_engines_answer_is_seen() -> None:
    chats = multi_turn_chat(conversations=2, turns=2, system_tokens=6, user_tokens=3, output_tokens=4, vocab=300)
    engines = [AnsweringEngine(0), AnsweringEngine(1)]
    run = run_round_robin(engines, chats)
    wrong = prompt_of(chats[0], [run.turns[0].completions[1].token_ids], 1)  # conversation 1's answer instead
    assert engines[1].received[1][0] != wrong
    assert engines[1].received[1][0] == prompt_of(chats[0], [run.turns[0].completions[0].token_ids], 1)


def test_an_engine_without_a_request_in_a_wave_is_not_sent_one() -> None:
    one = unique_prompts(waves=2, per_wave=1, prompt_tokens=5, output_tokens=3, vocab=300)
    engines = [AnsweringEngine(0), AnsweringEngine(1)]
    run = run_round_robin(engines, one)
    # conversation 0 in wave 0 and conversation 1 in wave 1: both turn 0, so engines 0 and 1
    assert [len(e.received) for e in engines] == [1, 1]
    assert run.shares[0][1] is None and run.shares[1][0] is None


class Hooks:
    def build_connector_meta(self, output: int) -> int:
        return output + 1

    def get_num_new_matched_tokens(self, request: str) -> str:
        if request == "bad":
            raise KeyError(request)
        return request * 2

    not_callable = 3


def test_the_hook_clock_counts_calls_and_passes_results_and_errors_through() -> None:
    hooks = Hooks()
    clock = HookClock()
    wrapped = clock.wrap(hooks, [STEP_HOOK, "get_num_new_matched_tokens", "absent", "not_callable"])
    assert wrapped == [STEP_HOOK, "get_num_new_matched_tokens"]
    assert [hooks.build_connector_meta(i) for i in range(3)] == [1, 2, 3]
    assert hooks.get_num_new_matched_tokens("ab") == "abab"
    with pytest.raises(KeyError):
        hooks.get_num_new_matched_tokens("bad")
    seconds, steps, lookups = clock.total()
    assert (steps, lookups) == (3, 2) and clock.calls == {STEP_HOOK: 3, "get_num_new_matched_tokens": 2}
    assert seconds == sum(clock.seconds.values()) and all(v >= 0 for v in clock.seconds.values())
    other = Hooks()  # negative control: an instance the clock did not wrap counts nothing
    other.build_connector_meta(1)
    assert clock.total()[1] == 3
