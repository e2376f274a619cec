"""Engines sharing one node cache, on vLLM's real scheduler with simulated workers (tests/integration/engine.py):
engine B loads the chunks engine A stored, every row its forward reads checked against the simulated model (both
engines' models give the same bytes for the same tokens), across model families and with two TP ranks; a private
cache finds nothing (the control). Every engine of the node names the node's chunks in its KV events."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Iterator
from unittest import mock

import pytest
from vllm.distributed.kv_events import BlockStored

from lmcache_npu.integration.vllm import scheduler as scheduler_module
from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.store.commands import Tier
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.index.contract import SlotState

from ..kv_events_view import ours
from .conftest import preset_engine, prompt
from .test_events import Recorder, request_chunks


@pytest.fixture
def node() -> Iterator[tuple[NodeCacheService, str]]:
    path = os.path.join(tempfile.mkdtemp(prefix="lmc-sim-"), "node.sock")  # socket paths must stay short
    service = NodeCacheService(ServiceOptions(path, StoreConfig(cpu_bytes=256 << 20))).start()
    yield service, path
    service.close()


def _engine(make_engine: Any, preset: str, path: str, **overrides: Any) -> Any:
    return preset_engine(make_engine, preset, "ascend", extra_config={"node_cache": path}, **overrides)


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
    if isinstance(writer.connector.scheduler_half.index, NodeCacheClient):  # its answers are one-way: the reader's
        writer.connector.scheduler_half.index.sync()  # lookup must not overtake them
    second = first + prompt(chunk // 2, seed=seed + 1)
    reader.add(second, max_tokens=3, request_id="second")
    reader.run()
    expected = min((len(first) + 1) // chunk, (len(second) - 1) // chunk) * chunk
    return reader.loaded_tokens.get("second", 0), expected


def _quiescent(engine: Any) -> None:
    """conftest's `assert_quiescent`, asked of the node: nothing in flight, reserved, pinned or half-written."""
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "vLLM blocks still held"
    half = engine.connector.scheduler_half
    assert not half.requests and not half._owner and not half._loads and not half._delayed_free
    assert len(half.fence.reads) == 0 and not half.fence.step_reads
    index = half.index
    index.check_invariants()  # run by the service on the node's index
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
        _quiescent(engine)


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
