"""The cut point in the real scheduler path (vLLM 0.23's `Scheduler`, simulated workers): the scheduler half learns
a step's time from its schedules (a synthetic clock injected here: no test reads time), the workers' transfer timer
reaches it through their metadata, a slow tier's hit is computed instead, a promotion later than the model's
deadline is computed instead, and every decision is counted in the stats vLLM receives. Each has a negative
control under `load_policy: load-all`, which claims everything as before."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from lmcache_npu.store.cost import MIN_STEPS, Path, TransferSample
from lmcache_npu.integration.vllm import cut_point
from lmcache_npu.integration.vllm.stats import FIT_GAUGES, GAUGES, METRICS, STORE_INFO

from .conftest import assert_quiescent, preset_engine, prompt

CHUNK = 256


class SyntheticSteps:
    """The scheduler half's clock: a step's output comes back `base + per_token × tokens` after its schedule."""

    def __init__(self, engine: Any, base: float = 0.01, per_token: float = 1e-3) -> None:
        self.now = 0.0
        self.base, self.per_token = base, per_token
        self._tokens: dict[int, int] = {}
        cut = engine.connector.scheduler_half.cut
        cut.clock = lambda: self.now
        schedule, output = cut.on_step, cut.on_output

        def on_step(scheduler_output: Any) -> Any:
            step = schedule(scheduler_output)
            if step is not None:
                self._tokens[step] = scheduler_output.total_num_scheduled_tokens
            return step

        def on_output(meta: Any, is_pending: Any) -> None:
            for step in set(getattr(meta, "steps", ())):
                self.now += self.base + self.per_token * self._tokens.pop(step, 0)
            output(meta, is_pending)

        cut.on_step, cut.on_output = on_step, on_output


def _engine(make_engine: Any, policy: str, **extra: Any) -> Any:
    return preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=40,
                         extra_config={"chunk_tokens": CHUNK, "load_policy": policy, **extra})


def _warm_up(engine: Any) -> None:
    """A request long enough for the compute side to be fitted (MIN_STEPS timed steps)."""
    engine.add(prompt(CHUNK + 10, seed=70), max_tokens=MIN_STEPS + 4, request_id="warm")
    engine.run()
    assert engine.connector.scheduler_half.cut.model.fitted


def test_timings_reach_the_model_and_every_decision_is_counted(make_engine, monkeypatch):
    monkeypatch.setattr(cut_point, "REPORT_EVERY", 1)  # every step's calibration and gauges reported
    engine = _engine(make_engine, "cost-model")
    SyntheticSteps(engine)
    _warm_up(engine)
    text = prompt(2 * CHUNK + 10, seed=71)
    engine.add(text, max_tokens=2, request_id="a")
    engine.run()
    engine.evict_device_cache()
    engine.add(text + [1], max_tokens=2, request_id="b")  # computing 512 tokens: 0.5 s; loading them: ms
    engine.run()
    assert engine.loaded_tokens["b"] == 2 * CHUNK
    model = engine.connector.scheduler_half.cut.model
    assert model.tiers[Path.LOAD].measured and model.tiers[Path.STORE].measured  # the workers' timer got through
    assert model.compute.fit.coefficients[1] == pytest.approx(1e-3, rel=0.05)  # the synthetic clock's per token
    data = engine.stats.data
    assert data["cost_claimed_tokens_faster"] == 2 * CHUNK and "cost_declined_tokens_slower" not in data
    assert data["cost_predicted_saved_seconds"] > 0.3
    assert data["cost_observed_step_seconds"] > 0 and data["cost_predicted_step_seconds"] > 0
    assert data["cost_observed_load_seconds"] > 0 and data["cost_predicted_load_seconds"] > 0
    assert data["cost_step_token_seconds"] == pytest.approx(1e-3, rel=0.05) and data["cost_step_observations"] > 0
    assert set(FIT_GAUGES) <= set(data)
    assert set(data) <= set(METRICS) | set(GAUGES) | {STORE_INFO}
    assert_quiescent(engine)


def _slow_disk(engine: Any, seconds_per_chunk: float) -> None:
    """What the workers would have timed of a slow disk: the model's disk path learns it."""
    model = engine.connector.scheduler_half.cut.model
    chunk_bytes = model.object_bytes
    model.on_samples([TransferSample(Path.DISK, n, n * chunk_bytes, 0, n * seconds_per_chunk, True)
                      for n in (1, 2, 3, 1, 2, 3)])


