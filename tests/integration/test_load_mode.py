"""The per-request load mode (issue 41 item 5): the predictions against an independent computation, the chooser's
fall-backs, and the choice in vLLM's real scheduler once the cost model is fitted (with a synthetic clock)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import pytest
from hypothesis import given, settings, strategies as st

from lmcache_npu.integration.vllm.load_mode import (COPY_SLOWDOWN, SLICE_COST_S, SLICED_MARGIN, LoadMode, LoadModes,
                                                   mode_costs, sliced_seconds)
from lmcache_npu.ops import ChunkBatch, Direction, TransferStats
from lmcache_npu.ops.transfer_backend import AfterKernel
from lmcache_npu.store.cost import CostModel, Path, StepShape

from .conftest import assert_quiescent, preset_engine, prompt
from .test_cut_point import CHUNK, SyntheticSteps, _warm_up
from .wrappers import Wrapped, wrap

seconds = st.floats(0.0, 5.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(load=seconds, compute=seconds, step=seconds, sharers=st.integers(0, 16), slices=st.integers(1, 8))
def test_the_predictions_are_the_timelines_they_describe(load, compute, step, sharers, slices):
    costs = mode_costs(load, compute, step, sharers, slices)
    timeline = _work_clock_timeline(load, compute, slices, COPY_SLOWDOWN)
    assert costs.sliced_s == pytest.approx(timeline)
    assert costs.async_s == pytest.approx(max(load, step) + compute)
    assert costs.stall_s == pytest.approx(timeline - compute)
    gain = costs.async_s - costs.sliced_s - sharers * costs.stall_s
    assert costs.slices == (gain > SLICED_MARGIN * costs.async_s and gain > SLICE_COST_S * slices)


def _work_clock_timeline(load: float, compute: float, slices: int, slowdown: float) -> float:
    """Sliced, simulated on a work clock: by time t the forward can have done W(t) = min(t, load) / (1 + slowdown)
    + max(t - load, 0) of work (slower while the copy runs); slice k of S equal ones lands at (k + 1) load / S and
    window k's work starts once it has landed and the window before it is done."""
    def work(t: float) -> float:
        return min(t, load) / (1 + slowdown) + max(t - load, 0.0)

    def time_of(w: float) -> float:  # W's inverse
        return w * (1 + slowdown) if w <= load / (1 + slowdown) else load + w - load / (1 + slowdown)

    end = 0.0
    for k in range(slices):
        end = time_of(work(max(end, (k + 1) * load / slices)) + compute / slices)
    return end


@settings(max_examples=200, deadline=None)
@given(load=seconds, compute=seconds, slices=st.integers(1, 8))
def test_without_the_copy_slowdown_the_timeline_is_the_closed_form(load, compute, slices):
    expected = max(load + compute / slices, load / slices + compute)
    assert sliced_seconds(load, compute, slices, slowdown=0.0) == pytest.approx(expected)
    assert _work_clock_timeline(load, compute, slices, 0.0) == pytest.approx(expected)


def test_the_copy_slowdown_costs_only_the_windows_that_run_beside_the_copy():
    assert sliced_seconds(0.10, 0.10, 1) == pytest.approx(0.20)  # one slice: the forward starts after the copy
    assert sliced_seconds(0.10, 0.10, 4) == pytest.approx(0.1375)  # windows 0-2 partly beside it, not window 3
    assert sliced_seconds(0.10, 0.10, 4) > sliced_seconds(0.10, 0.10, 4, slowdown=0.0)  # negative control


def test_slicing_pays_where_load_and_compute_overlap_and_not_where_either_dominates():
    assert mode_costs(0.10, 0.10, 0.0, 0, 4).slices  # equal halves: about half the time saved
    assert not mode_costs(0.001, 0.10, 0.0, 0, 4).slices  # a tiny prefix: less to hide than the slices cost
    assert not mode_costs(2.0, 0.01, 0.0, 0, 4).slices  # the load dominates: its 10 ms compute is under 1 %
    assert not mode_costs(0.10, 0.10, 0.0, 16, 4).slices  # sixteen decodes stalled by the load's tail
    assert mode_costs(0.10, 0.10, 0.05, 1, 4).slices  # one sharer, a busy engine's step the async load sits out


def _fitted_model() -> CostModel:
    model = CostModel(budget=2048, object_bytes=1 << 20, device="cpu")
    now = 0.0
    for tokens in [64, 512, 1024, 2048] * 8:  # steps of 10 ms + 0.1 ms per token
        step = model.on_schedule(StepShape.of([(0, tokens)]), now)
        now += 0.01 + 1e-4 * tokens
        model.on_done([step], now)
    assert model.fitted
    model.tiers[Path.LOAD].observe(8 << 20, 0.0, 0.02)  # 8 chunks in 20 ms
    return model


