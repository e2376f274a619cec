"""KV events for routers: the index's tier changes reach vLLM's event publisher as `BlockStored` / `BlockRemoved`
with vLLM's block hashes, the tier as medium, stores before removals, and nothing when events are off."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lmcache_npu.integration.vllm import scheduler as scheduler_module
from lmcache_npu.integration.vllm.events import KVEvents, chunk_payload, kv_events_enabled
from lmcache_npu.store.keys import ChunkKey

from ..kv_events_view import RouterView, check_against_index, ours
from .conftest import preset_engine, prompt

CHUNK = 256  # pinned in every engine here: the checks count hash blocks per chunk


class Recorder:
    """Stands in for vLLM's ZMQ publisher: keeps every batch the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        """Nothing to close: batches stay for the test to read."""

    @property
    def events(self) -> list[Any]:
        return [event for batch in self.batches for event in batch.events]


def events_engine(make_engine: Any, **extra: Any) -> tuple[Any, Recorder]:
    """An engine whose connector believes vLLM's KV events are on, with vLLM's publisher replaced by a recorder."""
    with mock.patch.object(scheduler_module, "kv_events_enabled", lambda vllm_config: True):
        engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24,
                               extra_config={"chunk_tokens": CHUNK, **extra})
    recorder = Recorder()
    engine.scheduler.kv_event_publisher = recorder
    return engine, recorder


def request_chunks(engine: Any, request_id: str, count: int) -> list[tuple[Any, ...]]:
    """The request's chunks as events name them (vLLM's conversion: bytes, or 64-bit ints by default)."""
    request = engine.requests[request_id]
    per = CHUNK // engine.hash_block_size
    convert = engine.connector.scheduler_half.events._convert
    return [tuple(convert(h) for h in request.block_hashes[c * per:(c + 1) * per]) for c in range(count)]


def test_stores_evictions_and_spills_reach_vllms_publisher_as_the_index_sees_them(make_engine, tmp_path):
    probe = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24, extra_config={"chunk_tokens": CHUNK})
    slot = probe.workers[0].worker_half.executor.arena.slot_bytes
    engine, recorder = events_engine(make_engine, cpu_bytes=2 * slot, disk_path=str(tmp_path), disk_bytes="64MiB")
    first = prompt(2 * CHUNK + 10, seed=71)
    engine.add(first, max_tokens=2, request_id="a")
    engine.run()
    a_chunks = request_chunks(engine, "a", 2)
    stored = [e for e in ours(recorder.events) if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [tuple(e.block_hashes) for e in stored] == a_chunks
    assert all(e.block_size == engine.hash_block_size for e in stored)
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == a_chunks[0][-1]
    assert stored[0].token_ids == first[:CHUNK] and stored[1].token_ids == first[CHUNK:2 * CHUNK]
    assert stored[1].lora_id is None

    engine.add(prompt(2 * CHUNK + 10, seed=72), max_tokens=2, request_id="b")  # evicts a's chunks (on disk)
    engine.run()
    engine.workers[0].worker_half.executor.disk.flush(30)
    engine.add(prompt(CHUNK + 10, seed=73), max_tokens=2, request_id="c")  # a step that reports the spills
    engine.run()
    stream = ours(recorder.events)
    removed = [tuple(e.block_hashes) for e in stream if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    spilled = [tuple(e.block_hashes) for e in stream if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert set(a_chunks) <= set(removed) and set(a_chunks) <= set(spilled)
    for chunk in a_chunks:  # stored before removed, on each medium
        positions = [i for i, e in enumerate(stream) if tuple(e.block_hashes) == chunk and e.medium == "CPU"]
        assert isinstance(stream[positions[0]], BlockStored) and isinstance(stream[positions[-1]], BlockRemoved)
    check_against_index(stream, engine.connector.scheduler_half)

    # negative controls: a stream missing one stored chunk, or with one wrong byte in a hash, fails the check
    missing = list(stream)
    missing.remove(next(e for e in stream if isinstance(e, BlockStored) and tuple(e.block_hashes) == a_chunks[0]))
    with pytest.raises((AssertionError, ValueError)):
        check_against_index(missing, engine.connector.scheduler_half)
    last = next(e for e in reversed(stream) if isinstance(e, BlockStored) and e.medium == "CPU")
    first_hash = last.block_hashes[0]
    wrong = first_hash ^ 1 if isinstance(first_hash, int) else bytes([first_hash[0] ^ 1]) + first_hash[1:]
    forged = [BlockStored(block_hashes=[wrong] + list(last.block_hashes[1:]),
                          parent_block_hash=last.parent_block_hash, token_ids=last.token_ids,
                          block_size=last.block_size, lora_id=None, medium="CPU", lora_name=None)
              if e is last else e for e in stream]
    with pytest.raises(AssertionError):
        check_against_index(forged, engine.connector.scheduler_half)


def test_a_promotion_from_disk_is_announced_on_cpu_again(make_engine, tmp_path):
    probe = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24, extra_config={"chunk_tokens": CHUNK})
    slot = probe.workers[0].worker_half.executor.arena.slot_bytes
    engine, recorder = events_engine(make_engine, cpu_bytes=2 * slot, disk_path=str(tmp_path), disk_bytes="64MiB")
    first = prompt(2 * CHUNK + 10, seed=74)
    engine.add(first, max_tokens=2, request_id="a")
    engine.run()
    engine.add(prompt(2 * CHUNK + 10, seed=75), max_tokens=2, request_id="b")
    engine.run()
    engine.workers[0].worker_half.executor.disk.flush(30)
    engine.evict_device_cache()
    engine.add(first + [7], max_tokens=2, request_id="again")
    engine.run()
    a_chunks = request_chunks(engine, "a", 2)
    stream = ours(recorder.events)
    cpu_stores = [tuple(e.block_hashes) for e in stream if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu_stores.count(a_chunks[0]) == 2, "the promoted chunk was not announced on CPU a second time"
    assert engine.stats.data.get("hit_chunks_disk", 0) >= 1, "the second ask was not served from disk"
    check_against_index(stream, engine.connector.scheduler_half)


def test_no_events_when_vllm_does_not_publish_them(make_engine):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24, extra_config={"chunk_tokens": CHUNK})
    half = engine.connector.scheduler_half
    assert half.events is None and half.index._listener is None
    engine.add(prompt(2 * CHUNK + 10, seed=76), max_tokens=2)
    engine.run()
    assert list(engine.connector.take_events()) == []
    assert not kv_events_enabled(SimpleNamespace()) and not kv_events_enabled(
        SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False)))
    assert kv_events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))