def _disk_engine(make_engine: Any, tmp_path: Any, policy: str) -> tuple[Any, list[int]]:
    """An engine whose arena holds two chunks, with request a's chunks pushed out to disk by request b."""
    slot = _engine(make_engine, policy).workers[0].worker_half.executor.arena.slot_bytes
    engine = _engine(make_engine, policy, cpu_bytes=2 * slot, disk_path=str(tmp_path), disk_bytes="64MiB")
    SyntheticSteps(engine)
    _warm_up(engine)
    text = prompt(3 * CHUNK + 10, seed=72)
    engine.add(text, max_tokens=2, request_id="a")
    engine.run()
    engine.add(prompt(3 * CHUNK + 10, seed=73), max_tokens=2, request_id="b")  # pushes a's chunks to disk
    engine.run()
    engine.workers[0].worker_half.executor.disk.flush(30)
    engine.evict_device_cache()
    return engine, text


def _assert_disk_outcome(engine, policy: str, declined: str) -> None:
    """After `_disk_engine`'s request "again" ran: the model computed its two disk chunks and counted them under
    `declined`; load-all loaded them and declined nothing."""
    data = engine.stats.data
    if policy == "cost-model":
        assert engine.loaded_tokens.get("again", 0) == 0
        assert data[declined] >= 2 * CHUNK
    else:
        assert engine.loaded_tokens["again"] >= 2 * CHUNK
        assert declined not in data and data["cost_claimed_tokens_load_all"] >= 2 * CHUNK
    assert_quiescent(engine)


@pytest.mark.parametrize("policy", ["cost-model", "load-all"])
def test_a_slow_tier_is_computed_instead(make_engine, tmp_path, policy):
    """The disk moves a chunk in 5 s; computing one takes 0.26 s: the model computes, load-all (the negative
    control) waits for the disk and loads."""
    engine, text = _disk_engine(make_engine, tmp_path, policy)
    _slow_disk(engine, 5.0)
    engine.add(text + [1], max_tokens=2, request_id="again")
    engine.run()
    _assert_disk_outcome(engine, policy, "cost_declined_tokens_slower")
    data = engine.stats.data
    assert "counter_regressions" not in data  # a claim predicted slower is a loss, never a saving moved back
    if policy == "load-all":  # two 5 s promotions against 0.26 s of compute each
        assert data["cost_predicted_lost_seconds"] > 5.0
    else:
        assert "cost_predicted_lost_seconds" not in data


@pytest.mark.parametrize("policy", ["cost-model", "load-all"])
def test_a_promotion_the_cut_declines_is_never_issued(make_engine, tmp_path, policy):
    """The cut decides before the lookup reserves or promotes anything: a declined disk chunk is never read (it would
    take the disk from the claims that need it and evict arena chunks for bytes nobody loads). Load-all, the
    control, promotes and loads every one."""
    engine, text = _disk_engine(make_engine, tmp_path, policy)
    _slow_disk(engine, 5.0)
    before = engine.stats.data.get("promotions_disk", 0)
    engine.add(text + [1], max_tokens=2, request_id="again")
    engine.run()
    promoted = engine.stats.data.get("promotions_disk", 0) - before
    assert promoted == 0 if policy == "cost-model" else promoted >= 2
    _assert_disk_outcome(engine, policy, "cost_declined_tokens_slower")


def test_a_declined_tier_is_measured_again_by_a_probe_that_no_request_waits_for(make_engine, tmp_path, monkeypatch):
    """Every PROBE_EVERY-th decision that declines a slow tier promotes its chunks anyway: the disk's speed is timed
    again (a disk that got faster would be seen), while the request still computes them and never waits."""
    monkeypatch.setattr(cut_point, "PROBE_EVERY", 1)
    engine, text = _disk_engine(make_engine, tmp_path, "cost-model")
    _slow_disk(engine, 5.0)
    disk = engine.connector.scheduler_half.cut.model.tiers[Path.DISK]
    observations, before = disk.fit.observations, engine.stats.data.get("promotions_disk", 0)
    engine.add(text + [1], max_tokens=2, request_id="again")
    engine.run()
    data = engine.stats.data
    assert data["cost_probe_lookups"] == 1 and data.get("promotions_disk", 0) - before >= 2
    assert disk.fit.observations > observations  # the workers timed the probe's reads
    _assert_disk_outcome(engine, "cost-model", "cost_declined_tokens_slower")  # claimed nothing, computed all


