"""The cost model (store/cost): the online fit converges on synthetic data, the step clock and the transfer timer
turn injected times into observations, and the cut point picks the prefix of least time to the first token. Every
time here is injected: no test reads a clock."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.store.commands import Load, Promote, Store, Tier
from lmcache_npu.store.cost import (ComputeModel, CostModel, HitShape, LinearFit, Path, Speed, StepShape,
                                    TransferSample, TransferTimer, attention, best_cut, claim_all, ttft_by_cut)

from .fakes import make_key as key

EXAMPLES = settings(max_examples=60, deadline=None)


# ---- the fit ----------------------------------------------------------------------------------------------------

def _step_shapes(rng: np.random.Generator, count: int) -> list[StepShape]:
    """Steps as a serving engine has them: decodes of a few requests at long contexts, prefills of many tokens."""
    shapes = []
    for _ in range(count):
        if rng.random() < 0.5:
            shapes.append(StepShape.of([(int(rng.integers(100, 8000)), 1) for _ in range(int(rng.integers(1, 32)))]))
        else:
            shapes.append(StepShape.of([(int(rng.integers(0, 8000)), int(rng.integers(16, 4096)))]))
    return shapes


def _true_step(coefficients: tuple[float, float, float], shape: StepShape) -> float:
    return float(np.dot(coefficients, shape.features()))


def _fits_within(fit: LinearFit, coefficients: tuple[float, float, float], rng: np.random.Generator,
                 tolerance: float) -> bool:
    return all(abs(fit.predict(s.features()) - _true_step(coefficients, s)) <= tolerance * _true_step(coefficients, s)
               for s in _step_shapes(rng, 50))


@EXAMPLES
@given(a=st.floats(1e-4, 5e-2), b=st.floats(0, 2e-4), c=st.floats(0, 2e-8), seed=st.integers(0, 2**32 - 1))
def test_the_step_fit_converges_on_synthetic_steps(a, b, c, seed):
    rng = np.random.default_rng(seed)
    model = ComputeModel(budget=8192)
    now = 0.0
    for shape in _step_shapes(rng, 200):
        step = model.on_schedule(shape, now)
        now += _true_step((a, b, c), shape)
        model.on_done([step], now)
    assert model.fitted
    assert _fits_within(model.fit, (a, b, c), rng, 0.01)
    # negative control: the same check refuses a fit of other coefficients
    assert not _fits_within(model.fit, (2 * a, 2 * b + 1e-5, c), rng, 0.01)


def test_the_fit_keeps_coefficients_non_negative_and_the_seed_rules_until_data_comes():
    fit = LinearFit(seed=(1e-3, 1e-9), scales=(1.0, 1e6), prior_weight=2.0, half_life=100)
    assert fit.coefficients == pytest.approx((1e-3, 1e-9))
    assert fit.relative_sd == 1.0  # nothing observed: no trust
    for nbytes in np.linspace(1e6, 1e8, 50):  # seconds fall with bytes: the best non-negative slope is 0
        fit.observe((1.0, nbytes), 0.5 - nbytes * 5e-9)
    latency, per_byte = fit.coefficients
    assert per_byte == 0.0 and 0.2 < latency < 0.26  # the mean of what was seen, a little towards the seed
    for nbytes in np.random.default_rng(0).uniform(1e6, 1e8, 1000):  # a real tier: 2 ms + 2 GB/s; old data fades
        fit.observe((1.0, nbytes), 2e-3 + nbytes / 2e9)
    latency, per_byte = fit.coefficients
    # what the old data leaves is small next to the transfers: 1% of the largest one (52 ms)
    assert latency == pytest.approx(2e-3, abs=5e-4) and 1 / per_byte == pytest.approx(2e9, rel=0.02)
    assert fit.relative_sd < 0.5


def test_a_step_counts_from_its_schedule_or_the_previous_output_to_its_own_output():
    model = ComputeModel(budget=2048)
    prefill, decode = StepShape.of([(0, 512)]), StepShape.of([(512, 1)])
    assert model.on_schedule(StepShape(0, 0.0), 0.0) is None  # computes nothing: not timed
    first = model.on_schedule(prefill, 1.0)
    assert model.on_done([first], 1.5) == [(0.0, pytest.approx(0.5))]  # sync: schedule to output
    # async scheduling: the decode is scheduled while the next prefill runs, and its time starts at that output
    second = model.on_schedule(prefill, 2.0)
    third = model.on_schedule(decode, 2.01)
    assert model.on_done([second, second], 2.5)[0][1] == pytest.approx(0.5)  # two ranks echo the same step
    assert model.on_done([third], 2.6)[0][1] == pytest.approx(0.1)  # not 0.59: it ran after the prefill's output
    assert model.on_done([third, 99], 3.0) == []  # once only; an unknown number is no step
    late = model.on_schedule(decode, 100.0)  # after an idle minute: timed from its own schedule
    assert model.on_done([late], 100.1)[0][1] == pytest.approx(0.1)
    assert model.fit.observations == pytest.approx(4.0, rel=0.01) and not model.fitted
    assert model.busy
    model.idle()
    assert not model.busy


def test_attention_counts_the_context_of_each_token():
    assert attention(0, 3) == 1 + 2 + 3
    assert attention(10, 2) == 11 + 12
    assert StepShape.of([(0, 3), (10, 2), (7, 0)]) == StepShape(5, 29.0, 2)  # a request that computes nothing is not counted


# ---- the tiers ----------------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(latency=st.floats(1e-4, 2e-2), gbps=st.floats(0.05, 50), seed=st.integers(0, 2**32 - 1))
def test_a_tier_fit_learns_latency_and_bandwidth_from_samples(latency, gbps, seed):
    rng = np.random.default_rng(seed)
    model = CostModel(budget=8192, object_bytes=8 << 20, device="cpu")
    samples = []
    for _ in range(150):
        chunks, queued = int(rng.integers(1, 32)), int(rng.integers(0, 16)) * (8 << 20)
        nbytes = chunks * (8 << 20)
        samples.append(TransferSample(Path.DISK, chunks, nbytes, queued, latency + (queued + nbytes) / (gbps * 1e9),
                                      True))
    model.on_samples(samples)
    # what the fit is for: the time of a batch of any size, behind any queue, within 2%
    for chunks in (1, 2, 8, 32, 64):
        for queued in (0, 8 * (8 << 20)):
            nbytes = chunks * (8 << 20)
            assert model.tiers[Path.DISK].seconds(nbytes, queued) == pytest.approx(
                latency + (queued + nbytes) / (gbps * 1e9), rel=0.02)
    speed = model.tiers[Path.DISK].speed  # and where the bytes weigh, the bandwidth itself
    if 8 << 20 > gbps * 1e9 * latency:
        assert speed.bytes_per_s == pytest.approx(gbps * 1e9, rel=0.02)
    assert model.tiers[Path.DISK].measured and not model.tiers[Path.REMOTE].measured


def test_failed_samples_teach_nothing_and_waits_teach_only_untimed_paths():
    model = CostModel(budget=8192, object_bytes=1 << 20, device="cuda:0")
    seed = model.tiers[Path.REMOTE].speed
    model.on_samples([TransferSample(Path.REMOTE, 4, 4 << 20, 0, 100.0, ok=False)])
    assert model.tiers[Path.REMOTE].speed == seed and not model.tiers[Path.REMOTE].measured
    model.on_promotion_wait(Path.REMOTE, 4, 1.0)  # a node cache's promotion, seen by the scheduler only
    assert model.tiers[Path.REMOTE].speed != seed
    model.on_samples([TransferSample(Path.DISK, 1, 1 << 20, 0, 0.01, ok=True)])
    disk = model.tiers[Path.DISK].speed
    model.on_promotion_wait(Path.DISK, 1, 50.0)  # the workers time this path: a wait adds nothing
    assert model.tiers[Path.DISK].speed == disk


def test_in_flight_bytes_delay_a_new_transfer():
    model = CostModel(budget=8192, object_bytes=1 << 20, device="cpu")
    alone = float(model.transfer_s(Path.DISK, np.array([1 << 20]))[0])
    model.on_commands([Promote(i, key(i), i, source=Tier.DISK) for i in range(8)])
    behind = float(model.transfer_s(Path.DISK, np.array([1 << 20]))[0])
    assert behind == pytest.approx(alone + 8 * (1 << 20) / model.tiers[Path.DISK].speed.bytes_per_s)
    model.in_flight.settled(range(8))
    assert float(model.transfer_s(Path.DISK, np.array([1 << 20]))[0]) == pytest.approx(alone)


def test_the_seeds_follow_the_device_family():
    assert CostModel(1, 1, "cuda:3").tiers[Path.LOAD].speed.bytes_per_s == pytest.approx(50e9)
    model = CostModel(1, 1, "cpu")
    model.set_geometry(1, "cuda:0")
    assert model.tiers[Path.LOAD].speed.bytes_per_s == pytest.approx(50e9)


# ---- the timer --------------------------------------------------------------------------------------------------

@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_timer_times_each_path_of_a_submit_as_one_batch_behind_what_is_in_flight():
    clock = Clock()
    timer = TransferTimer(object_bytes=100, clock=clock)
    loads = [Load(i, key(i), i, request_id="r", chunk_index=i) for i in range(3)]
    timer.started([*loads, Promote(10, key(10), 10, source=Tier.DISK), Store(20, key(20), 20, request_id="r",
                                                                               chunk_index=0)])
    clock.now = 0.5
    timer.started([Promote(11, key(11), 11, source=Tier.DISK)])  # queued behind promotion 10
    clock.now = 1.0
    for load in loads[:2]:
        timer.finished(load.cmd_id, True)
    assert timer.take() == []  # the batch is not done
    clock.now = 2.0
    timer.finished(2, True)
    timer.finished(10, False)
    timer.finished(999, True)  # refused before it started: ignored
    clock.now = 3.0
    timer.finished(11, True)
    samples = {s.path: s for s in timer.take()}
    assert samples[Path.LOAD] == TransferSample(Path.LOAD, 3, 300, 0, 2.0, True)
    assert samples[Path.DISK] == TransferSample(Path.DISK, 1, 100, 100, 2.5, True)  # 11 behind 10's bytes
    assert Path.STORE not in samples  # still in flight
    assert timer.take() == []


def test_a_batch_the_mover_timed_is_sampled_as_the_move_alone_and_an_untimed_answer_falls_back_to_the_wall():
    """On a GPU the loads queue behind the model's work on the device (the step the cut counts already): the mover's
    device window is the sample, behind nothing. One answer without it (the control) times the batch from submit."""
    clock = Clock()
    timer = TransferTimer(object_bytes=100, clock=clock)
    timer.started([Load(1, key(1), 1, request_id="r", chunk_index=0)])
    timer.started([Load(i, key(i), i, request_id="r", chunk_index=i) for i in (2, 3)])  # behind load 1's bytes
    clock.now = 1.5
    timer.finished(1, True, 0.25)
    timer.finished(2, True, 0.4)
    timer.finished(3, True, 0.4)
    assert timer.take() == [TransferSample(Path.LOAD, 1, 100, 0, 0.25, True),
                            TransferSample(Path.LOAD, 2, 200, 0, 0.4, True)]
    timer.started([Load(i, key(i), i, request_id="r", chunk_index=i) for i in (4, 5)])
    clock.now = 2.0
    timer.finished(4, True, 0.1)
    timer.finished(5, True)  # answered without the mover's measure
    assert timer.take() == [TransferSample(Path.LOAD, 2, 200, 0, 0.5, True)]


def test_commands_abandoned_past_their_deadline_leave_the_queue_and_their_batch_is_never_timed():
    clock = Clock()
    timer = TransferTimer(object_bytes=100, clock=clock)
    timer.started([Promote(1, key(1), 1, source=Tier.DISK), Promote(2, key(2), 2, source=Tier.DISK)])
    timer.abandon([1])  # the worker answered it as failed after its deadline
    clock.now = 1.0
    timer.started([Promote(3, key(3), 3, source=Tier.DISK)])
    clock.now = 2.0
    timer.finished(2, True)  # the abandoned batch's last answer: no sample of a batch cut short
    timer.finished(1, True)  # the late answer of the abandoned command: ignored
    timer.finished(3, True)
    # 3 queued behind 2 alone (the control: without the abandon it would be behind 1's bytes too, 200)
    assert timer.take() == [TransferSample(Path.DISK, 1, 100, 100, 1.0, True)]


# ---- the cut ------------------------------------------------------------------------------------------------------

@dataclass
class World:
    """Costs as they really are (a test's truth): what a perfect model would predict."""

    step: tuple[float, float, float] = (5e-3, 5e-5, 0.0)  # a, b, c
    speeds: dict = field(default_factory=lambda: {Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 2e9),
                                                  Path.REMOTE: Speed(5e-3, 1e9)})
    floor: float = 0.02
    object_bytes: int = 16 << 20
    budget: int = 8192

    def prefill_s(self, start, end):
        a, b, c = self.step
        count = np.maximum(end - start, 1).astype(float)
        return a * np.ceil(count / self.budget) + b * count + c * attention(start, count)

    def transfer_s(self, path, nbytes):
        return self.speeds[path].latency_s + nbytes / self.speeds[path].bytes_per_s

    sharing: float = 0.0

    def step_floor_s(self):
        return self.floor

    def sharers(self):
        return self.sharing


