"""Replay workloads: what each turn's prompt is, and trace files with a clear error per bad line."""

from __future__ import annotations

import json

import pytest

from lmcache_npu.tools.replay.workload import load_trace, multi_turn_chat, prefix_repetition, prompt_of


def test_a_turn_resends_the_system_prompt_and_the_whole_history():
    chats = multi_turn_chat(conversations=2, turns=3, system_tokens=5, user_tokens=3, output_tokens=2, vocab=100,
                            seed=4)
    assert chats[0].system == chats[1].system and chats[0].turns[0].user != chats[1].turns[0].user
    chat = chats[0]
    answers = [(1, 2), (3, 4)]
    assert prompt_of(chat, answers, 0) == list(chat.system + chat.turns[0].user)
    assert prompt_of(chat, answers, 2) == list(chat.system + chat.turns[0].user + (1, 2) + chat.turns[1].user
                                               + (3, 4) + chat.turns[2].user)
    assert all(10 <= t < 100 for t in chat.system)


def test_prefix_repetition_interleaves_shared_prefixes_with_distinct_suffixes():
    prompts = prefix_repetition(num_prefixes=2, prompts_per_prefix=3, prefix_tokens=8, suffix_tokens=4,
                                output_tokens=5, vocab=50)
    assert len(prompts) == 6 and prompts[0].system != prompts[1].system and prompts[0].system == prompts[2].system
    assert len({c.turns[0].user for c in prompts}) == 6 and all(c.turns[0].output_tokens == 5 for c in prompts)
    # sent in waves of one prompt per prefix: a prefix is stored by the time the next wave looks it up
    assert [c.start for c in prompts] == [0, 0, 1, 1, 2, 2]
    assert [c.turn_in(1) for c in prompts] == [None, None, 0, 0, None, None]


def test_a_trace_takes_token_ids_or_lengths(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"system": [11, 12], "turns": [{"user": 3, "output": 4}, {"user": [13]}]}) + "\n\n")
    (chat,) = load_trace(path, vocab=64)
    assert chat.system == (11, 12) and len(chat.turns[0].user) == 3 and chat.turns[0].output_tokens == 4
    assert chat.turns[1].user == (13,) and chat.turns[1].output_tokens == 64


@pytest.mark.parametrize("line, message", [
    ("not json", r"trace.jsonl:1: not JSON"),
    (json.dumps({"system": 3}), r"trace.jsonl:1: expected \{\"system\""),
    (json.dumps({"turns": [{"output": 3}]}), r"turn 0 needs a \"user\""),
    (json.dumps({"turns": [{"user": 2, "output": 0}]}), r"turn 0: \"output\" \(tokens\) must be an integer >= 1"),
    (json.dumps({"turns": [{"user": [5, 99]}]}), r"token ids \[99\] are outside the model's vocabulary of 64"),
    (json.dumps({"turns": [{"user": "hello"}]}), r"expected a list of token ids or a length, got str"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path, vocab=64)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no conversations"):
        load_trace(path, vocab=64)