def test_asking_again_keeps_the_standing_decision_and_locates_once(make_engine, tmp_path, monkeypatch):
    """While a request waits for its promotions vLLM asks every step: the decision made on the first `locate`
    stands, so later asks look up its claim without locating again (the control: the lookups it did make)."""
    engine, text = _disk_engine(make_engine, tmp_path, "cost-model")
    gate = threading.Event()
    for worker in engine.workers:
        disk = worker.worker_half.executor.disk
        monkeypatch.setattr(disk, "read_into",
                            lambda name, out, read=disk.read_into: (gate.wait(60), read(name, out))[1])
    index = engine.connector.scheduler_half.index
    calls = {"locate": 0, "lookup": 0}
    for verb in calls:
        monkeypatch.setattr(index, verb, lambda *a, _verb=verb, _real=getattr(index, verb): (
            calls.__setitem__(_verb, calls[_verb] + 1), _real(*a))[1])
    try:
        engine.add(text + [1], max_tokens=2, request_id="again")
        for _ in range(3):
            engine.step()
    finally:
        gate.set()
    engine.run()
    assert calls["locate"] == 1 and calls["lookup"] >= 3
    assert engine.loaded_tokens["again"] >= 2 * CHUNK
    assert_quiescent(engine)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_slow_promotion_hides_behind_the_prefills_ahead_of_its_request(make_engine, tmp_path, ahead):
    """The disk promotes a chunk in 0.5 s, the engine computes one in 0.26 s: alone (the control) the request
    computes its three disk chunks; behind a 3000-token prefill that runs first (about 2 s), the promotions land
    while it runs, so the cut claims them and the request loads them."""
    engine, text = _disk_engine(make_engine, tmp_path, "cost-model")
    _slow_disk(engine, 0.5)
    if ahead:
        engine.add(prompt(3000, seed=76), max_tokens=2, request_id="long")
    engine.add(text + [1], max_tokens=2, request_id="again")
    engine.run()
    if ahead:
        assert engine.loaded_tokens["again"] >= 2 * CHUNK
        assert engine.stats.data["cost_claimed_tokens_faster"] >= 2 * CHUNK
    else:
        _assert_disk_outcome(engine, "cost-model", "cost_declined_tokens_slower")
    assert_quiescent(engine)


@pytest.mark.parametrize("policy", ["cost-model", "load-all"])
def test_a_promotion_later_than_the_deadline_is_computed_instead(make_engine, tmp_path, monkeypatch, policy):
    """The disk is fast as far as the model knows, so the request waits for its promotions; they hang, the clock
    passes the deadline, and the request computes instead (load-all, the negative control, keeps waiting and loads
    once the disk answers)."""
    engine, text = _disk_engine(make_engine, tmp_path, policy)
    gate = threading.Event()
    for worker in engine.workers:
        disk = worker.worker_half.executor.disk
        monkeypatch.setattr(disk, "read_into",
                            lambda name, out, read=disk.read_into: (gate.wait(60), read(name, out))[1])
    try:
        half = engine.connector.scheduler_half
        engine.add(text + [1], max_tokens=2, request_id="again")
        engine.step()
        decision = half.cut._decisions["again"]
        assert decision.deadline is not None and decision.cut.chunks >= 2  # it waits for the disk
        clock = half.cut.clock
        late = decision.deadline + 1.0
        half.cut.clock = lambda: max(clock(), late)  # the promotions are past their deadline
        for _ in range(3):
            engine.step()
        if policy == "cost-model":
            assert engine.requests["again"].num_computed_tokens > 0  # it computes, not waits
    finally:
        gate.set()
    engine.run()
    _assert_disk_outcome(engine, policy, "cost_declined_tokens_late")


