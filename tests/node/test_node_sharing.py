"""Two engines of one node share one cache: what engine A stores, engine B finds, loads and reads byte for byte
through its own mapping of the node's segments, and the node holds one copy. A per-engine cache (each engine its
own service) fails the same check: the negative control the issue asks for."""

from __future__ import annotations

from typing import Sequence

from lmcache_npu.node.pool import ENGINE_SEPARATOR
from lmcache_npu.store.commands import Tier
from lmcache_npu.store.keys import ChunkKey

from .harness import Engine, expected_bytes, keys_of, store_config, sync

WORLD = 2


def cross_engine_misses(writer: Engine, reader: Engine, keys: Sequence[ChunkKey], request: str) -> list[str]:
    """`writer` stores `keys`; `reader` looks them up, loads them and reads them through its own mapping. What went
    wrong, one line each (empty: every chunk was found and read back identical)."""
    writer.store(f"{request}-store", keys)
    found = reader.client.lookup(request, keys)
    if found.ready_chunks < len(keys):
        reader.client.release(request)
        return [f"engine {reader.client.engine} found {found.ready_chunks} of the {len(keys)} chunks engine "
                f"{writer.client.engine} stored"]
    loads = reader.client.prepare_load(request, list(enumerate(keys)))
    reader.client.take_commands()
    seen = reader.read(loads)
    reader.client.release(request)
    world = len(reader.workers)
    return [f"chunk {key.chunk_hash.hex()[:8]} rank {rank}: other bytes than engine {writer.client.engine} stored"
            for key in keys for rank in range(world) if seen[key][rank] != expected_bytes(key, world)[rank]]


def test_engine_b_reads_engine_a_chunks_through_its_own_mapping_and_the_node_holds_one_copy(start_node):
    node = start_node(store_config(8, WORLD))
    a, b = node.engine("A"), node.engine("B")
    keys = keys_of(0, 5)
    assert cross_engine_misses(a, b, keys, "turn-2") == []
    for mine, theirs in zip(a.workers, b.workers):
        assert mine.arena.base_address != theirs.arena.base_address  # two mappings of the same pages
    assert b.client.prepare_store("turn-2", list(enumerate(keys))) == []  # B computed them too: nothing stored twice
    assert node.pool.index.occupancy()[Tier.ARENA][0] == len(keys)
    assert sum(view.slot is not None for view in node.pool.index.chunks()) == len(keys)
    # the very pages: a byte A's rank 1 writes into a slot is in B's rank 1 mapping of that slot
    slot = node.pool.index.location(keys[2])[0]
    a.workers[1].arena.slot_array(slot)[100] ^= 0xFF
    assert bytes(b.workers[1].arena.slot_array(slot)) != expected_bytes(keys[2], WORLD)[1]


def test_negative_control_a_per_engine_cache_misses_the_other_engines_chunks(start_node):
    a = start_node(store_config(8, WORLD)).engine("A")
    b = start_node(store_config(8, WORLD)).engine("B")  # its own service: a private cache as today
    misses = cross_engine_misses(a, b, keys_of(0, 5), "turn-2")
    assert misses == ["engine B found 0 of the 5 chunks engine A stored"]


def test_negative_control_a_wrong_byte_in_the_shared_slot_is_reported(start_node):
    node = start_node(store_config(8, WORLD))
    a, b = node.engine("A"), node.engine("B")
    keys = keys_of(0, 2)
    original = a.store

    def store_then_corrupt(request_id, store_keys, first=0):
        stores = original(request_id, store_keys, first)
        a.workers[0].arena.slot_array(stores[1].slot)[7] ^= 1  # after the answer: B must see the wrong byte
        return stores

    a.store = store_then_corrupt  # type: ignore[method-assign]
    assert cross_engine_misses(a, b, keys, "q") == [
        f"chunk {keys[1].chunk_hash.hex()[:8]} rank 0: other bytes than engine A stored"]


def test_each_engine_sees_its_own_reservations_by_its_own_ids_and_others_by_engine(start_node):
    node = start_node(store_config(4, WORLD))
    a, b = node.engine("A"), node.engine("B")
    keys = keys_of(0, 2)
    a.store("w", keys)
    assert a.client.lookup("q", keys).ready_chunks == 2
    assert b.client.lookup("q", keys[:1]).ready_chunks == 1  # the same request id in another engine: not A's
    views = {view.key: view.reservations for view in a.client.chunks()}
    assert views == {keys[0]: frozenset({"q", f"B{ENGINE_SEPARATOR}q"}), keys[1]: frozenset({"q"})}
    views = {view.key: view.reservations for view in b.client.chunks()}
    assert views == {keys[0]: frozenset({"q", f"A{ENGINE_SEPARATOR}q"}), keys[1]: frozenset({f"A{ENGINE_SEPARATOR}q"})}
    a.client.release("q")  # A's release gives up A's reservations only
    sync(a.client)
    assert {view.key: view.reservations for view in b.client.chunks()} == {keys[0]: frozenset({"q"}),
                                                                           keys[1]: frozenset()}


def test_an_engine_that_publishes_kv_events_hears_the_chunks_another_engine_stored(start_node):
    node = start_node(store_config(4, WORLD))
    a, b, quiet = node.engine("A"), node.engine("B"), node.engine("C")
    heard: list = []
    b.client.set_tier_listener(lambda key, tier, entered: heard.append((key, tier, entered)))
    keys = keys_of(0, 2)
    a.store("w", keys)
    sync(b.client)  # the node's tier changes ride B's next answer
    assert heard == [(key, Tier.ARENA, True) for key in keys]
    assert node.pool.leases["C"].tier_changes == []  # control: an engine without a listener is told nothing
    b.client.set_tier_listener(None)
    a.store("w2", keys_of(5, 1))
    sync(b.client)
    assert len(heard) == 2 and quiet.client.lookup("q", keys).ready_chunks == 2