class FlippedBandwidth(World):
    """A broken model: the bandwidth's sign flipped (more bytes, less time)."""

    def transfer_s(self, path, nbytes):
        return self.speeds[path].latency_s - nbytes / self.speeds[path].bytes_per_s


def oracle_ttft(hit: HitShape, world: World, j: int) -> float:
    """T(j) written out plainly, one chunk at a time (cut.py's docstring), to check the vectorised arithmetic."""
    if j == 0:
        return hit.ahead_s + float(world.prefill_s(np.array([hit.computed]), hit.tokens)[0])
    moving = {Tier.DISK: 0, Tier.REMOTE: 0}
    for c in range(hit.ready, j):
        if hit.sources[c] in moving:
            moving[hit.sources[c]] += 1
    promotion = max([world.transfer_s(Path.promotion(t), n * world.object_bytes) for t, n in moving.items() if n]
                    or [0.0])
    load = world.transfer_s(Path.LOAD, j * world.object_bytes)
    start = (hit.first_chunk + j) * hit.chunk_tokens
    wait = promotion + max(load, world.floor)
    return max(hit.ahead_s, wait) + float(world.prefill_s(np.array([start]), hit.tokens)[0])


def _regret(hit: HitShape, decided_by, truth: World) -> float:
    """How much later than the best cut the decided one's first token comes, under the truth."""
    true = ttft_by_cut(hit, truth)[0]
    return float(true[best_cut(hit, decided_by).chunks] - true.min())