@pytest.mark.parametrize("policy", ["cost-model", "load-all"])
def test_a_disk_slower_than_computing_gets_no_new_chunks(make_engine, tmp_path, policy):
    """Slow-tier admission (issue 40 item 4): once the disk is known to read a chunk back slower than computing it,
    the model writes no new chunk there (neither write-through nor spill); load-all, the control, writes them all.
    The arena's stores are never gated: the next turn still hits them."""
    slot = _engine(make_engine, policy).workers[0].worker_half.executor.arena.slot_bytes
    engine = _engine(make_engine, policy, cpu_bytes=2 * slot, disk_path=str(tmp_path), disk_bytes="64MiB")
    SyntheticSteps(engine)
    _warm_up(engine)
    _slow_disk(engine, 5.0)
    before = dict(engine.stats.data)
    text = prompt(3 * CHUNK + 10, seed=74)
    engine.add(text, max_tokens=2, request_id="a")
    engine.run()
    engine.add(prompt(3 * CHUNK + 10, seed=75), max_tokens=2, request_id="b")  # evicts a's chunks
    engine.run()
    data = engine.stats.data
    written = sum(data.get(k, 0) - before.get(k, 0) for k in ("spills", "disk_persists"))
    if policy == "cost-model":
        assert written == 0 and data["cost_declined_disk_writes"] >= 3
    else:
        assert written >= 3 and "cost_declined_disk_writes" not in data
    engine.add(prompt(3 * CHUNK + 10, seed=75) + [1], max_tokens=2, request_id="b again")
    engine.run()
    assert engine.loaded_tokens["b again"] >= CHUNK  # the arena kept b's stores either way
    assert_quiescent(engine)


def test_arena_chunks_another_request_is_still_writing_are_waited_for_a_step_not_given_up_at_once():
    """The first sweep found every request of a wave computing the shared system prompt: its chunks were in the
    arena but still being written by the wave's first request, the engine had just gone idle (no step floor), so the
    deadline was the decision itself. Now a claim of such chunks waits for their writer's step and store copy."""
    from lmcache_npu.store.commands import Tier
    from lmcache_npu.store.index.contract import LookupResult
    from lmcache_npu.store.tier import TierCounters

    clock = [100.0]
    cut = cut_point.CutPoint("cost-model", 8192, TierCounters(), clock=lambda: clock[0])
    cut.model.set_geometry(1 << 20, "cpu")
    cut.model.compute.fit = type(cut.model.compute.fit)(seed=(0.0, 1e-3, 0.0), scales=(1.0, 1024.0, 1048576.0),
                                                        prior_weight=1e-3)  # 1 ms a token: loading pays
    cut.model.compute.fit._count = cut.model.compute.fit._weight = 1000  # fitted, its seed untouched
    cut.model.compute.recent_step_s = 0.3  # the wave's steps; the engine is idle at this decision
    writing = LookupResult(4, 0, (Tier.ARENA,) * 4)
    answer = cut.decide("r", cut_point.hit_shape(0, 4 * 256 + 10, 0, 256, writing), writing)
    decision = cut._decisions["r"]
    assert decision.reason == "faster" and decision.cut.chunks == 4 and answer.pending
    assert decision.deadline - clock[0] >= 0.6  # the writer's step, then the request's own
    clock[0] += 0.1  # still being written one step later: waited for, not given up
    assert cut.decide("r", cut_point.hit_shape(0, 4 * 256 + 10, 0, 256, writing), writing).hit_chunks == 4
    clock[0] += 10.0  # control: a writer that never finishes is given up once the deadline passed
    assert cut.decide("r", cut_point.hit_shape(0, 4 * 256 + 10, 0, 256, writing), writing).hit_chunks == 0


def test_the_prefills_ahead_are_the_running_ones_and_the_waiting_ones_that_came_first():
    """First come, first served: a request's wait hides behind the running requests' prompts and those of waiting
    requests that arrived before it, never behind later arrivals (the control: `late`), and a load's claimed
    tokens are not compute."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    def request(arrival: float, status: RequestStatus, computed: int, prompt: int) -> SimpleNamespace:
        return SimpleNamespace(arrival_time=arrival, status=status, num_computed_tokens=computed,
                               num_prompt_tokens=prompt)

    unfinished = {
        "me": (request(5.0, RequestStatus.WAITING, 0, 900), 0),
        "running later": (request(7.0, RequestStatus.RUNNING, 100, 600), 0),
        "early": (request(1.0, RequestStatus.WAITING_FOR_REMOTE_KVS, 0, 800), 512),  # loads 512, computes the rest
        "late": (request(9.0, RequestStatus.WAITING, 0, 5000), 0),
    }
    spans = cut_point.prefills_ahead("me", unfinished)
    assert sorted(spans) == [(100, 600), (512, 800)]
    assert cut_point.prefills_ahead("unknown", unfinished) == [(0, 900), (100, 600), (512, 800), (0, 5000)]
