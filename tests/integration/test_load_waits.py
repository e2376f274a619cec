"""The waits in `get_finished` that let a load be reported in the step it lands (`load_wait.py`):
- an empty step (every runnable request waits for its KV) waits for one of its loads instead of letting the engine
  spin;
- where the model runs on the host, a step that computes waits, within its budget, for the loads it queued itself,
  so with vLLM >= 0.30's order (loads started after the forward) the request runs next step, not the one after; it
  never waits for loads of earlier steps, and an accelerator's step never waits for its loads.
"""

from __future__ import annotations

import pytest

from lmcache_npu.integration.vllm.load_wait import FIRST_STEP_WAIT_S, STEP_WAIT_CAP_S, StepLoadWait
from lmcache_npu.ops import Direction

from .conftest import assert_quiescent, preset_engine, prompt
from .wrappers import Slow, wait_until, wrap


def _spy(engine, slow: Slow, method: str, release: bool) -> list[tuple[frozenset, float]]:
    """Records every call of the executors' `method`. With `release`, the first call releases the held load and the
    wait gets a generous timeout, so the check does not depend on the machine's speed; without, the wait runs with
    the budget it was given."""
    calls: list[tuple[frozenset, float]] = []
    for worker in engine.workers:
        executor = worker.worker_half.executor
        real = getattr(executor, method)

        def spy(cmd_ids, timeout, real=real):
            calls.append((frozenset(cmd_ids), timeout))
            if not release:
                return real(cmd_ids, timeout)
            slow.release.set()
            return real(cmd_ids, 30.0)

        setattr(executor, method, spy)
    return calls


def _stored_prompt_with_held_loads(make_engine, seed: int, **overrides):
    """An engine holding a two-chunk prompt, with its load lane held until released."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", **overrides)
    chunk = engine.connector.scheduler_half.chunk_tokens
    text = prompt(2 * chunk + 20, seed=seed)
    engine.add(text, max_tokens=2, request_id="seed")
    engine.run()
    (slow,) = wrap(engine, lambda b: Slow(b, Direction.LOAD), Direction.LOAD)
    return engine, chunk, text, slow


def _counter(engine, name: str) -> int:
    """The counter summed over ranks and steps, as vLLM's stat loggers received it."""
    return int(engine.stats.data.get(name, 0))


def test_an_empty_step_reports_the_load_it_waited_for(make_engine):
    engine, chunk, text, slow = _stored_prompt_with_held_loads(make_engine, 31)
    calls = _spy(engine, slow, "wait_for_any", release=True)
    engine.add(text + [7, 7, 7], max_tokens=2, request_id="hit")
    so = engine.step()  # the only request waits for its KV: nothing is computed
    assert not so.total_num_scheduled_tokens and so.kv_connector_metadata.idle
    assert len(calls) == 1 and calls[0][0], calls  # it waited for the load's commands
    assert "hit" in engine.loaded_tokens, "the load that finished during the wait was not reported"
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)


def test_a_step_that_computes_waits_only_for_its_own_loads_within_its_budget(make_engine):
    engine, chunk, text, slow = _stored_prompt_with_held_loads(make_engine, 32)
    idle_calls = _spy(engine, slow, "wait_for_any", release=False)
    step_calls = _spy(engine, slow, "wait_for_all", release=False)
    engine.add(prompt(chunk, seed=33), max_tokens=chunk, request_id="busy")  # computes through every step below
    engine.step()
    engine.add(text + [5, 5], max_tokens=2, request_id="hit")
    wait_until(slow.waiting.is_set, engine.step)
    for _ in range(3):
        so = engine.step()
        assert so.total_num_scheduled_tokens and not so.kv_connector_metadata.idle
    assert not idle_calls, "a step that computed waited for any load"
    # the step that queued the load waited for it once, within its budget; the held load outlasted it
    assert len(step_calls) == 1 and step_calls[0][0] and 0 < step_calls[0][1] <= STEP_WAIT_CAP_S, step_calls
    assert _counter(engine, "step_load_wait_misses") == 1
    assert "hit" not in engine.loaded_tokens  # negative control: the held load is still held
    slow.release.set()
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)