hits = st.builds(
    lambda sources, ready, first, extra, chunk, ahead: HitShape(first * chunk + (chunk // 2 if first else 0),
                                                               (first + len(sources)) * chunk + extra, first, chunk,
                                                               tuple(sources), min(ready, len(sources)),
                                                               ahead_s=ahead),
    st.lists(st.sampled_from([Tier.ARENA, Tier.DISK, Tier.REMOTE]), min_size=1, max_size=40), st.integers(0, 40),
    st.integers(0, 8), st.integers(1, 2000), st.sampled_from([16, 128, 256]),
    st.sampled_from([0.0, 0.0, 0.05, 2.0]))
worlds = st.builds(
    # a step's floor is at least what every step pays (a)
    lambda a, b, c, load, disk, remote, floor: World((a, b, c), {Path.LOAD: Speed(1e-3, load * 1e9),
                                                             Path.DISK: Speed(2e-3, disk * 1e9),
                                                             Path.REMOTE: Speed(5e-3, remote * 1e9)}, a + floor),
    st.floats(1e-4, 5e-2), st.floats(1e-6, 2e-4), st.floats(0, 1e-8), st.floats(1, 60), st.floats(0.05, 50),
    st.floats(0.05, 50), st.floats(0, 0.1))


@EXAMPLES
@given(hit=hits, world=worlds)
def test_the_cut_is_the_prefix_of_least_time_to_the_first_token(hit, world):
    cut = best_cut(hit, world)
    plain = [oracle_ttft(hit, world, j) for j in range(len(hit.sources) + 1)]
    assert cut.ttft_s == pytest.approx(plain[cut.chunks], rel=1e-9, abs=1e-12)
    assert cut.ttft_s <= min(plain) * (1 + 1e-9) + 1e-12
    assert cut.recompute_s + hit.ahead_s == pytest.approx(plain[0])
    assert cut.saved_s == pytest.approx(plain[0] - plain[cut.chunks], abs=1e-9)
    longer = [j for j in range(cut.chunks + 1, len(plain)) if plain[j] <= cut.ttft_s * (1 - 1e-9) - 1e-12]
    assert not longer  # ties go to the longer claim only when equal; nothing longer is better


def test_a_slow_tier_after_arena_chunks_cuts_at_the_arena_and_a_fast_one_claims_everything():
    hit = HitShape(0, 20 * 256 + 10, 0, 256, (Tier.ARENA,) * 8 + (Tier.DISK,) * 12, 8)
    slow = World(speeds={Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 0.05e9), Path.REMOTE: Speed(5e-3, 1e9)})
    fast = World(speeds={Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 20e9), Path.REMOTE: Speed(5e-3, 1e9)})
    assert best_cut(hit, slow).chunks == 8
    assert best_cut(hit, fast).chunks == 20
    cheap_compute = World(step=(5e-3, 1e-6, 0.0))  # computing 5K tokens costs 5 ms: nothing is worth a step's wait
    assert best_cut(hit, cheap_compute).chunks == 0
    assert best_cut(hit, slow, limit=3).chunks == 3  # at a deadline: only what the arena holds


