"""Serving scenarios on a real engine, each against the same workload computed without the plugin: multi-turn
chat, one system prompt shared by many requests, preemption under a small KV cache, a load that fails (vLLM
recomputes), and two engines sharing one Mooncake store or one disk directory across a restart."""

from __future__ import annotations

import os

import pytest

from lmcache_npu.ops import Direction
from lmcache_npu.tools.replay.models import VOCAB
from lmcache_npu.tools.replay.runner import run_workload
from lmcache_npu.tools.replay.workload import multi_turn_chat, prefix_repetition

from ..integration.wrappers import Failing
from .compare import assert_identical, prompt
from .rows import RowRecorder, assert_same_prefix_rows
from .conftest import ENGINE_VLLM

ARENA = {"cpu_bytes": "256MiB"}


def _reference(engines, recipe, model_dir, workload, **settings):
    """The workload's completions without the plugin (the engine is shut down before the caller builds its own)."""
    engine = engines(recipe, model_dir, plugin=False, **settings)
    runs = run_workload(engine, workload, logprobs=5)
    engine.close()
    return runs


def _assert_runs_identical(reference, runs, dtype: str) -> None:
    for expected, got in zip(reference, runs, strict=True):
        assert_identical(expected.completions, got.completions, dtype)


def test_multi_turn_chat_loads_each_turns_history(engines, model_dirs) -> None:
    recipe, model_dir = "gemma3", model_dirs("gemma3")
    chats = multi_turn_chat(conversations=3, turns=3, system_tokens=300, user_tokens=120, output_tokens=40,
                            vocab=VOCAB, seed=1)
    reference = _reference(engines, recipe, model_dir, chats)
    engine = engines(recipe, model_dir, extra_config=ARENA)
    runs = run_workload(engine, chats, logprobs=5)
    _assert_runs_identical(reference, runs, engine.settings.dtype)
    chunk = 256
    # turn 1 computes the system prompt once per conversation (concurrently: no chunk is stored yet)
    assert [c.cached_tokens for c in runs[0].completions] == [0, 0, 0]
    for turn in runs[1:]:
        for done in turn.completions:  # the previous turn's prompt and answer, whole chunks of it, are loaded
            previous = done.prompt_tokens - 120 - 0
            assert done.cached_tokens >= (previous - 40 - 1) // chunk * chunk > 0


def test_one_system_prompt_shared_by_many_requests(engines, model_dirs) -> None:
    recipe, model_dir = "gpt-oss", model_dirs("gpt-oss")
    first = prefix_repetition(num_prefixes=1, prompts_per_prefix=1, prefix_tokens=800, suffix_tokens=60,
                              output_tokens=24, vocab=VOCAB, seed=2)
    rest = prefix_repetition(num_prefixes=1, prompts_per_prefix=6, prefix_tokens=800, suffix_tokens=60,
                             output_tokens=24, vocab=VOCAB, seed=2)[1:]
    reference = _reference(engines, recipe, model_dir, first + rest)
    engine = engines(recipe, model_dir, extra_config=ARENA)
    rows = RowRecorder(engine)
    opened = run_workload(engine, first, logprobs=5)  # stores the system prompt
    runs = run_workload(engine, rest, logprobs=5)  # one request per wave

    def flat(turns):
        return [c for turn in turns for c in turn.completions]

    assert [c.cached_tokens for c in flat(runs)] == [768] * 5  # 800 tokens: three whole chunks
    writer, *readers = rows.finished
    assert len(readers) == 5
    for reader in readers:  # the loaded system prompt holds exactly the rows the first request computed
        assert_same_prefix_rows(writer, reader, 768)
    assert_identical(flat(reference), flat(opened) + flat(runs), engine.settings.dtype)


def test_preemption_under_a_small_kv_cache(engines, model_dirs) -> None:
    """8 MiB of KV cache hold 32 blocks of 128 tokens, 31 usable (vLLM keeps a null block). Prompts of 1270 tokens
    take 10 blocks each, so three are admitted; when their decodes cross token 1280 each needs an eleventh block,
    and one is preempted. The plugin's loads, stores and delayed frees keep every answer identical."""
    recipe, model_dir = "llama", model_dirs("llama")
    prompts = [prompt(1270, 100 + i) for i in range(6)]
    reference = engines(recipe, model_dir, plugin=False)
    expected = reference.generate(prompts, 48, logprobs=5)
    reference.close()
    engine = engines(recipe, model_dir, extra_config=ARENA, kv_cache_memory_bytes=8 << 20, max_model_len=2048)
    before = engine.vllm_counter("vllm:num_preemptions")  # vLLM < 0.30 does not count them per request
    first = engine.generate(prompts, 48, logprobs=5)
    again = engine.generate(prompts, 48, logprobs=5)
    assert engine.vllm_counter("vllm:num_preemptions") > before, "the KV cache was large enough: nothing was preempted"
    assert_identical(expected, first, engine.settings.dtype)
    assert_identical(expected, again, engine.settings.dtype)
    assert sum(c.cached_tokens for c in again) >= 6 * 1024  # the four whole chunks of every prompt come back


@pytest.mark.parametrize("recipe", ["llama", "gemma3"])
def test_a_failed_load_is_recomputed_with_identical_tokens(engines, model_dirs, recipe) -> None:
    model_dir = model_dirs(recipe)
    engine = engines(recipe, model_dir, extra_config=ARENA)
    half = engine.scheduler_connector.scheduler_half
    several_groups = half.num_scheduler_groups > 1
    if ENGINE_VLLM < (0, 30) and several_groups:
        pytest.skip("vLLM < 0.30 cannot be told a load of several KV-cache groups failed (the connector stops the "
                    "engine instead: tests/integration/test_faults.py)")
    prompts = [prompt(700, 200 + i) for i in range(3)]
    cold = engine.generate(prompts, 32, logprobs=5)
    worker = engine.worker_connector.worker_half
    failing = Failing(worker.mover.backends[Direction.LOAD])
    worker.mover.set_backend(Direction.LOAD, failing)
    recomputed = engine.generate(prompts, 32, logprobs=5)
    assert failing.failures >= 1
    assert_identical(cold, recomputed, engine.settings.dtype)
    assert all(c.cached_tokens == 0 or not several_groups for c in recomputed)


def test_tensor_parallel_ranks_each_load_their_heads(engines, model_dirs, monkeypatch) -> None:
    """TP=2 on the CPU engine: two worker processes, each with its own arena and half the KV heads; one core each
    (vLLM's CPU workers bind threads per NUMA node, and this machine has one)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    recipe, model_dir = "llama", model_dirs("llama")
    engine = engines(recipe, model_dir, extra_config=ARENA,
                     engine_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    chunk = engine.scheduler_connector.scheduler_half.chunk_tokens
    prompts = [prompt(700, 400 + i) for i in range(2)]
    cold = engine.generate(prompts, 32, logprobs=5)
    warm = engine.generate(prompts, 32, logprobs=5)
    assert [c.cached_tokens for c in cold] == [0, 0]
    assert [c.cached_tokens for c in warm] == [699 // chunk * chunk] * 2
    assert_identical(cold, warm, engine.settings.dtype)
