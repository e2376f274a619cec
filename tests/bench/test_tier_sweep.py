"""The tier-speed sweep's arithmetic (issue 40 item 5): the read throttle's shared channel, the per-request oracle,
the regret and the crossover, on injected times (the engine runs are the study's, not the tests')."""

from __future__ import annotations

import threading

import pytest

from lmcache_npu.tools.bench.studies.tier_sweep import (ARENA_ONLY, COST_MODEL, LOAD_ALL, RECOMPUTE, RECOMPUTE_AGAIN,
                                                        WAVE_BOUND, ReadThrottle, crossover, oracle, point, summarize,
                                                        wave_bound)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_the_throttle_is_one_channel_for_every_reader():
    clock = FakeClock()
    throttle = ReadThrottle(1e6)  # 1 MB/s
    assert throttle.wait(500_000, clock, clock.sleep) == pytest.approx(0.5)
    assert throttle.wait(500_000, clock, clock.sleep) == pytest.approx(1.0)  # queued behind the first read
    clock.now = 5.0  # an idle channel carries a new read at once
    assert throttle.wait(1_000_000, clock, clock.sleep) == pytest.approx(1.0)
    assert clock.slept == pytest.approx([0.5, 1.0, 1.0])
    with pytest.raises(ValueError, match="bytes_per_s"):
        ReadThrottle(0)


def test_a_wrapped_read_reads_every_byte_then_waits_for_the_channel():
    calls = []

    def read_into(name, out):
        out[:] = bytes(range(len(out)))
        calls.append(name)
        return "ok"

    throttle = ReadThrottle(1e12)
    waited = []
    throttle.wait = lambda nbytes: waited.append(nbytes)  # type: ignore[method-assign]
    out = bytearray(16)
    assert throttle.wrap(read_into)("chunk", out) == "ok"
    assert bytes(out) == bytes(range(16)) and calls == ["chunk"] and waited == [16]
    threads = [threading.Thread(target=throttle.wrap(read_into), args=("c", bytearray(4))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(waited) == 16 + 32


def _times(values: dict[int, float]) -> dict[tuple[int, int], float]:
    """Turn 0 (left out of every point) at 9 s, then the given requests of turn 1."""
    return {(0, 0): 9.0, **{(1, c): t for c, t in values.items()}}


def test_the_oracle_takes_each_requests_faster_way_and_the_regret_is_against_it():
    recompute = _times({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    slow, fast = _times({0: 2.0, 1: 0.5, 2: 2.0, 3: 0.5}), _times({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2})
    best = oracle(recompute, slow)
    assert [best[(1, c)] for c in range(4)] == [1.0, 0.5, 1.0, 0.5]
    runs = {(RECOMPUTE, 0.0): recompute, (ARENA_ONLY, 0.0): fast,
            (LOAD_ALL, 0.1): slow, (COST_MODEL, 0.1): _times({0: 1.0, 1: 0.5, 2: 1.0, 3: 1.0}),
            (LOAD_ALL, 10.0): fast, (COST_MODEL, 10.0): fast}
    summary = summarize(runs)
    assert summary.regret[0.1] == pytest.approx(0.875 / 0.75 - 1)
    assert summary.regret[10.0] == pytest.approx(0.0)
    assert summary.gain[0.1] == pytest.approx(1 - 0.875 / 1.0)  # the better of load-all (1.25) and recompute (1.0)
    assert summary.slow_tier_p50[10.0] == pytest.approx(0.0) and summary.slow_tier_p50[0.1] > 1
    # negative control: a cost model that always loads has the load-all regret, which the same check notices
    always = summarize({**runs, (COST_MODEL, 0.1): slow})
    assert always.regret[0.1] == pytest.approx(1.25 / 0.75 - 1) and always.regret[0.1] > 0.05
    with pytest.raises(ValueError, match="same requests"):
        oracle(recompute, _times({0: 1.0}))


def test_the_crossover_interpolates_in_log_bandwidth():
    assert crossover([0.1, 1.0, 10.0], [4.0, 2.0, 0.5], 2.0) == pytest.approx(1.0)
    assert crossover([0.1, 10.0], [3.0, 1.0], 2.0) == pytest.approx(1.0)  # halfway in log: 10^0
    assert crossover([0.1, 1.0], [0.5, 0.4], 2.0) is None  # loading always wins: no crossing in the sweep
    assert crossover([1.0, 0.1], [1.0, 3.0], 2.0) == pytest.approx(10 ** -0.5)  # order of the sweep does not matter


def test_turn_one_is_left_out_and_a_run_without_later_turns_is_refused():
    assert point("x", 1.0, _times({0: 2.0, 1: 4.0})).mean_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no request after the first turn"):
        point("x", 1.0, {(0, 0): 1.0})


def test_the_noise_floor_is_the_oracle_of_two_runs_of_one_policy():
    first, again = _times({0: 1.0, 1: 2.0}), _times({0: 2.0, 1: 1.0})  # the same mean, noise per request
    runs = {(RECOMPUTE, 0.0): first, (RECOMPUTE_AGAIN, 0.0): again, (LOAD_ALL, 1.0): first, (COST_MODEL, 1.0): first}
    assert summarize(runs).noise_floor == pytest.approx(1.5 / 1.0 - 1)
    assert summarize({k: v for k, v in runs.items() if k[0] != RECOMPUTE_AGAIN}).noise_floor is None


def test_the_wave_bound_serves_each_turn_with_the_fixed_policy_that_served_it_fastest():
    """Turn 1: load-all's mean (0.6) beats recompute's (1.0) though recompute is faster for request 0; turn 2:
    recompute's. The bound keeps whole waves, so it is above the per-request oracle; a cost model equal to it has
    no wave regret, and one that always loads (the control) has the wave regret the check notices."""
    recompute = {(0, 0): 9.0, (1, 0): 0.5, (1, 1): 1.5, (2, 0): 1.0, (2, 1): 1.0}
    load_all = {(0, 0): 9.0, (1, 0): 0.7, (1, 1): 0.5, (2, 0): 2.0, (2, 1): 2.0}
    bound = wave_bound([recompute, load_all])
    assert bound == {(0, 0): 9.0, (1, 0): 0.7, (1, 1): 0.5, (2, 0): 1.0, (2, 1): 1.0}
    assert point("x", 1.0, bound).mean_s > point("x", 1.0, oracle(recompute, load_all)).mean_s
    runs = {(RECOMPUTE, 0.0): recompute, (LOAD_ALL, 1.0): load_all, (COST_MODEL, 1.0): bound}
    summary = summarize(runs)
    assert summary.wave_regret[1.0] == pytest.approx(0.0)
    assert any(p.policy == WAVE_BOUND for p in summary.points)
    always = summarize({**runs, (COST_MODEL, 1.0): load_all})
    assert always.wave_regret[1.0] == pytest.approx(1.3 / 0.8 - 1) and always.wave_regret[1.0] > 0.05
    with pytest.raises(ValueError, match="same requests"):
        wave_bound([recompute, {(0, 0): 1.0}])
