"""Serving scenarios through vLLM 0.23's Scheduler on three layouts: one group (Llama on Ascend), sliding window +
full (GPT-OSS on CUDA), and DeepSeek-V4 on Ascend (6 groups: compressed MLA c4/c128, two sliding-window groups,
compressor state). Every step checks the pages the next forward reads; every scenario ends with nothing leaked."""

from __future__ import annotations

import pytest

from lmcache_npu.ops import Direction

from .conftest import assert_quiescent, preset_engine, prompt
from .wrappers import Slow, Wrapped, wait_until, wrap

LAYOUTS = [("llama3-8b", "ascend"), ("gpt-oss-120b", "cuda"), ("deepseek-v4-flash", "ascend")]
IDS = ["one-group", "sliding+full", "deepseek-v4"]


def _chunk(engine) -> int:
    return engine.connector.scheduler_half.chunk_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_multi_turn_chat_hits_every_chunk_of_the_previous_turn(make_engine, preset, family, async_scheduling):
    engine = preset_engine(make_engine, preset, family, async_scheduling=async_scheduling)
    chunk = _chunk(engine)
    conversation = prompt(2 * chunk + 40, seed=1)
    computed = 0
    for turn in range(3):
        request_id = engine.add(conversation, max_tokens=chunk // 2 + 30, request_id=f"turn{turn}")
        engine.run()
        if turn:
            ceiling = (min(computed, len(conversation) - 1) // chunk) * chunk
            loaded = engine.loaded_tokens[request_id]
            if async_scheduling:  # a decode chunk's hash is known one step late: the very last one may be missed
                assert ceiling - chunk <= loaded <= ceiling
            else:
                assert loaded == ceiling
        history = conversation + engine.output_tokens(request_id)
        computed = len(history) - 1  # the last sampled token never went through a forward
        conversation = history + prompt(chunk // 3, seed=10 + turn)
    assert_quiescent(engine)


def test_decode_chunks_can_be_left_out(make_engine):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", extra_config={"store_decode_chunks": False})
    chunk = _chunk(engine)
    first = prompt(chunk + 40, seed=3)
    engine.add(first, max_tokens=chunk, request_id="a")
    engine.run()
    engine.add(first + engine.output_tokens("a") + prompt(20, seed=4), max_tokens=2, request_id="b")
    engine.run()
    assert engine.loaded_tokens["b"] == chunk  # the prompt's chunk only, not the one decode completed
    assert_quiescent(engine)


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_one_system_prompt_shared_by_many_requests(make_engine, preset, family, world):
    engine = preset_engine(make_engine, preset, family, world=world, num_blocks=700)
    chunk = _chunk(engine)
    system = prompt(2 * chunk + 10, seed=7)
    engine.add(system + prompt(50, seed=100), max_tokens=2, request_id="warm")
    engine.run()
    counted = wrap(engine, Wrapped, Direction.LOAD)
    users = [engine.add(system + prompt(60 + i, seed=200 + i), max_tokens=3) for i in range(5)]
    engine.run()
    assert [engine.loaded_tokens[u] for u in users] == [2 * chunk] * 5
    assert [c.calls[Direction.LOAD] for c in counted] == [1] * world  # one launch for the 10 chunks of 5 requests
    assert_quiescent(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_chunked_prefill_stores_every_chunk_across_steps(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family, max_num_batched_tokens=320, num_blocks=700)
    chunk = _chunk(engine)
    long = prompt(6 * chunk + 40, seed=11)
    engine.add(long, max_tokens=2, request_id="long")
    engine.run()
    assert engine.steps >= 6  # the prefill really was chunked
    engine.add(long + prompt(30, seed=12), max_tokens=2, request_id="again")
    engine.run()
    assert engine.loaded_tokens["again"] == 6 * chunk
    assert_quiescent(engine)


def test_prompt_shorter_than_a_chunk_stores_and_loads_nothing(make_engine):
    engine = preset_engine(make_engine, "gpt-oss-120b", "cuda")
    short = prompt(_chunk(engine) // 2, seed=13)
    engine.add(short, max_tokens=3, request_id="a")
    engine.run()
    engine.add(short, max_tokens=3, request_id="b")
    engine.run()
    assert "b" not in engine.loaded_tokens
    assert engine.connector.scheduler_half.index.counters["stores"] == 0
    assert_quiescent(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_a_full_prompt_hit_leaves_the_last_token_to_vllm(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family)
    chunk = _chunk(engine)
    exact = prompt(2 * chunk, seed=14)
    engine.add(exact, max_tokens=2, request_id="a")
    engine.run()
    engine.add(exact, max_tokens=2, request_id="same")  # every chunk is held, but vLLM must compute a token
    engine.add(exact + [42], max_tokens=2, request_id="one-more")
    engine.run()
    assert engine.loaded_tokens["same"] == chunk
    assert engine.loaded_tokens["one-more"] == 2 * chunk
    assert engine.output_tokens("same") == engine.output_tokens("a")
    assert_quiescent(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_a_request_finishing_before_its_save_lands_keeps_its_blocks(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family)
    chunk = _chunk(engine)
    (slow,) = wrap(engine, lambda b: Slow(b, Direction.STORE), Direction.STORE)
    text = prompt(2 * chunk + 30, seed=15)
    engine.add(text, max_tokens=1, request_id="quick")
    wait_until(lambda: "quick" not in engine.scheduler.running and slow.waiting.is_set(), engine.step)
    request = engine.scheduler.requests["quick"]  # finished, but vLLM keeps it for the connector
    assert request.is_finished()
    for _ in range(3):
        engine.step()
    assert "quick" in engine.scheduler.requests, "blocks freed while the store still reads them"
    slow.release.set()
    engine.run()
    assert "quick" not in engine.scheduler.requests
    engine.add(text + prompt(10, seed=16), max_tokens=2, request_id="next")
    engine.run()
    assert engine.loaded_tokens["next"] == 2 * chunk
    assert_quiescent(engine)


# blocks that admit three long requests but not their decode growth (found by trying; vLLM preempts the newest)
TIGHT = {"one-group": {"num_blocks": 20}, "sliding+full": {"num_blocks": 200},
         "deepseek-v4": {"num_blocks": 80, "max_num_batched_tokens": 256}}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preset,family,layout", [(*p, i) for p, i in zip(LAYOUTS, IDS)], ids=IDS)
def test_preemption_under_a_tight_block_budget(make_engine, preset, family, layout, async_scheduling):
    engine = preset_engine(make_engine, preset, family, async_scheduling=async_scheduling, **TIGHT[layout])
    chunk = _chunk(engine)
    shared = prompt(4 * chunk, seed=17)
    ids = [engine.add(shared + prompt(200 + 30 * i, seed=30 + i), max_tokens=chunk) for i in range(3)]
    engine.run(max_steps=5000)
    assert any(engine.requests[r].num_preemptions for r in ids), "the budget did not force a preemption"
    assert all(len(engine.output_tokens(r)) == chunk for r in ids)
    assert_quiescent(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS, ids=IDS)
def test_aborts_while_loading_and_while_storing(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family, num_blocks=700)
    chunk = _chunk(engine)
    text = prompt(2 * chunk + 20, seed=18)
    engine.add(text, max_tokens=2, request_id="seed")
    engine.run()
    (slow_load,) = wrap(engine, lambda b: Slow(b, Direction.LOAD), Direction.LOAD)
    engine.add(text + [9, 9, 9], max_tokens=4, request_id="loading")
    wait_until(slow_load.waiting.is_set, engine.step)
    engine.abort("loading")  # its load still writes the blocks: vLLM must not reuse them yet
    for _ in range(3):
        engine.step()
    assert "loading" in engine.scheduler.requests
    slow_load.release.set()
    engine.run()
    (slow_store,) = wrap(engine, lambda b: Slow(b, Direction.STORE), Direction.STORE)
    engine.add(prompt(3 * chunk, seed=19), max_tokens=50, request_id="storing")
    wait_until(slow_store.waiting.is_set, engine.step)
    engine.abort("storing")
    for _ in range(3):
        engine.step()
    assert "storing" in engine.scheduler.requests
    slow_store.release.set()
    engine.run()
    assert_quiescent(engine)
