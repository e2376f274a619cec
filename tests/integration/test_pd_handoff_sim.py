"""P/D through the node cache on vLLM's real scheduler with simulated workers (tests/integration/engine.py): a prefill
engine asked for a hand-off stores the prompt, its partial last chunk too, and answers the keys and its lease in
kv_transfer_params; a decode engine on the same node given that answer waits while the prefill engine is still
storing (a pending hit, never a miss), then loads every token but the last, every row its forward reads checked
against the simulated model. Controls: a wrong lease or a decode engine that does not wait (handoff_wait_ms 0)
computes the prompt; a hand-off whose tail hash is corrupted loads the whole chunks only; a decode engine that loads
rows one token late is caught by the row check."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from lmcache_npu.integration.vllm.adapter import HANDOFF_PARAMS_KEY
from lmcache_npu.node.service import NodeCacheService
from lmcache_npu.store.metrics import Metric
from lmcache_npu.transfer import mover

from ..late_rows import loads_one_token_late
from .conftest import preset_engine, prompt

ASK = {HANDOFF_PARAMS_KEY: {"do_remote_decode": True}}


def _engine(make_engine: Any, path: str, **extra: Any) -> Any:
    return preset_engine(make_engine, "llama3-8b", "ascend",
                         extra_config={"node_cache": path, "node_cache_start_wait_ms": 60_000, **extra})


class HeldCompletions:
    """An engine's workers keep their completions to themselves until `release()`: the node sees its stores in
    flight for as long as a test wants (a prefill engine whose stores have not committed yet)."""

    def __init__(self, engine: Any) -> None:
        self.held: list[Any] = []
        self.closed = True
        for worker in engine.workers:
            executor = worker.worker_half.executor
            executor.poll = self._holding(executor.poll)

    def _holding(self, poll: Any) -> Any:
        def held_poll(*args: Any) -> list:
            done = list(poll(*args))
            if self.closed:
                self.held += done
                return []
            done, self.held = self.held + done, []
            return done

        return held_poll

    def release(self) -> None:
        self.closed = False


def _answers(engine: Any) -> dict[str, Optional[dict]]:
    """The kv_transfer_params each finished request of `engine` answered (what vLLM hands the proxy)."""
    told: dict[str, Optional[dict]] = {}
    half = engine.connector.scheduler_half
    finished = half.request_finished

    def spy(request: Any, block_ids: Any) -> Any:
        delay, params = finished(request, block_ids)
        told[request.request_id] = params
        return delay, params

    half.request_finished = spy
    return told


def _prefill(engine: Any, tokens: list[int]) -> dict:
    """Runs the prefill leg (max_tokens 1, the ask) until the request finished; its stores stay in flight."""
    told = _answers(engine)
    engine.add(tokens, max_tokens=1, request_id="p", kv_transfer_params=ASK)
    for _ in range(50):
        engine.step()
        if "p" in told:
            break
    params = told["p"]
    assert params is not None and set(params) == {HANDOFF_PARAMS_KEY}, params
    return params


def _stat(engine: Any, metric: Metric) -> float:
    return engine.stats.data.get(metric, 0)


def _pd(make_engine: Any, node: tuple[NodeCacheService, str], seed: int, *, wait_ms: int = 60_000,
        edit: Any = None) -> tuple[Any, Any, list[int], int]:
    """Prefill (stores held in flight), then the decode engine's first three steps, then the stores commit and both
    run to the end. (prefill engine, decode engine, tokens, decode 'ask again' answers while the stores were held)."""
    service, path = node
    prefill, decode = _engine(make_engine, path), _engine(make_engine, path, handoff_wait_ms=wait_ms)
    chunk = prefill.connector.scheduler_half.chunk_tokens
    tokens = prompt(2 * chunk + chunk // 3, seed=seed)
    held = HeldCompletions(prefill)
    params = _prefill(prefill, tokens)
    (pool,) = service.pools.values()
    assert len(pool.writing) == 3  # two whole chunks and the tail, none committed
    decode.add(tokens, max_tokens=3, request_id="d", kv_transfer_params=edit(params) if edit else params)
    for _ in range(3):
        decode.step()
    waits = _stat(decode, Metric.HANDOFF_WAITS)
    held.release()
    prefill.run()
    decode.run()
    return prefill, decode, tokens, waits


def test_the_decode_engine_waits_for_the_prefill_engines_stores_then_loads_all_but_the_last_token(make_engine,
                                                                                                   node) -> None:
    prefill, decode, tokens, waits = _pd(make_engine, node, seed=5)
    assert waits == 3 and "d" in decode.loaded_tokens  # a pending hit each step, never a miss
    assert decode.loaded_tokens["d"] == len(tokens) - 1  # every row read was checked against the model
    assert _stat(decode, Metric.HANDOFFS_RECEIVED) == 1 and _stat(decode, Metric.HIT_TOKENS) == len(tokens) - 1
    assert _stat(prefill, Metric.HANDOFF_TAIL_CHUNKS) == 1 and _stat(prefill, Metric.HANDOFFS_SENT) == 1
    assert decode.connector.scheduler_half.index.counters.snapshot().get("stores", 0) == 0  # one copy: the prefill's


def test_negative_control_a_wrong_lease_is_a_miss_and_the_prompt_is_computed(make_engine, node) -> None:
    def wrong_lease(params: dict) -> dict:
        told = dict(params[HANDOFF_PARAMS_KEY])
        told["writer"] = [told["writer"][0], "0" * 32]
        return {HANDOFF_PARAMS_KEY: told}

    _, decode, _, waits = _pd(make_engine, node, seed=6, edit=wrong_lease)
    assert waits == 0 and decode.loaded_tokens.get("d", 0) == 0


def test_negative_control_a_decode_engine_that_does_not_wait_computes_the_prompt(make_engine, node) -> None:
    _, decode, _, waits = _pd(make_engine, node, seed=7, wait_ms=0)
    assert waits == 1 and _stat(decode, Metric.HANDOFFS_EXPIRED) == 1  # asked once, then gave up
    assert decode.loaded_tokens.get("d", 0) == 0


def test_a_corrupted_tail_hash_is_never_loaded_the_whole_chunks_are(make_engine, node) -> None:
    def corrupted_tail(params: dict) -> dict:
        told = dict(params[HANDOFF_PARAMS_KEY])
        told["tail"] = ("1" if told["tail"][0] == "0" else "0") + told["tail"][1:]
        return {HANDOFF_PARAMS_KEY: told}

    prefill, decode, _, waits = _pd(make_engine, node, seed=8, edit=corrupted_tail)
    assert waits == 3 and decode.loaded_tokens["d"] == 2 * prefill.connector.scheduler_half.chunk_tokens


def test_negative_control_rows_loaded_one_token_late_fail_the_row_check(make_engine, node, monkeypatch) -> None:
    monkeypatch.setattr(mover.KVMover, "_cut_runs", loads_one_token_late(mover.KVMover._cut_runs))
    with pytest.raises(AssertionError, match="before d"):
        _pd(make_engine, node, seed=9)


def test_a_malformed_hand_off_is_refused_by_name_and_the_request_served(make_engine, node) -> None:
    _, path = node
    decode = _engine(make_engine, path)
    decode.add(prompt(300, seed=10), max_tokens=2, request_id="d",
               kv_transfer_params={HANDOFF_PARAMS_KEY: {"writer": "prefill", "chunks": []}})
    decode.run()
    assert decode.output_tokens("d") and _stat(decode, Metric.HANDOFFS_REFUSED) == 1
    assert decode.loaded_tokens.get("d", 0) == 0