def test_compute_that_lengthens_the_batchs_steps_counts_for_every_request_in_it():
    """A hit not worth a step's wait to its own request alone (computing 5K tokens takes 5 ms, the step 20 ms) is
    claimed when fifteen requests share the steps its compute would lengthen; alone (the control) it is computed."""
    hit = HitShape(0, 20 * 256 + 10, 0, 256, (Tier.ARENA,) * 20, 20)
    alone = World(step=(5e-3, 1e-6, 0.0))
    busy = dataclasses.replace(alone, sharing=15.0)
    assert best_cut(hit, alone).chunks == 0
    assert best_cut(hit, busy).chunks == 20
    cut = best_cut(hit, busy)
    assert cut.ttft_s > cut.recompute_s  # its own first token comes later: the batch's come sooner


def test_a_promotion_the_work_ahead_hides_is_claimed():
    """Twelve disk chunks at 50 MB/s take 4 s to promote, computing their tokens 0.15 s: with nothing queued ahead
    (the control) the arena's end is the cut; with 10 s of other requests' prefills ahead of it, the promotion
    lands while they compute, and the request claims everything (its first token then comes at the same time, and
    its tokens are no longer computed for the batch)."""
    hit = HitShape(0, 20 * 256 + 10, 0, 256, (Tier.ARENA,) * 8 + (Tier.DISK,) * 12, 8)
    slow = World(speeds={Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 0.05e9), Path.REMOTE: Speed(5e-3, 1e9)})
    assert best_cut(hit, slow).chunks == 8
    queued = dataclasses.replace(hit, ahead_s=10.0)
    cut = best_cut(queued, slow)
    assert cut.chunks == 20 and cut.ahead_s == 10.0
    assert cut.ttft_s == pytest.approx(10.0 + cut.compute_s) and cut.saved_s > 0
    short = dataclasses.replace(hit, ahead_s=1.0)  # 1 s hides two disk chunks (0.34 s each), not twelve
    assert best_cut(short, slow).chunks == 10


