"""The plugin inside vLLM's MultiConnector beside a P/D connector (pd_stub.py, NixlConnector's shape), in either
order, on vLLM's real scheduler: the engine starts (each child gets the handshake it expects), the plugin's plans
reach its scheduler half with the workers' first step, its hits load the right rows, and a request whose prompt a
prefill engine sends is left to the P/D connector even where the plugin holds part of it. The cost model's step echo
and transfer timings travel in the same worker metadata as the plans."""

from __future__ import annotations

import itertools

import pytest

from lmcache_npu.integration.vllm import adapter
from lmcache_npu.integration.vllm.metadata import LMCacheNPUConnectorMetadata, LMCacheNPUWorkerMetadata
from lmcache_npu.store.cost import Path, TransferSample
from lmcache_npu.store.metrics import Metric

from .conftest import assert_quiescent, prompt
from .pd_stub import StubHandshake

ORDERS = ["before", "after"]  # where the P/D stand-in sits: first (as NIXL usually is) or after the plugin


def _stored_then_evicted(engine, tokens: list[int]) -> None:
    """A first request stores the prompt's chunks; vLLM then forgets its own prefix cache."""
    engine.add(tokens, max_tokens=2, request_id="first")
    engine.run()
    engine.evict_device_cache()


@pytest.mark.parametrize("beside", ORDERS)
def test_the_plugin_composes_beside_a_pd_connector_in_either_order(make_engine, beside):
    engine = make_engine(beside=beside)
    assert engine.pd_stub is not None and engine.pd_stub.handshakes is not None
    assert all(isinstance(m, StubHandshake) for m in engine.pd_stub.handshakes.values())  # only its own
    assert engine.workers[0].get_handshake_metadata() is None  # the plugin's plan is not in the shared handshake
    half = engine.connector.scheduler_half
    assert half.index is None  # no plan yet: it comes with the workers' first step

    chunk = engine.workers[0].worker_half.layout.plan.chunk_tokens
    tokens = prompt(3 * chunk + 17, seed=1)
    _stored_then_evicted(engine, tokens)
    assert half.index is not None and half.composed
    engine.add(tokens, max_tokens=2, request_id="again")
    engine.run()  # every step checks the rows each forward reads against the simulated model's
    assert engine.loaded_tokens["again"] == 3 * chunk
    assert engine.pd_stub.served == []
    assert engine.stats.data.get(Metric.HIT_TOKENS) == 3 * chunk
    assert_quiescent(engine)


def test_workers_send_their_plan_until_the_scheduler_has_it(make_engine):
    engine = make_engine(beside="before")
    worker = engine.workers[0]
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, LMCacheNPUWorkerMetadata) and set(meta.geometries) == {0}
    assert meta.geometries[0].composed
    assert isinstance(worker.build_connector_worker_meta(), LMCacheNPUWorkerMetadata)  # again: not yet acknowledged
    worker.bind_connector_metadata(LMCacheNPUConnectorMetadata(geometry_known=True))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    assert worker.build_connector_worker_meta() is None  # acknowledged, and nothing else to say


def test_a_lookup_asks_again_until_the_plans_arrive_and_then_not_for_ever(make_engine):
    engine = make_engine(beside="after")
    half = engine.connector.scheduler_half
    request_id = engine.add(prompt(300, seed=2), max_tokens=1)
    request = engine.requests[request_id]
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    for _ in range(8):  # outputs that never carry the plans (a worker that cannot report)
        half.update_connector_output(type("Output", (), {"kv_connector_worker_meta": None})())
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)


@pytest.mark.parametrize("beside", ORDERS)
@pytest.mark.parametrize("deferring", [True, False])
def test_a_request_the_prefill_engine_sends_is_left_to_the_pd_connector(make_engine, monkeypatch, beside, deferring):
    if not deferring:  # negative control: the plugin answers such a request as any other
        monkeypatch.setattr(adapter, "remote_prefill", lambda request: False)
    engine = make_engine(beside=beside)
    chunk = engine.workers[0].worker_half.layout.plan.chunk_tokens
    tokens = prompt(3 * chunk + 17, seed=3)
    _stored_then_evicted(engine, tokens)  # the plugin holds the prompt's chunks
    engine.add(tokens, max_tokens=2, request_id="handed-off", kv_transfer_params={"do_remote_prefill": True})
    engine.run()  # rows checked every step: whoever serves it delivers the prefill engine's rows
    hit_tokens = engine.stats.data.get(Metric.HIT_TOKENS, 0)
    if deferring or beside == "before":  # the stand-in first claims it whatever the plugin says
        assert engine.pd_stub.served == ["handed-off"]
        assert engine.loaded_tokens["handed-off"] == len(tokens) - 1
        assert hit_tokens == 0
    else:  # the hazard the deferral removes: the prefill engine's blocks would wait for a read that never comes
        assert engine.pd_stub.served == []
        assert hit_tokens == 3 * chunk
    # MultiConnector asks every child whoever comes first: the plugin counts the request it left in either order
    assert engine.stats.data.get(Metric.REMOTE_PREFILL_DEFERRED, 0) == (1 if deferring else 0)
    assert_quiescent(engine)


def test_aggregate_keeps_every_ranks_plan_beside_its_steps_and_timings():
    plan0, plan1 = object(), object()  # stand-ins: aggregate only files them by rank
    sample = TransferSample(Path.LOAD, 2, 2048, 0, 0.5, True)
    rank0 = LMCacheNPUWorkerMetadata(geometries={0: plan0}, steps=[7], timings=[sample])
    rank1 = LMCacheNPUWorkerMetadata(geometries={1: plan1}, steps=[7, 8])
    merged = rank0.aggregate(rank1)
    assert merged.geometries == {0: plan0, 1: plan1}
    assert merged.steps == [7, 7, 8] and merged.timings == [sample]
    assert merged.completions == [] and merged.usable_slots == {} and merged.node_epochs == {}


@pytest.mark.parametrize("beside", ORDERS)
@pytest.mark.parametrize("echo", [True, False])
def test_the_step_echo_reaches_the_cost_model_beside_the_plans(make_engine, monkeypatch, beside, echo):
    """Inside a MultiConnector the workers' metadata carries the plans (they build the index) and the steps they ran
    (they time the cost model's compute side). Negative control: a scheduler that numbers no step gets no echo, and
    its model times nothing."""
    engine = make_engine(beside=beside)
    half = engine.connector.scheduler_half
    ticks = itertools.count()
    half.cut.clock = lambda: float(next(ticks))  # strictly increasing: an echoed step always takes some time
    if not echo:
        monkeypatch.setattr(half.cut, "on_step", lambda scheduler_output: None)
    engine.add(prompt(300, seed=4), max_tokens=4, request_id="a")
    engine.run()
    assert half.index is not None and half.composed  # the plans arrived, with the workers' first step
    timed = half.cut.model.compute.fit.observations
    assert timed > 0 if echo else timed == 0
    assert_quiescent(engine)
