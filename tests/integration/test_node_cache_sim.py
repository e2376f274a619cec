"""Engines sharing one node cache, on vLLM's real scheduler with simulated workers (tests/integration/engine.py):
engine B loads the chunks engine A stored, every row its forward reads checked against the simulated model (both
engines' models give the same bytes for the same tokens), across model families and with two TP ranks; a private
cache finds nothing (the control). Every engine of the node names the node's chunks in its KV events."""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
from vllm.distributed.kv_events import BlockStored

from lmcache_npu.integration.vllm import scheduler as scheduler_module
from lmcache_npu.node import service as service_module
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.store.commands import Tier
from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.store.index.contract import SlotState

from ..kv_events_view import ours
from ..node.harness import check_invariants
from .conftest import assert_engine_settled, preset_engine, prompt
from .test_events import Recorder, request_chunks


def _engine(make_engine: Any, preset: str, path: str, **overrides: Any) -> Any:
    # a loaded CI host may take seconds to attach: these tests want the node from the first step
    return preset_engine(make_engine, preset, "ascend",
                         extra_config={"node_cache": path, "node_cache_start_wait_ms": 60_000}, **overrides)


def _store_then_load(writer: Any, reader: Any, seed: int) -> tuple[int, int]:
    """The writer computes a prompt; the reader is sent that prompt and more. (tokens the reader loaded, tokens it
    would load from a cache holding the writer's whole chunks)."""
    chunk = writer.connector.scheduler_half.chunk_tokens
    if writer.connector.scheduler_half.has_end_state:  # a recurrent state exists only where a step ends
        for engine in (writer, reader):
            engine.spec.max_num_batched_tokens = chunk
            engine.scheduler.max_num_scheduled_tokens = chunk
    first = prompt(2 * chunk + chunk // 2, seed=seed)
    writer.add(first, max_tokens=2, request_id="first")
    writer.run()
    writer.connector.scheduler_half.index.sync()  # one-way answers: the reader's lookup must not overtake them
    second = first + prompt(chunk // 2, seed=seed + 1)
    reader.add(second, max_tokens=3, request_id="second")
    reader.run()
    expected = min((len(first) + 1) // chunk, (len(second) - 1) // chunk) * chunk
    return reader.loaded_tokens.get("second", 0), expected


def _quiescent(engine: Any, service: NodeCacheService) -> None:
    """conftest's `assert_quiescent`, asked of the node: nothing in flight, reserved, pinned or half-written."""
    assert_engine_settled(engine)
    half = engine.connector.scheduler_half
    assert not half.fence.step_reads
    index = half.index
    check_invariants(service)  # the node's index, in the service's process
    assert index.in_flight == 0 and not index.queued_commands()
    chunks = index.chunks()
    assert not any(c.reservations for c in chunks) and all(c.readers == 0 for c in chunks)
    assert not {SlotState.WRITING, SlotState.READING} & {c.slot_state for c in chunks}


@pytest.mark.parametrize("preset, world", [("llama3-8b", 1), ("llama3-8b", 2), ("deepseek-v3", 1),
                                           ("gemma3-27b", 1), ("qwen3-next-80b", 1)])
def test_a_second_engine_loads_what_the_first_stored_through_the_node(make_engine, node, preset: str,
                                                                       world: int) -> None:
    service, path = node
    writer = _engine(make_engine, preset, path, world=world)
    reader = _engine(make_engine, preset, path, world=world)
    loaded, expected = _store_then_load(writer, reader, seed=11)
    assert loaded == expected > 0  # every row the reader's forward read was checked against its model
    (pool,) = service.pools.values()
    assert pool.geometry.world == world and len(pool.leases) == 2
    held = pool.index.occupancy()[Tier.ARENA][0]
    stored = [engine.connector.scheduler_half.index.counters.snapshot().get("stores", 0) for engine in (writer, reader)]
    chunk = reader.connector.scheduler_half.chunk_tokens
    reader_chunks = len(reader.requests["second"].all_token_ids) // chunk
    assert stored[1] <= reader_chunks - loaded // chunk  # the reader stored none of the writer's chunks again
    assert held == sum(stored)  # one copy on the node of each chunk either engine stored
    for engine in (writer, reader):
        _quiescent(engine, service)


def test_negative_control_engines_with_private_caches_find_nothing_of_each_other(make_engine, node) -> None:
    _, path = node
    writer = preset_engine(make_engine, "llama3-8b", "ascend")
    reader = _engine(make_engine, "llama3-8b", path)
    loaded, expected = _store_then_load(writer, reader, seed=21)
    assert expected > 0 and loaded == 0


def test_an_engine_that_goes_away_gives_back_what_it_held(make_engine, node) -> None:
    service, path = node
    writer = _engine(make_engine, "llama3-8b", path)
    reader = _engine(make_engine, "llama3-8b", path)
    _store_then_load(writer, reader, seed=31)
    (pool,) = service.pools.values()
    writer.close()  # its scheduler's and worker's connections close: the lease ends
    deadline = time.monotonic() + 10
    while len(pool.leases) > 1 and time.monotonic() < deadline:  # the service sees the connections go
        time.sleep(0.01)
    assert len(pool.leases) == 1
    pool.index.check_invariants()
    assert all(not view.reservations and view.readers == 0 for view in pool.index.chunks())


def test_every_engine_of_the_node_announces_the_chunks_another_stored(make_engine, node) -> None:
    _, path = node
    with mock.patch.object(scheduler_module, "kv_events_enabled", lambda vllm_config: True):
        writer = _engine(make_engine, "llama3-8b", path)
        reader = _engine(make_engine, "llama3-8b", path)
    recorders = [Recorder(), Recorder()]
    writer.scheduler.kv_event_publisher, reader.scheduler.kv_event_publisher = recorders
    chunk = writer.connector.scheduler_half.chunk_tokens
    tokens = prompt(2 * chunk + 10, seed=41)
    writer.add(tokens, max_tokens=2, request_id="a")
    writer.run()
    reader.add(prompt(chunk + 10, seed=42), max_tokens=2, request_id="b")  # a step of its own: the news arrives
    reader.run()
    announced = [[e for e in ours(r.events) if isinstance(e, BlockStored) and e.medium == "CPU"] for r in recorders]
    writer_chunks = [tuple(e.block_hashes) for e in announced[0]][:2]
    assert len(writer_chunks) == 2
    reader_chunks = {tuple(e.block_hashes): e for e in announced[1]}
    for chunk_hashes in writer_chunks:  # the reader names the writer's chunks, tokens and all
        assert chunk_hashes in reader_chunks
    first = reader_chunks[writer_chunks[0]]
    assert first.token_ids == tokens[:chunk] and first.parent_block_hash is None
    # and nothing else: every chunk the reader announced is the writer's or its own
    own = set(request_chunks(reader, "b", 1))
    assert set(reader_chunks) == set(writer_chunks) | own and not own & set(writer_chunks)


def _break_every_verb(patch: pytest.MonkeyPatch, fault: str) -> None:
    """Every verb of the real service fails its way (issue 39, H6): `error` raises in the verb (an index bug, a verb
    or argument of another release: the service answers ("error", ...)), `malformed` answers in another shape."""
    if fault == "error":
        def broken(*arguments: Any) -> Any:
            raise KeyError("injected: an index bug")

        for verb in list(service_module.VERBS):
            patch.setitem(service_module.VERBS, verb, broken)
    else:
        answer = NodeCacheService._answer
        patch.setattr(NodeCacheService, "_answer", lambda self, pool, lease, request: (
            lambda reply: None if reply is None else (*reply, "of another release"))(answer(self, pool, lease, request)))


@pytest.mark.parametrize("fault", ["error", "malformed"])
def test_an_engine_keeps_serving_through_a_service_that_answers_wrongly(make_engine, node, monkeypatch,
                                                                       fault: str) -> None:
    """The review's S3: a service-side error (or a reply of another shape) in any verb raised into vLLM's scheduler
    and stopped the engine. Now each is a miss and a counter vLLM's stats report; the rows are still checked every
    step (the engine recomputes), and once the fault is gone the same connection serves hits again (the control)."""
    service, path = node
    with mock.patch.object(scheduler_module, "kv_events_enabled", lambda vllm_config: True):  # sync, too
        writer = _engine(make_engine, "llama3-8b", path)
        reader = _engine(make_engine, "llama3-8b", path)
    writer.scheduler.kv_event_publisher, reader.scheduler.kv_event_publisher = Recorder(), Recorder()
    chunk = reader.connector.scheduler_half.chunk_tokens
    tokens = prompt(2 * chunk + chunk // 2, seed=51)
    writer.add(tokens, max_tokens=2, request_id="first")
    writer.run()
    with monkeypatch.context() as patch:
        _break_every_verb(patch, fault)
        reader.add(tokens, max_tokens=3, request_id="broken")
        reader.run()  # raised ValueError (error) or ValueError/TypeError (malformed) before
        reader.stats.reduce()  # vLLM's stat logger reads the reduced view every interval
    assert reader.loaded_tokens.get("broken", 0) == 0 and len(reader.output_tokens("broken")) == 3
    counted = reader.stats.data.get(f"node_cache_{fault}_replies", 0)
    assert counted > 0, reader.stats.data
    assert not reader.stats.data.get("node_cache_disconnects")
    reader.evict_device_cache()
    reader.add(tokens, max_tokens=2, request_id="healed")
    reader.run()
    assert reader.loaded_tokens.get("healed", 0) == 2 * chunk  # the control: hits through the same connection
    for engine in (writer, reader):
        _quiescent(engine, service)


def _restart(service: NodeCacheService, path: str) -> NodeCacheService:
    """The service dies and a successor (a new epoch) listens on the same path."""
    service.close()
    return NodeCacheService(ServiceOptions(path, NodeCapacity(256 << 20))).start()


def test_a_worker_never_runs_one_epochs_commands_against_anothers_pages(make_engine, node, monkeypatch) -> None:
    """The review's R7 (issue 39, H2): E1 -> E2 -> E3. The scheduler adopts E2 and sends its loads and stores; E2 dies
    and E3 is up when the worker, still on E1, follows: it maps E3, where those slots are other chunks' or empty.
    Before, the loads read E3's bytes into the request's pages (the step's row check fails) and the stores wrote
    E3's slots (its bytes change); now the worker refuses them, the load recomputes and the store is not made. (The
    scheduler waits for its workers to map an epoch before it hands out its commands: that wait is switched off here,
    so the worker's own check is what is tested.)"""
    from lmcache_npu.integration.vllm.scheduler import SchedulerHalf

    mapped = SchedulerHalf._node_mapped
    monkeypatch.setattr(SchedulerHalf, "_node_mapped", lambda half: half.index.epoch is not None)
    service, path = node
    engine = _engine(make_engine, "llama3-8b", path)
    half = engine.connector.scheduler_half
    client = half.index
    chunk = half.chunk_tokens
    worker_half = engine.workers[0].worker_half
    first_epoch = worker_half._node.epoch
    second = _restart(service, path)  # E2: another engine stores a prompt there
    other = _engine(make_engine, "llama3-8b", path)
    hit = prompt(2 * chunk + chunk // 2, seed=61)
    other.add(hit, max_tokens=2, request_id="other")
    other.run()
    client.retry_s, client._next_try = 0.0, 0.0
    deadline = time.monotonic() + 10
    while client.epoch != second.instance + "/0" and time.monotonic() < deadline:  # the scheduler adopts E2 ...
        client.presence([])
        time.sleep(0.01)
    assert client.epoch == second.instance + "/0" and worker_half._node.epoch == first_epoch  # ... its worker not yet
    client.retry_s = 3600.0  # the scheduler stays away from E3 for the rest of the test: only the worker maps it
    third: list[NodeCacheService] = []
    build = engine.connector.build_connector_meta

    def e2_dies_after_this_step_is_built(scheduler_output: Any) -> Any:
        meta = build(scheduler_output)
        step = [*meta.commands, *meta.load_moves(), *meta.store_moves()]
        if step and not third:
            assert {c.epoch for c in step} == {meta.node_epoch} == {client.epoch}
            third.append(_restart(second, path))  # E3, before the worker follows the step's epoch
            deadline = time.monotonic() + 10
            while worker_half._node.epoch != third[0].instance + "/0" and time.monotonic() < deadline:
                worker_half._node._next_try = 0.0
                worker_half._node.start(1.0)  # the worker maps E3 first (its background attach, done in time)
                time.sleep(0.01)
            assert worker_half._node.epoch == third[0].instance + "/0"
        return meta

    engine.connector.build_connector_meta = e2_dies_after_this_step_is_built
    engine.add(hit + prompt(10, seed=62), max_tokens=2, request_id="loads")  # 2 chunks hit in E2
    engine.add(prompt(chunk + 10, seed=63), max_tokens=2, request_id="stores")  # 1 chunk stored in E2
    engine.run()  # the row check of every step raised here before (E3's bytes loaded as the hit)
    assert third and worker_half._node.epoch != second.instance + "/0"  # E2 was never mapped here
    assert len(engine.output_tokens("loads")) == 2  # recomputed: every row its forward read was checked
    (pool,) = third[0].pools.values()  # only this worker maps E3: no byte of it may have changed
    arena = pool.arenas[0]
    assert not any(arena.slot_array(slot).any() for slot in range(arena.num_slots)), "E2's store wrote E3's slots"
    assert engine.stats.data.get("load_failures", 0) >= 1 and engine.stats.data.get("store_failures", 0) >= 1
    third[0].close()
    # the control: the same worker's own commands of E3's epoch do write E3's slots (the byte check sees a write)
    successor = _restart(third[0], path)
    client.retry_s, client._next_try = 0.0, 0.0
    engine.connector.build_connector_meta = build
    monkeypatch.setattr(SchedulerHalf, "_node_mapped", mapped)  # commands once the worker has mapped the epoch
    deadline = time.monotonic() + 10
    while (client.epoch is None or worker_half._node.epoch != client.epoch) and time.monotonic() < deadline:
        client.presence([])  # the scheduler adopts the successor ...
        worker_half._node._next_try = 0.0
        worker_half._node.start(1.0)  # ... and the worker maps it (in the background, done in time)
        time.sleep(0.01)
    engine.add(prompt(10, seed=65), max_tokens=2, request_id="tells")  # the worker says it has mapped the epoch
    engine.run()
    engine.add(prompt(chunk + 10, seed=64), max_tokens=2, request_id="fresh")
    engine.run()
    assert client.epoch == successor.instance + "/0" == worker_half._node.epoch
    (pool,) = successor.pools.values()
    arena = pool.arenas[0]
    assert any(arena.slot_array(slot).any() for slot in range(arena.num_slots))
    successor.close()


def test_every_worker_joins_its_schedulers_lease(make_engine, node) -> None:
    service, path = node
    writer = _engine(make_engine, "llama3-8b", path, world=2)
    reader = _engine(make_engine, "llama3-8b", path, world=2)
    (pool,) = service.pools.values()
    names = [engine.connector.scheduler_half.index.engine for engine in (writer, reader)]
    assert all(pool.leases[name].token and not pool.leases[name].bound for name in names)  # workers attach first
    _store_then_load(writer, reader, seed=51)
    for engine, name in zip((writer, reader), names):  # the first step named the lease: both ranks joined it
        lease = pool.leases[name]
        assert lease.token == engine.connector.scheduler_half.index.lease and len(lease.bound) == 2
        assert lease.scheduler is not None and lease.connections == lease.bound | {lease.scheduler}
