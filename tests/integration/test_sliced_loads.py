"""Sliced loads (issue 41) through vLLM's real scheduler (the light 0.23 install) and the worker half, with the
simulated forward announcing its attention layers as vLLM's decorator does: a hit loaded sliced is scheduled in the
step that admits it (vLLM was told `load_kv_async=False`), every row any forward reads is checked against the model
before that forward runs, on single-group, MLA and hybrid layouts (sliding window, DeepSeek-V4's compressed groups,
Gated DeltaNet states in slice 0); a failed sliced load is recomputed; and a layer that runs without waiting for its
slice is caught by the guard, with the control that shows such a layer would have read rows that had not landed."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_npu.ops import Direction
from lmcache_npu.integration.vllm import sliced_loads

from .conftest import assert_quiescent, preset_engine, prefix_is_loaded_exactly, prompt
from .wrappers import Failing, LateSlices, Slow, wrap

SLICED = {"load_mode": "sliced"}


@pytest.mark.parametrize("preset,layers", [("llama3-8b", 8), ("deepseek-v3", 6), ("gemma3-27b", 6),
                                           ("gpt-oss-120b", 4), ("qwen3-next-80b", 4), ("deepseek-v4-flash", 6)])
def test_a_sliced_hit_reads_exactly_the_stored_rows(make_engine, preset, layers):
    engine = preset_engine(make_engine, preset, "ascend", max_layers=layers, extra_config=SLICED)
    prefix_is_loaded_exactly(engine)
    assert engine.stats.data["sliced_loads"] == 1
    assert "sliced_load_failures" not in engine.stats.data
    worker = engine.workers[0].worker_half
    assert worker.hooks.learned
    plan = worker.sliced.plan(worker.hooks.order)
    assert len(plan) == min(4, len(worker.hooks.order))  # load_slices' default, at most one per announced layer


def _steps_to_first_token(engine: Any, mode: str) -> int:
    """Steps from the moment a hit request is added until it has its first token."""
    text = prompt(600, seed=3)
    engine.add(text, max_tokens=2, request_id=f"{mode}-cold")
    engine.run()
    engine.evict_device_cache()
    request_id = engine.add(text + [7], max_tokens=2, request_id=f"{mode}-warm")
    for steps in range(1, 50):
        engine.step()
        if engine.output_tokens(request_id):
            engine.run()
            return steps
    raise AssertionError("the hit request never produced a token")


@pytest.mark.parametrize("mode", ["sliced", "async"])
def test_a_sliced_hit_computes_in_the_step_that_admits_it(make_engine, mode):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", max_layers=4, extra_config={"load_mode": mode})
    steps = _steps_to_first_token(engine, mode)
    assert engine.loaded_tokens[f"{mode}-warm"] == 512
    if mode == "sliced":
        assert steps == 1  # admitted, loaded into its own forward, sampled: one step
    else:
        assert steps >= 2  # the control: an async hit sits out at least the step that loads it
    assert_quiescent(engine)


def test_a_failed_sliced_load_is_recomputed_before_its_token_is_used(make_engine):
    """The lane's transfer fails (twice: the retry too): the worker names the request's blocks as invalid in this
    step's output, vLLM drops the step's token and recomputes them; every later forward reads right rows."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", max_layers=4, extra_config=SLICED)
    first = prompt(600, seed=5)
    engine.add(first, max_tokens=2, request_id="cold")
    engine.run()
    engine.evict_device_cache()
    (failing,) = wrap(engine, lambda b: Failing(b, times=2), Direction.LOAD)
    engine.add(first + [9], max_tokens=3, request_id="warm")
    engine.run()  # every step's rows are checked before its forward: a recompute that missed a row fails here
    assert failing.failures == 2
    assert engine.stats.data["sliced_load_failures"] == 1
    assert len(engine.output_tokens("warm")) == 3
    assert_quiescent(engine)