@pytest.mark.parametrize("setting,groups,workers,expected", [
    ("async", 1, True, LoadMode.ASYNC),
    ("sliced", 1, False, LoadMode.ASYNC),  # tp_share's exchange cannot slice: async whatever the setting
    ("sliced", 3, True, LoadMode.SLICED),  # forced on a hybrid model (a failure then stops the engine)
    ("auto", 3, True, LoadMode.ASYNC),  # several groups: a failure could not be told to vLLM
    ("auto", 1, True, LoadMode.SLICED),
])
def test_the_chooser_follows_the_setting_and_what_the_engine_can_tell_vllm(setting, groups, workers, expected):
    modes = LoadModes(setting, 4, "cost-model", groups)
    modes.set_workers(workers)
    # 8 chunks (~20 ms to load) and 1024 tokens to compute (~110 ms): overlapping pays
    assert modes.choose(_fitted_model(), chunks=8, start=1024, tokens=2048) is expected


def test_auto_waits_for_a_fitted_model_and_never_slices_under_load_all():
    unfitted = CostModel(budget=2048, object_bytes=1 << 20)
    modes = LoadModes("auto", 4, "cost-model", 1)
    modes.set_workers(True)
    assert modes.choose(unfitted, 8, 1024, 2048) is LoadMode.ASYNC
    load_all = LoadModes("auto", 4, "load-all", 1)
    load_all.set_workers(True)
    assert load_all.choose(_fitted_model(), 8, 1024, 2048) is LoadMode.ASYNC
    assert modes.choose(_fitted_model(), 8, 1024, 2048) is LoadMode.SLICED  # the control


class SluggishLoads(Wrapped):
    """Loads that take `per_chunk` seconds a chunk on the lane, and report it as the move's time (a slow host link):
    the model learns a load worth hiding."""

    def __init__(self, inner: Any, per_chunk: float) -> None:
        super().__init__(inner)
        self.per_chunk = per_chunk

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        stats = super().transfer(batch, after_kernel)
        if batch.direction != Direction.LOAD:
            return stats
        time.sleep(self.per_chunk * batch.num_chunks)
        return dataclasses.replace(stats, seconds=stats.seconds + self.per_chunk * batch.num_chunks,
                                   device_seconds=None)


@pytest.mark.parametrize("per_chunk,expected", [(0.05, "sliced"), (0.0, "async")])
def test_auto_slices_a_load_worth_hiding_and_loads_a_quick_one_asynchronously(make_engine, per_chunk, expected):
    """vLLM's scheduler with a fitted model (synthetic steps of 10 ms + 1 ms per token): a two-chunk hit followed by
    512 new tokens. Loads of 50 ms a chunk (learned from a first hit) are hidden behind the 0.5 s of compute: sliced.
    The control: loads of about a millisecond save less than four slices cost: async."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=60,
                           extra_config={"chunk_tokens": CHUNK, "load_policy": "cost-model", "load_mode": "auto"})
    wrap(engine, lambda b: SluggishLoads(b, per_chunk), Direction.LOAD)
    SyntheticSteps(engine)
    _warm_up(engine)
    for round_ in range(2):  # the first hit teaches the model the loads' speed
        text = prompt(2 * CHUNK, seed=81 + round_)
        engine.add(text, max_tokens=2, request_id=f"cold{round_}")
        engine.run()
        engine.evict_device_cache()
        engine.add(text + prompt(2 * CHUNK, seed=90 + round_), max_tokens=2, request_id=f"hit{round_}")
        engine.run()
        assert engine.loaded_tokens[f"hit{round_}"] == 2 * CHUNK
        assert len(engine.output_tokens(f"hit{round_}")) == 2
    assert engine.stats.data.get("sliced_loads", 0) == (1 if expected == "sliced" else 0)  # the second hit only
    assert_quiescent(engine)


def test_a_request_computing_a_few_tokens_loads_asynchronously_even_when_forced():
    """A full hit computes one token: its step may replay a FULL CUDA graph, where no hook is called."""
    modes = LoadModes("sliced", 4, "cost-model", 1)
    modes.set_workers(True)
    assert modes.choose(_fitted_model(), 8, 2047, 2048) is LoadMode.ASYNC
    assert modes.choose(_fitted_model(), 8, 2040, 2048) is LoadMode.SLICED  # the control: eight tokens


def test_the_scheduler_stops_slicing_once_the_guard_failed_twice():
    modes = LoadModes("sliced", 4, "cost-model", 1)
    modes.set_workers(True)
    modes.on_unwaited(1)
    assert modes.choose(_fitted_model(), 8, 1024, 2048) is LoadMode.SLICED  # once may be a path skipping one step
    modes.on_unwaited(0)
    modes.on_unwaited(1)
    assert modes.choose(_fitted_model(), 8, 1024, 2048) is LoadMode.ASYNC