def test_a_backlog_pays_the_steps_fixed_cost_once_per_budget_not_per_request():
    model = ComputeModel(budget=1024)
    model.fit = LinearFit(seed=(0.01, 1e-4, 1e-8), scales=(1.0, 1024.0, 1024.0 * 1024.0), prior_weight=1.0,
                          half_life=100.0)
    one = float(model.prefill_s(np.array([0]), 512)[0])
    assert model.backlog_s([(0, 512)]) == pytest.approx(one)
    four = model.backlog_s([(0, 512)] * 4)  # 2048 tokens: two steps' fixed cost, not four
    assert four == pytest.approx(4 * one - 2 * 0.01)
    assert model.backlog_s([(300, 300), (10, 5)]) == 0.0  # finished or empty spans cost nothing


def test_a_cut_never_ends_on_a_chunk_without_its_end_state():
    hit = HitShape(0, 20 * 256 + 10, 0, 256, (Tier.ARENA,) * 8 + (Tier.DISK,) * 12, 8)
    slow = World(speeds={Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 0.05e9), Path.REMOTE: Speed(5e-3, 1e9)})
    assert best_cut(hit, slow).chunks == 8  # the control: the arena's end is the best place
    partial = dataclasses.replace(hit, ends=tuple(c not in (6, 7) for c in range(20)))  # 7 and 8 lack end state
    assert best_cut(partial, slow).chunks == 6


