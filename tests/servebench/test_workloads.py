"""The chat trace re-sends each conversation's history (so a turn can reuse its predecessor's prompt), shares the
system prompt, never shares a block between two sweep points, and refuses lengths that are not whole blocks; the
word tokenizer gives back exactly the ids it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.tools.servebench.workloads import BLOCK, ChatShape, PrefixShape, RandomShape, Workloads

SHAPE = ChatShape(conversations=3, turns=3, system_tokens=64, user_tokens=32, output_tokens=16)


def test_each_turn_extends_its_conversations_previous_prompt() -> None:
    lines = SHAPE.trace_lines(0)
    assert len(lines) == 9
    for line in lines:
        assert line["input_length"] == BLOCK * len(line["hash_ids"])  # type: ignore[arg-type]
    by_conversation = [lines[c::3] for c in range(3)]  # wave by wave: turn t of conversation c is line 3t + c
    for turns in by_conversation:
        for earlier, later in zip(turns, turns[1:]):
            previous, now = earlier["hash_ids"], later["hash_ids"]
            assert now[:len(previous)] == previous  # type: ignore[index]
            assert len(now) == len(previous) + (16 + 32) // BLOCK  # type: ignore[arg-type]
    systems = {tuple(turns[0]["hash_ids"][:4]) for turns in by_conversation}  # type: ignore[index]
    assert len(systems) == 1
    firsts = [set(turns[0]["hash_ids"][4:]) for turns in by_conversation]  # type: ignore[index]
    assert not firsts[0] & firsts[1]


def test_points_share_no_block() -> None:
    ids = [{i for line in SHAPE.trace_lines(point) for i in line["hash_ids"]} for point in range(3)]  # type: ignore
    assert not ids[0] & ids[1] and not ids[1] & ids[2]
    assert SHAPE.trace_lines(1) == SHAPE.trace_lines(1)  # the same point is the same trace in every configuration


@pytest.mark.parametrize("shape", [ChatShape(system_tokens=100), ChatShape(user_tokens=0), ChatShape(turns=0)])
def test_bad_shapes_are_refused(shape: ChatShape) -> None:
    with pytest.raises(ValueError):
        shape.trace_lines(0)


def test_dataset_arguments(tmp_path: Path) -> None:
    workloads = Workloads(SHAPE, PrefixShape(num_prompts=8, num_prefixes=2), RandomShape(num_prompts=5))
    args, prompts = workloads.dataset("chat", 2, tmp_path)
    assert prompts == 9 and args[args.index("--dataset-name") + 1] == "timed_trace"
    assert (tmp_path / "chat-trace-2.jsonl").read_text().count("\n") == 9
    assert workloads.dataset("random", 0, tmp_path)[1] == 5
    assert "--prefix-repetition-num-prefixes" in workloads.dataset("prefix_repetition", 0, tmp_path)[0]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.dataset("sharegpt", 0, tmp_path)


def test_sizing_takes_the_largest_working_set() -> None:
    workloads = Workloads(SHAPE, PrefixShape(num_prompts=8, num_prefixes=2, prefix_tokens=1024, suffix_tokens=64,
                                             output_tokens=32), RandomShape(num_prompts=16, input_tokens=512,
                                                                            output_tokens=32))
    working, longest = workloads.sizing(["chat", "prefix_repetition", "random"], 2048)
    assert working == 2 * 1024 + 8 * (64 + 32)  # the prefixes once, every suffix and answer
    assert longest == max(1024 + 64 + 32, 512 + 32, 64 + 3 * (32 + 16))
    assert len(workloads.largest_conversations(["random"], 2048)) == 1


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(4, 2047), min_size=1, max_size=64))
def test_the_word_tokenizer_round_trips(ids: list[int]) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from lmcache_npu.tools.servebench.tokenizer import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(2048)))
    text = tokenizer.decode(ids)
    assert tokenizer(text).input_ids == ids
    assert tokenizer(text.replace(f"t{ids[0]}", f"t{ids[0] ^ 1}", 1)).input_ids != ids  # negative control


def test_the_default_sweep_keeps_the_offload_regime() -> None:
    from lmcache_npu.tools.replay.sizing import kv_memory_for, working_set_tokens

    workloads, names = Workloads(), ("prefix_repetition", "chat", "random")
    largest, longest = workloads.sizing(names, 2048)
    max_model_len = -(-longest // 256) * 256  # what bench-serve gives vLLM
    device = kv_memory_for(workloads.largest_conversations(names, 2048), 4.0, 1, max_model_len)
    # both reusing workloads outgrow the device KV several times over, not only the largest
    for conversations in (workloads.chat.conversations_for_sizing(2048),
                          workloads.prefix.conversations_for_sizing(2048)):
        assert working_set_tokens(conversations) >= 3 * device
    assert largest >= 4 * device - 256  # the device rounds up to whole 256-token blocks
    # negative control: the previous defaults' longer requests forced a device too large for the regime
    old = Workloads(ChatShape(8, 4, 512, 128, 32), PrefixShape(16, 4, 1024, 64, 32), RandomShape(16, 512, 32))
    old_longest = old.sizing(names, 2048)[1]
    old_device = kv_memory_for(old.largest_conversations(names, 2048), 4.0, 1, -(-old_longest // 256) * 256)
    assert working_set_tokens(old.chat.conversations_for_sizing(2048)) < 3 * old_device


def test_random_prompts_share_no_block_within_or_across_points_or_with_chat(tmp_path: Path) -> None:
    shape = RandomShape(num_prompts=6, input_tokens=64, output_tokens=16)
    points = [shape.trace_lines(p) for p in (0, 1, 998)]
    ids = [i for lines in points for line in lines for i in line["hash_ids"]]  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids)) == 3 * 6 * 4
    chat = {i for p in (0, 1, 998) for line in ChatShape(2, 2, 32, 16, 16).trace_lines(p)
            for i in line["hash_ids"]}  # type: ignore[attr-defined]
    assert not chat & set(ids)
    assert all(line["input_length"] == 64 and line["output_length"] == 16 for line in points[0])
    args, prompts = Workloads(random=shape).dataset("random", 1, tmp_path)
    assert prompts == 6 and args[args.index("--dataset-name") + 1] == "timed_trace"
    written = [json.loads(line) for line in Path(args[args.index("--dataset-path") + 1]).read_text().splitlines()]
    assert written == points[1]
    # negative control: the same point twice is the same prompts (what a configuration must see as every other)
    assert shape.trace_lines(1) == points[1]


@pytest.mark.parametrize("shape,point,message", [
    (RandomShape(input_tokens=40), 0, "multiple of 16"),
    (RandomShape(input_tokens=0), 0, "prompt of >= 16 tokens"),
    (RandomShape(), 999, "point in 0..998"),
    (RandomShape(num_prompts=0), 0, ">= 1 prompt"),
])
def test_random_refuses_what_it_cannot_write(shape: RandomShape, point: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shape.trace_lines(point)
