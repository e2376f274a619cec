"""Speculative decoding in the simulated engine (vLLM 0.23's real scheduler, simulated model): DeepSeek-V3 served with
one MTP layer (its planes in the target's MLA group, stored with the rest).

Hook order. Without a drafter vLLM runs forward -> `wait_for_save` -> `get_finished` -> `clear_connector_metadata`.
With one (`finalize_kv_connector`) it runs forward -> `get_finished` -> the drafter's forward (it writes the MTP
layer's rows) -> `wait_for_save` -> `clear_connector_metadata`. Both orders must give exact loads (every step
checks every row the next forward reads, MTP rows included), report each request's stores finished once, only after
every store command of it completed, and lose none (the engine settles). Negative control: a worker that reports the
step's stores from `get_finished` (queued and completed there, before `wait_for_save`) stores MTP rows the drafter
had not written yet, and the next hit's check sees them.

EAGLE/MTP hits. With an EAGLE-family drafter a hit claims only chunks followed by one more held chunk
(scheduler.py's docstring): the claimed tokens end one chunk before what the index holds.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.v1.outputs import KVConnectorOutput

from lmcache_npu.integration.vllm import LMCacheNPUConnector, adapter, scheduler
from lmcache_npu.tools.presets.catalog import MODELS, with_mtp

from lmcache_npu.ops import Direction

from .engine import Engine, EngineSpec
from .sim import SimModel
from .wrappers import Slow, wrap

MTP_V3 = with_mtp(MODELS["deepseek-v3"])
FORWARD_THEN_FINISHED = "forward, wait_for_save, get_finished"
FINISHED_THEN_DRAFT = "forward, get_finished, draft forward, wait_for_save"


def _planes_of(sim: SimModel, keep) -> SimModel:
    """A view of `sim` that writes only the planes whose layer `keep` accepts (same bytes as the full model)."""
    part = SimModel(sim.rank, sim.layout)
    part.planes = {g: [rows for rows in planes if keep(rows.plane.name.split(":", 1)[0])]
                   for g, planes in sim.planes.items()}
    return part


def _is_mtp(layer: str) -> bool:
    return layer.startswith("model.layers.61.")  # DeepSeek-V3's MTP layer follows its 61 decoder layers


class DraftingEngine(Engine):
    """The simulated engine in either hook order; the drafter's forward writes the MTP layer's rows. Every
    `finished_sending` is checked against the store commands each worker was given and completed."""

    def __init__(self, spec: EngineSpec, order: str, worker_factory: Optional[Any] = None) -> None:
        super().__init__(spec, worker_factory)
        self.order = order
        self.targets = [_planes_of(sim, lambda layer: not _is_mtp(layer)) for sim in self.sims]
        self.drafters = [_planes_of(sim, _is_mtp) for sim in self.sims]
        assert all(any(d.planes.values()) for d in self.drafters), "the preset has no MTP planes"
        self.planned: list[dict[str, set[int]]] = [{} for _ in self.workers]  # rank -> request -> store cmd ids
        self.completed: list[set[int]] = [set() for _ in self.workers]
        self.reported: list[dict[str, int]] = [{} for _ in self.workers]  # finished_sending reports per request

    def _forward(self, sims: list[SimModel], rank: int, scheduled: list, starts: dict) -> None:
        for request, count in scheduled:
            start = starts[request.request_id]
            sims[rank].forward(self._hashes(request), self.runners[rank].tables[request.request_id], start,
                               start + count)

    def _execute(self, so: Any) -> Any:
        meta = so.kv_connector_metadata
        scheduled, starts, samples = self._plan_step(so)
        outputs = []
        flipped = self.order == FINISHED_THEN_DRAFT
        for rank, (worker, runner) in enumerate(zip(self.workers, self.runners)):
            for plan in meta.stores:
                self.planned[rank].setdefault(plan.request_id, set()).update(plan.cmd_ids)
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            runner.update(so)
            forward = bool(so.total_num_scheduled_tokens)
            if forward:
                self.check([(req, starts[req.request_id]) for req, _ in scheduled], f"step {self.steps} before",
                           [rank])
                self._forward(self.targets, rank, scheduled, starts)
                if not flipped:
                    self._forward(self.drafters, rank, scheduled, starts)
                    worker.wait_for_save()
            sending, recving = worker.get_finished(so.finished_req_ids)
            worker_meta = worker.build_connector_worker_meta()
            self._check_sending(rank, sending, worker_meta)
            kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                    kv_connector_stats=worker.get_kv_connector_stats(),
                                    kv_connector_worker_meta=worker_meta,
                                    invalid_block_ids=worker.get_block_ids_with_load_errors())
            kvo = pickle.loads(pickle.dumps(kvo))
            if forward and flipped:  # finalize_kv_connector: after the drafter's forward
                self._forward(self.drafters, rank, scheduled, starts)
                worker.wait_for_save()
            worker.clear_connector_metadata()
            outputs.append(self._runner_output(so, scheduled, samples, kvo))
        for req_id, new in samples.items():
            self.pending.setdefault(req_id, []).extend(new)
        return self.aggregator.aggregate(outputs)

    def _check_sending(self, rank: int, sending: Optional[set[str]], worker_meta: Any) -> None:
        """A request is reported once, and only after every store command it was given completed on this rank."""
        if worker_meta is not None:
            self.completed[rank].update(c.cmd_id for c in worker_meta.completions)
        for request_id in sending or ():
            left = self.planned[rank].get(request_id, set()) - self.completed[rank]
            if left:
                self.problems.append(f"rank {rank}: {request_id} reported finished_sending with store commands "
                                     f"{sorted(left)[:4]} not completed")
            self.reported[rank][request_id] = self.reported[rank].get(request_id, 0) + 1
            if self.reported[rank][request_id] > 1:
                self.problems.append(f"rank {rank}: {request_id} reported finished_sending twice")
        if self.problems:
            raise AssertionError("\n".join(self.problems[:10]))


class ReportsStoresFromGetFinished(LMCacheNPUConnector):
    """Wrong in the drafting order: `get_finished` queues the step's stores and waits for them, so it can report
    them done at once, before `wait_for_save` (and before the drafter wrote its rows)."""

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        half = self.worker_half
        if half._stores and half.executor is not None:
            half.executor.submit(half._stores)
            half._stores = []
            assert half.executor.wait_idle(30.0), "the early stores did not complete"
        return super().get_finished(finished_req_ids)


def _spec(**overrides: Any) -> EngineSpec:
    settings_ = dict(preset=MTP_V3, max_layers=2, num_blocks=64, max_num_batched_tokens=512,
                     extra_config={"chunk_tokens": 256})
    settings_.update(overrides)
    return EngineSpec(**settings_)


def _run_twice(engine: DraftingEngine, prompts: list[list[int]], max_tokens: int = 3) -> list[str]:
    """Computes the prompts (one token each: they finish while their stores are still running, so vLLM keeps
    their blocks until finished_sending), forgets vLLM's own cache, and runs them again (hits from the plugin
    only)."""
    for tokens in prompts:
        engine.add(tokens, 1)
    engine.run()
    engine.evict_device_cache()
    again = [engine.add(tokens, max_tokens) for tokens in prompts]
    engine.run()
    return again


@pytest.mark.parametrize("order", [FORWARD_THEN_FINISHED, FINISHED_THEN_DRAFT])
def test_both_hook_orders_store_and_load_mtp_rows_exactly(order: str) -> None:
    engine = DraftingEngine(_spec(), order)
    wrap(engine, lambda b: Slow(b, Direction.STORE, seconds=0.05), Direction.STORE)
    try:
        prompts = [[7 + (i * 31 + j) % 900 for j in range(700)] for i in range(3)]
        again = _run_twice(engine, prompts)
        assert all(engine.loaded_tokens.get(r, 0) == 512 for r in again), engine.loaded_tokens
        reported = engine.reported[0]
        assert set(reported) >= set(engine.requests) - set(again), "a delayed free was never reported"
        assert all(n == 1 for n in reported.values())
        assert engine.stats.data.get("delayed_frees", 0) >= 3
        assert not engine.problems
    finally:
        engine.close()


def test_reporting_stores_from_get_finished_is_caught_in_the_drafting_order() -> None:
    """Negative control: the same run with a worker that reports its stores before `wait_for_save`."""
    engine = DraftingEngine(_spec(), FINISHED_THEN_DRAFT, worker_factory=ReportsStoresFromGetFinished)
    try:
        prompts = [[7 + (i * 31 + j) % 900 for j in range(700)] for i in range(2)]
        with pytest.raises(AssertionError, match=r"plane model\.layers\.61\.self_attn\.attn:.* differ"):
            _run_twice(engine, prompts)
    finally:
        engine.close()


def test_the_early_reporter_passes_in_the_plain_order() -> None:
    """The control is about the order: with `wait_for_save` before `get_finished` it has nothing to queue early."""
    engine = DraftingEngine(_spec(), FORWARD_THEN_FINISHED, worker_factory=ReportsStoresFromGetFinished)
    try:
        again = _run_twice(engine, [[11 + j % 800 for j in range(700)]])
        assert engine.loaded_tokens.get(again[0], 0) == 512
    finally:
        engine.close()


# ---- EAGLE/MTP: the hit ends one chunk before the last held chunk --------------------------------------------------

def _held_then_asked(stored_tokens: int, asked_tokens: int, drop: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    """Tokens the plugin loads for a prompt of `asked_tokens` after a prompt of `stored_tokens` (same tokens) was
    computed and stored; `drop`: with an EAGLE-family drafter."""
    monkeypatch.setattr(scheduler.adapter, "eagle_block_drop", lambda vllm_config: drop)
    engine = DraftingEngine(_spec(), FINISHED_THEN_DRAFT)
    try:
        base = [5 + (j * 7) % 950 for j in range(max(stored_tokens, asked_tokens))]
        engine.add(base[:stored_tokens], 1)
        engine.run()
        engine.evict_device_cache()
        request_id = engine.add(base[:asked_tokens], 2)
        engine.run()
        return engine.loaded_tokens.get(request_id, 0)
    finally:
        engine.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored_chunks=st.integers(1, 4), extra=st.integers(1, 255), asked_more=st.integers(0, 2))
def test_an_eagle_hit_claims_only_chunks_followed_by_a_held_chunk(stored_chunks: int, extra: int, asked_more: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 256
    stored = stored_chunks * chunk + extra  # chunks 0..stored_chunks-1 are stored
    asked = stored + asked_more * chunk
    held = stored_chunks
    loadable = (asked - 1) // chunk  # without a drafter: every held chunk before the last token's
    with_drop = _held_then_asked(stored, asked, True, monkeypatch)
    assert with_drop == min(loadable, held - 1) * chunk
    without = _held_then_asked(stored, asked, False, monkeypatch)
    assert without == min(loadable, held) * chunk
    assert with_drop < without  # the last held chunk is only the proof: never loaded with a drafter


def test_the_eagle_drop_is_read_from_vllms_speculative_config() -> None:
    class Spec:
        def __init__(self, method: str, drop: Optional[bool] = None) -> None:
            self.method, self._drop = method, drop

        def use_eagle(self) -> bool:
            return self.method in ("eagle", "eagle3", "mtp")

    class NewSpec(Spec):
        def use_eagle_block_drop(self) -> bool:
            return self.use_eagle() and bool(self._drop)

    class Config:
        def __init__(self, spec: Any) -> None:
            self.speculative_config = spec

    assert adapter.eagle_block_drop(Config(Spec("mtp")))
    assert not adapter.eagle_block_drop(Config(Spec("ngram")))
    assert not adapter.eagle_block_drop(Config(None))
    assert adapter.eagle_block_drop(Config(NewSpec("eagle", drop=True)))
    assert not adapter.eagle_block_drop(Config(NewSpec("eagle", drop=False)))  # disable_eagle_block_drop