def test_negative_control_with_a_slow_tier_load_all_loses_to_the_model_and_a_broken_model_loses_too():
    """Predicted time to the first token under the true costs: the model's cut beats claiming everything when the
    disk is slow; a model with the bandwidth's sign flipped claims the slow chunks and fails the same check."""
    hit = HitShape(0, 32 * 256 + 10, 0, 256, (Tier.ARENA,) * 4 + (Tier.DISK,) * 28, 4)
    truth = World(speeds={Path.LOAD: Speed(1e-3, 20e9), Path.DISK: Speed(2e-3, 0.1e9), Path.REMOTE: Speed(5e-3, 1e9)})
    true = ttft_by_cut(hit, truth)[0]
    model_cut = best_cut(hit, truth)
    load_all = claim_all(hit, truth)
    assert true[model_cut.chunks] < 0.8 * true[load_all.chunks]  # the model wins by a margin
    assert _regret(hit, truth, truth) == 0.0
    broken = FlippedBandwidth(speeds=truth.speeds)
    assert best_cut(hit, broken).chunks == 32  # it thinks the more it loads, the faster
    assert _regret(hit, broken, truth) > 0.2 * true.min()


@EXAMPLES
@given(hit=hits, world=worlds, seed=st.integers(0, 2**32 - 1))
def test_a_model_learned_from_the_worlds_observations_decides_within_5_percent_of_the_best(hit, world, seed):
    """The loop end to end: steps and transfer samples generated by a world teach a CostModel, whose cuts then come
    within 5% of the best time to the first token under that world."""
    rng = np.random.default_rng(seed)
    model = CostModel(budget=world.budget, object_bytes=world.object_bytes, device="cpu")
    now = 0.0
    for shape in _step_shapes(rng, 120):
        step = model.on_schedule(shape, now)
        now += _true_step(world.step, shape)
        model.on_done([step], now)
    for path in (Path.LOAD, Path.DISK, Path.REMOTE):
        samples = []
        for _ in range(60):
            chunks = int(rng.integers(1, 40))
            nbytes = chunks * world.object_bytes
            samples.append(TransferSample(path, chunks, nbytes, 0, float(world.transfer_s(path, nbytes)), True))
        model.on_samples(samples)
    model.compute.recent_step_s, model.compute.busy = world.floor, True
    model.compute.sharing = 0  # this world's truth is one request's own first token (sharers are tested apart)
    true = ttft_by_cut(hit, world)[0]
    assert _regret(hit, model, world) <= 0.05 * true.min() + 1e-6