def _skipping_engine(make_engine: Any, check_every_step: bool, every_layer: bool = False) -> tuple[Any, LateSlices]:
    """Sliced loads whose later slices land 0.3 s late, and a forward whose last layer (`every_layer`: every layer, as
    a replayed FULL CUDA graph) stops announcing itself once the hook map has learned it (vllm-ascend's MLA skips its
    hook on some steps)."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", max_layers=4, extra_config=SLICED,
                           check_every_step=check_every_step)
    (late,) = wrap(engine, lambda b: LateSlices(b, engine.workers[0].worker_half.layout.plan, 0.3), Direction.LOAD)
    text = prompt(600, seed=11)
    engine.add(text, max_tokens=2, request_id="cold")
    engine.run()  # the hook map learns every layer here
    engine.evict_device_cache()
    engine.spec.skip_hooks = frozenset(engine.hook_layers[0] if every_layer else engine.hook_layers[0][-1:])
    engine.spec.skip_hooks_from = engine.forwards
    engine.add(text + [4], max_tokens=3, request_id="warm")
    return engine, late


def test_a_layer_that_skips_its_hook_would_read_rows_that_have_not_landed(make_engine):
    """The control: the rows the forward reads are checked before it runs; with the last layer's hook skipped, its
    slice has not landed then, and the check sees it. This is what the guard must answer for."""
    engine, _ = _skipping_engine(make_engine, check_every_step=True)
    with pytest.raises(AssertionError):
        engine.run()


def _recomputed_from(engine: Any, request_id: str) -> list[int]:
    """The first token of each forward the simulated model ran for `request_id` (spied below)."""
    return [start for rid, start in engine.forward_starts if rid == request_id]


def _spy_forwards(engine: Any) -> None:
    engine.forward_starts = []
    sim = engine.sims[0]
    forward = sim.forward

    def spied(hashes, tables, start, end):
        rid = next(r for r, t in engine.runners[0].tables.items() if t is tables)
        engine.forward_starts.append((rid, start))
        return forward(hashes, tables, start, end)

    sim.forward = spied


@pytest.mark.parametrize("guard", [True, False])
def test_the_guard_recomputes_a_load_a_layer_may_have_read_before_it_landed(make_engine, monkeypatch, guard):
    if not guard:  # the control: without the guard the step's token stands on rows that had not landed
        monkeypatch.setattr(sliced_loads.SlicedLoads, "end_forward",
                            lambda self, announced_now: (setattr(self, "step", None), None)[1])
    engine, _ = _skipping_engine(make_engine, check_every_step=False)
    _spy_forwards(engine)
    engine.run()
    starts = _recomputed_from(engine, "warm")
    assert starts[0] == 512  # admitted with the hit: the first forward computes from its end
    if guard:
        assert engine.stats.data["sliced_load_unwaited"] == 1
        assert engine.stats.data["sliced_load_failures"] == 1
        assert 0 in starts[1:]  # vLLM dropped that forward's token and recomputed the hit's blocks
    else:
        assert "sliced_load_unwaited" not in engine.stats.data
        assert 0 not in starts
    assert len(engine.output_tokens("warm")) == 3


def test_a_layer_that_skipped_once_loads_in_slice_0_from_then_on(make_engine):
    """The hook map drops a layer a forward skipped: the next sliced load puts its planes in slice 0, and no forward
    reads before its slice landed again."""
    engine, _ = _skipping_engine(make_engine, check_every_step=False)
    engine.run()
    text = prompt(600, seed=21)
    engine.add(text, max_tokens=2, request_id="cold21")
    engine.run()
    engine.evict_device_cache()
    engine.add(text + [4], max_tokens=2, request_id="hit21")
    engine.run()
    assert engine.stats.data["sliced_load_unwaited"] == 1  # "warm" only
    assert engine.stats.data["sliced_loads"] == 2
    worker = engine.workers[0].worker_half
    assert worker.hooks.dropped == {engine.hook_layers[0][-1]}
    assert_quiescent(engine)


def test_after_two_forwards_read_before_their_slices_landed_hits_load_asynchronously(make_engine):
    """Forwards that announce nothing (a replayed FULL CUDA graph) teach the hook map nothing, so every sliced load
    is read unwaited: the workers' guard counts reach the scheduler (worker metadata), and after two it stops
    slicing."""
    engine, _ = _skipping_engine(make_engine, check_every_step=False, every_layer=True)
    engine.run()
    for seed in (21, 22):
        text = prompt(600, seed=seed)
        engine.add(text, max_tokens=2, request_id=f"cold{seed}")
        engine.run()
        engine.evict_device_cache()
        engine.add(text + [4], max_tokens=2, request_id=f"hit{seed}")
        engine.run()
    assert engine.stats.data["sliced_load_unwaited"] == 2  # "warm" and "hit21"
    assert engine.stats.data["sliced_loads"] == 2  # "hit22" loaded asynchronously
    assert engine.loaded_tokens["hit22"] == 512
    assert_quiescent(engine)


def test_one_forward_reading_two_requests_loads_early_counts_once(make_engine):
    """Two hits in one forward that skips every hook: both are recomputed, and the scheduler hears of one forward
    (it stops slicing after two forwards, not two requests)."""
    engine, _ = _skipping_engine(make_engine, check_every_step=False, every_layer=True)
    engine.add(prompt(600, seed=11) + [5], max_tokens=2, request_id="second")  # warm's hit, in the same step
    reported = []
    worker = engine.workers[0].worker_half
    build = worker.build_worker_meta

    def spied():
        meta = build()
        if meta is not None:
            reported.append(meta.unwaited_sliced)
        return meta

    worker.build_worker_meta = spied
    engine.run()
    assert engine.stats.data["sliced_load_unwaited"] == 2  # both requests' loads
    assert sum(reported) == 1  # one forward
    assert engine.connector.scheduler_half.modes.workers_slice  # still slicing after one


def test_a_slice_not_launched_in_time_fails_the_load_instead_of_hanging(make_engine, monkeypatch):
    monkeypatch.setattr(sliced_loads, "SLICE_WAIT_S", 0.05)
    engine = preset_engine(make_engine, "llama3-8b", "ascend", max_layers=4, extra_config=SLICED,
                           check_every_step=False)
    text = prompt(600, seed=13)
    engine.add(text, max_tokens=2, request_id="cold")
    engine.run()
    engine.evict_device_cache()
    (slow,) = wrap(engine, lambda b: Slow(b, Direction.LOAD, seconds=0.5), Direction.LOAD)
    engine.add(text + [4], max_tokens=3, request_id="warm")
    engine.run()
    assert engine.stats.data["sliced_load_failures"] == 1
    assert len(engine.output_tokens("warm")) == 3
    assert_quiescent(engine)
