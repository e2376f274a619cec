"""The node cache dying in the middle of a scheduler step, on vLLM's real scheduler with simulated workers: commands
the step's plans already name are never forgotten. A load promised just before the death is refused, so vLLM
recomputes the request (every row its forward reads checked against the simulated model); a store handed out just
before it settles as failed, so the finished request's delayed free is reported and every block comes back. The
controls, without the death, load and store through the node."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from lmcache_npu.store.commands import Tier
from lmcache_npu.store.metrics import Metric

from .conftest import assert_engine_settled, prompt
from .test_node_cache_sim import _engine

STEPS = 300  # far more than either scenario needs; a lost command would keep the engine busy for all of them


def _settled(engine: Any) -> None:
    """Nothing waits and nothing leaked, whether or not the node is still there: vLLM's requests are done with every
    block free, the scheduler half tracks no request or command, the workers wait for no answer."""
    assert_engine_settled(engine)
    half = engine.connector.scheduler_half
    assert half.index.in_flight == 0 and not half.index.queued_commands()
    for worker in engine.workers:
        wh = worker.worker_half
        assert not wh._recv and not wh._sends and not wh._owner and not wh._stores, "a worker still waits"


def _kill_after(engine: Any, verb: str, service: Any) -> list[str]:
    """The node cache dies right after the first `verb` of `engine`'s scheduler was answered (the request ids it
    was answered for are returned); the engine finds out with its next call."""
    client = engine.connector.scheduler_half.index
    real = getattr(client, verb)
    seen: list[str] = []

    def answered_then_gone(request_id: str, chunks: Any) -> Any:
        moves = real(request_id, chunks)
        if not seen and moves:
            seen.append(request_id)
            service.close()
        return moves

    setattr(client, verb, answered_then_gone)
    return seen


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dies", [False, True], ids=["control", "dies"])
def test_a_load_promised_just_before_the_node_died_is_recomputed(make_engine, node, world: int,  # noqa: F811
                                                                 dies: bool) -> None:
    service, path = node
    writer = _engine(make_engine, "llama3-8b", path, world=world)
    reader = _engine(make_engine, "llama3-8b", path, world=world)
    chunk = writer.connector.scheduler_half.chunk_tokens
    first = prompt(2 * chunk + chunk // 2, seed=51)
    writer.add(first, max_tokens=2, request_id="first")
    writer.run()
    writer.connector.scheduler_half.index.sync()  # the writer's answers (one-way) reached the node: committed
    killed = _kill_after(reader, "prepare_load", service) if dies else []
    reader.add(first + prompt(chunk // 2, seed=52), max_tokens=3, request_id="second")
    reader.run(max_steps=STEPS)  # the old client lost the loads: "second" waited for its KV forever
    request = reader.requests["second"]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED and len(reader.output_tokens("second")) == 3
    failures = reader.stats.data.get("load_failures", 0)
    if dies:
        assert killed == ["second"] and failures == 2 * world  # both chunks refused on every rank: recomputed
        assert half_disconnected(reader)
    else:
        assert reader.loaded_tokens["second"] == 2 * chunk and failures == 0  # control: the node's chunks loaded
    _settled(reader)


@pytest.mark.parametrize("dies", [False, True], ids=["control", "dies"])
def test_stores_handed_out_just_before_the_node_died_settle_and_every_block_comes_back(make_engine, node,  # noqa: F811
                                                                                    dies: bool) -> None:
    service, path = node
    engine = _engine(make_engine, "llama3-8b", path)
    chunk = engine.connector.scheduler_half.chunk_tokens
    killed = _kill_after(engine, "prepare_store", service) if dies else []
    for name, seed in (("a", 61), ("b", 62)):  # both prefill in the first step: two prepare_store calls in one step
        engine.add(prompt(chunk + chunk // 4, seed=seed), max_tokens=2, request_id=name)
    engine.run(max_steps=STEPS)  # the old client lost a's stores: its delayed free was never reported
    assert all(len(engine.output_tokens(name)) == 2 for name in ("a", "b"))
    if dies:
        assert killed == ["a"] and half_disconnected(engine)
        assert engine.stats.data.get("store_failures", 0) == 1  # a's store, refused on its rank
    else:
        (pool,) = service.pools.values()
        assert pool.index.occupancy()[Tier.ARENA][0] == 2  # control: both requests' chunks reached the node
    _settled(engine)


def half_disconnected(engine: Any) -> bool:
    client = engine.connector.scheduler_half.index
    return client.epoch is None and client.counters[Metric.NODE_CACHE_DISCONNECTS] == 1