# ---- the translation alone ------------------------------------------------------------------------------------

BLOCK = 16


def fake_request(chunks: int, seed: int) -> SimpleNamespace:
    tokens = prompt(chunks * CHUNK + 3, seed=seed)
    hashes = [bytes([seed % 256, i % 256, i // 256]) * 8 for i in range(len(tokens) // BLOCK)]
    return SimpleNamespace(request_id=f"q{seed}", block_hashes=hashes, all_token_ids=tokens,
                           lora_request=SimpleNamespace(adapter_id=3, name="sql"))


def key_of(request: SimpleNamespace, chunk: int) -> ChunkKey:
    return ChunkKey("0" * 32, request.block_hashes[(chunk + 1) * (CHUNK // BLOCK) - 1])


def test_payload_names_the_chunks_blocks_tokens_parent_and_lora():
    request = fake_request(3, seed=5)
    payload = chunk_payload(request, 1, CHUNK, BLOCK)
    per = CHUNK // BLOCK
    assert payload.block_hashes == tuple(request.block_hashes[per:2 * per])
    assert payload.parent_block_hash == request.block_hashes[per - 1]
    assert payload.token_ids.tolist() == request.all_token_ids[CHUNK:2 * CHUNK]
    assert (payload.lora_id, payload.lora_name) == (3, "sql")
    assert chunk_payload(request, 0, CHUNK, BLOCK).parent_block_hash is None
    with pytest.raises(ValueError, match="block hashes up to"):
        chunk_payload(request, 3, CHUNK, BLOCK)
    with pytest.raises(ValueError, match="multiple of the hash block size"):
        chunk_payload(request, 0, CHUNK + 1, BLOCK)


def test_unremembered_chunks_are_never_announced_and_bad_tiers_are_refused():
    events = KVEvents(CHUNK, BLOCK, max_payloads=8)
    request = fake_request(2, seed=6)
    events.on_tier_change(key_of(request, 0), "cpu", True)
    events.on_tier_change(key_of(request, 0), "cpu", False)
    assert events.take() == [] and events.counters["unnamed"] == 1
    events.remember(key_of(request, 0), request, 0)
    events.on_tier_change(key_of(request, 0), "remote", True)
    events.on_tier_change(key_of(request, 0), "remote", True)  # announced once
    (stored,) = events.take()
    assert stored.medium == "MOONCAKE" and stored.lora_name == "sql"
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        events.on_tier_change(key_of(request, 0), "gpu", True)
    with pytest.raises(ValueError, match="max_payloads"):
        KVEvents(CHUNK, BLOCK, max_payloads=0)


def test_the_buffer_is_bounded_and_counts_what_it_drops():
    events = KVEvents(CHUNK, BLOCK, max_payloads=64, max_events=3)
    request = fake_request(5, seed=7)
    for c in range(5):
        events.remember(key_of(request, c), request, c)
        events.on_tier_change(key_of(request, c), "cpu", True)
    taken = events.take()
    per = CHUNK // BLOCK
    assert [e.block_hashes[-1] for e in taken] == [events._convert(request.block_hashes[(c + 1) * per - 1])
                                                   for c in (2, 3, 4)]
    assert events.counters["dropped"] == 2 and events.take() == []


def test_payloads_of_announced_chunks_outlive_the_bound():
    events = KVEvents(CHUNK, BLOCK, max_payloads=2)
    request = fake_request(6, seed=8)
    events.remember(key_of(request, 0), request, 0)
    events.on_tier_change(key_of(request, 0), "disk", True)
    for c in range(1, 6):  # stores that never land
        events.remember(key_of(request, c), request, c)
    assert events.remembered == 2 and events.announced(key_of(request, 0)) == {"disk"}
    events.on_tier_change(key_of(request, 0), "disk", False)
    stored, removed = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    assert removed.medium == "STORAGE"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["cpu", "disk"]), st.booleans()), max_size=40))
def test_a_replayed_stream_matches_the_tiers_each_chunk_is_in(changes):
    """Whatever order the index enters and leaves tiers in (each change a real transition), a router's replay
    holds exactly the chunks in each tier."""
    events = KVEvents(CHUNK, BLOCK, max_payloads=16)
    request = fake_request(4, seed=9)
    for c in range(4):
        events.remember(key_of(request, c), request, c)
    inside: set[tuple[int, str]] = set()
    for chunk, tier, entered in changes:
        if ((chunk, tier) in inside) == entered:
            continue  # the index reports transitions only
        (inside.add if entered else inside.discard)((chunk, tier))
        events.on_tier_change(key_of(request, chunk), tier, entered)
    view = RouterView()
    view.apply(events.take())
    per = CHUNK // BLOCK
    for tier, medium in (("cpu", "CPU"), ("disk", "STORAGE")):
        want = {tuple(events._convert(h) for h in request.block_hashes[c * per:(c + 1) * per])
                for c, t in inside if t == tier}
        assert view.holds(medium) == want


def test_router_view_refuses_a_removal_before_its_store():
    view = RouterView()
    with pytest.raises(ValueError, match="no earlier BlockStored"):
        view.apply([BlockRemoved(block_hashes=[b"x" * 32], medium="CPU")])


def test_the_index_tells_its_listener_every_tier_transition():
    from lmcache_npu.store.commands import Completion
    from lmcache_npu.store.index.chunk_index import ChunkIndex

    index = ChunkIndex(num_slots=1, num_ranks=1, disk_chunks=1, remote_exists=lambda keys: [False] * len(keys))
    heard: list[tuple[bytes, str, bool]] = []
    index.set_tier_listener(lambda key, tier, entered: heard.append((key.chunk_hash, tier, entered)))

    def complete() -> None:
        index.on_completions([Completion(c.cmd_id, 0, True) for c in index.take_commands()])

    a, b = ChunkKey("0" * 32, b"a" * 32), ChunkKey("0" * 32, b"b" * 32)
    index.prepare_store("r1", [(0, a)])
    complete()  # stored, then put to the remote store
    complete()
    index.prepare_store("r2", [(0, b)])  # evicts a: spilled to disk
    complete()
    complete()
    index.prepare_store("r3", [(0, ChunkKey("0" * 32, b"c" * 32))])  # evicts b; its spill drops a's file
    complete()
    assert heard[:6] == [(b"a" * 32, "cpu", True), (b"a" * 32, "remote", True), (b"a" * 32, "cpu", False),
                         (b"a" * 32, "disk", True), (b"b" * 32, "cpu", True), (b"b" * 32, "remote", True)]
    assert (b"a" * 32, "disk", False) in heard and (b"b" * 32, "cpu", False) in heard
    assert heard.index((b"a" * 32, "disk", False)) > heard.index((b"a" * 32, "disk", True))
    index.check_invariants()
    with pytest.raises(ValueError, match="tier listener must be callable"):
        index.set_tier_listener("not callable")  # type: ignore[arg-type]


def test_a_failing_listener_never_breaks_the_index():
    from lmcache_npu.store.commands import Completion
    from lmcache_npu.store.index.chunk_index import ChunkIndex

    index = ChunkIndex(num_slots=2)

    def broken(key: ChunkKey, tier: str, entered: bool) -> None:
        raise RuntimeError("router gone")

    index.set_tier_listener(broken)
    index.prepare_store("r1", [(0, ChunkKey("0" * 32, b"a" * 32))])
    index.on_completions([Completion(c.cmd_id, 0, True) for c in index.take_commands()])
    assert index.counters["listener_errors"] == 1
    assert index.lookup("r2", [ChunkKey("0" * 32, b"a" * 32)]).ready_chunks == 1


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=40))
def test_hashes_are_converted_exactly_as_vllms_own_events_convert_them(block_hash):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events = KVEvents(CHUNK, BLOCK, max_payloads=1)
    assert events._convert(block_hash) == maybe_convert_block_hash(block_hash)