def _first_busy_step_with_a_load(make_engine, seed: int, on_host: bool):
    """vLLM >= 0.30's order: the load starts after the forward of a step that computes another request; the load
    lane holds the load until the worker waits for it (on the host), or until the step is over."""
    engine, chunk, text, slow = _stored_prompt_with_held_loads(make_engine, seed, loads_after_forward=True)
    if not on_host:
        for worker in engine.workers:
            worker.worker_half._load_wait = None  # an accelerator's policy: loads are seen when polled
    calls = _spy(engine, slow, "wait_for_all", release=True)
    engine.add(prompt(chunk, seed=seed + 1), max_tokens=chunk, request_id="busy")
    engine.step()
    engine.add(text + [9, 9], max_tokens=2, request_id="hit")
    so = engine.step()
    assert so.total_num_scheduled_tokens and so.kv_connector_metadata.loads
    return engine, chunk, slow, calls


def test_a_busy_host_step_reports_the_loads_it_started_after_its_forward(make_engine):
    engine, chunk, slow, calls = _first_busy_step_with_a_load(make_engine, 41, on_host=True)
    assert len(calls) == 1 and calls[0][0], calls
    assert "hit" in engine.loaded_tokens, "the step's own load was not reported in that step"
    assert _counter(engine, "step_load_waits") == 1 and _counter(engine, "step_load_wait_misses") == 0
    so = engine.step()  # the request runs at once
    assert "hit" in so.num_scheduled_tokens
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)


def test_without_the_wait_the_load_is_reported_a_step_later(make_engine):
    # negative control for the test above: the accelerator's policy on the same engine
    engine, chunk, slow, calls = _first_busy_step_with_a_load(make_engine, 51, on_host=False)
    assert not calls
    assert "hit" not in engine.loaded_tokens
    slow.release.set()
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(wait: StepLoadWait, clock: _Clock, seconds: float, waited: float = 0.0) -> None:
    """One engine step of `seconds`, then a `get_finished` that waits `waited`."""
    clock.now += seconds
    wait.begin()
    clock.now += waited
    wait.end()


def test_the_step_budget_is_a_share_of_the_smoothed_step_capped():
    clock = _Clock()
    wait = StepLoadWait(share=0.25, cap_s=0.02, clock=clock)
    assert wait.budget() == FIRST_STEP_WAIT_S  # no step seen yet
    _step(wait, clock, 0.5)  # the first get_finished: nothing before it to measure
    assert wait.step_s is None
    _step(wait, clock, 0.04)
    assert wait.budget() == pytest.approx(0.01)
    _step(wait, clock, 0.08)  # smoothed: 0.04 + 0.2 * (0.08 - 0.04)
    assert wait.step_s == pytest.approx(0.048) and wait.budget() == pytest.approx(0.012)
    for _ in range(40):
        _step(wait, clock, 1.0)
    assert wait.budget() == 0.02  # a slow step waits no longer than the cap


def test_the_wait_is_not_part_of_the_step_it_is_a_share_of():
    clock = _Clock()
    wait = StepLoadWait(share=0.25, cap_s=1.0, clock=clock)
    _step(wait, clock, 0.0)
    for _ in range(50):
        _step(wait, clock, 0.04, waited=wait.budget())  # every wait runs to its budget (the loads miss)
    assert wait.step_s == pytest.approx(0.04)  # counted with the wait it would drift to 0.04 / 0.75


def test_an_idle_gap_counts_for_at_most_twice_the_step_estimate():
    clock = _Clock()
    wait = StepLoadWait(share=0.25, cap_s=0.02, clock=clock)
    _step(wait, clock, 0.0)
    for _ in range(5):
        _step(wait, clock, 0.01)
    _step(wait, clock, 30.0)  # no request for half a minute: vLLM did not step
    assert wait.step_s == pytest.approx(0.012)  # 0.01 + 0.2 * (min(30, 0.02) - 0.01)
    assert wait.budget() == pytest.approx(0.003)
    for _ in range(40):  # a real slowdown still registers, geometrically
        _step(wait, clock, 0.2)
    assert wait.step_s > 0.15


@pytest.mark.parametrize("share, cap, rule", [(-0.1, 0.02, "share"), (1.5, 0.02, "share"), (0.25, -1.0, "cap")])
def test_a_budget_out_of_range_is_refused(share, cap, rule):
    with pytest.raises(ValueError, match=rule):
        StepLoadWait(share=share, cap_s=cap)
