"""The node's disk tier through the service: chunks an engine stored reach the disk (written through, or spilled when
the small arena evicts them), the service closes (its disk tiers flush), a new service on the same directory adopts
the files when the pool is made, a lookup promotes them with the pool's executors, and the bytes arrive identical in
a worker's mapping. A byte flipped in a file is refused (counted, never served); with verification off the same
byte check sees the wrong bytes reach the mapping: the negative control."""

from __future__ import annotations

import os

import pytest

from lmcache_npu.store.routes import guard as executor_module
from lmcache_npu.store.disk import HEADER_BYTES
from lmcache_npu.store.index.contract import DiskState
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.metrics import Metric

from .harness import Engine, Node, expected_bytes, keys_of, store_config, wait_for

WORLD = 2
DISK_BYTES = 1 << 20  # the node's, all ranks: 64 files of two pages per rank


def disk_store(directory: str, slots: int, write_through: bool):
    return store_config(slots, WORLD, disk_path=os.path.join(directory, "kv"), disk_bytes=DISK_BYTES,
                        disk_write_through=write_through)


def on_disk(node: Node, keys: list[ChunkKey]) -> bool:
    with node.service.lock:
        return all(node.pool.index.location(key)[2] is DiskState.PRESENT for key in keys)


def written(start_node, node_dir: str, write_through: bool) -> tuple[list[ChunkKey], list[str]]:
    """An engine stores 4 chunks into a node of 2 slots (so 2 are evicted) and the disk holds the ones it should:
    all 4 written through, or the 2 spilled; the service then closes. Those keys, and rank 1's file of each."""
    node = start_node(disk_store(node_dir, 2, write_through), socket_name="s")
    keys = keys_of(0, 4)
    engine = node.engine("writer")
    for i, key in enumerate(keys):  # one at a time: a slot is evictable once its write-through or spill landed
        wait_for(lambda: node.pool.index.in_flight == 0, "the node's disk writes")
        assert len(engine.store("w", [key], first=i)) == 1
    kept = keys if write_through else keys[:2]
    wait_for(lambda: on_disk(node, kept), "the disk copies")
    files = [node.pool.executors[1].disk.file_path(key.storage_name(1)) for key in kept]  # type: ignore[union-attr]
    node.close()
    assert all(os.path.exists(path) for path in files)
    return kept, files


def promoted_bytes(engine: Engine, keys: list[ChunkKey], hits: int) -> dict[ChunkKey, list[bytes]]:
    """Looks `keys` up until `hits` of them are ready in the arena (promoted by the node), loads and reads them."""
    wait_for(lambda: engine.client.lookup("r", keys).ready_chunks == hits and
             engine.client.lookup("r", keys).hit_chunks == hits, f"{hits} chunks promoted from disk")
    loads = engine.client.prepare_load("r", list(enumerate(keys[:hits])))
    engine.client.take_commands()
    seen = engine.read(loads)
    engine.client.release("r")
    return seen


@pytest.mark.parametrize("write_through", [True, False], ids=["written-through", "evicted"])
def test_a_restarted_service_adopts_the_disk_and_serves_identical_bytes(start_node, node_dir, write_through):
    kept, _ = written(start_node, node_dir, write_through)
    node = start_node(disk_store(node_dir, 4, write_through), socket_name="s")
    reader = node.engine("reader")  # its attach makes the pool, which adopts the files
    assert on_disk(node, kept)
    seen = promoted_bytes(reader, kept, len(kept))
    assert {key: seen[key] for key in kept} == {key: expected_bytes(key, WORLD) for key in kept}
    assert node.pool.index.counters[Metric.PROMOTIONS_DISK] == len(kept)


def flip(path: str, offset: int = 17) -> None:
    with open(path, "r+b") as file:
        file.seek(HEADER_BYTES + offset)
        byte = file.read(1)[0]
        file.seek(HEADER_BYTES + offset)
        file.write(bytes([byte ^ 0x40]))


def test_a_flipped_byte_in_a_disk_file_is_refused_counted_and_never_served(start_node, node_dir):
    kept, files = written(start_node, node_dir, write_through=True)
    flip(files[1])
    node = start_node(disk_store(node_dir, 4, True), socket_name="s")
    reader = node.engine("reader")
    seen = promoted_bytes(reader, kept, 1)  # chunk 0 only: chunk 1 is refused, and a hit is a prefix
    assert list(seen) == [kept[0]] and seen[kept[0]] == expected_bytes(kept[0], WORLD)
    disks = [executor.disk for executor in node.pool.executors]
    assert [disk.counters[Metric.REJECTED] for disk in disks] == [0, 1]  # type: ignore[union-attr]
    assert node.pool.index.counters[Metric.PROMOTE_FAILED] == 1


def test_negative_control_without_verification_the_flipped_byte_reaches_the_mapping(start_node, node_dir, monkeypatch):
    kept, files = written(start_node, node_dir, write_through=True)
    flip(files[1])
    monkeypatch.setattr(executor_module, "verify", lambda *args: None)
    node = start_node(disk_store(node_dir, 4, True), socket_name="s")
    seen = promoted_bytes(node.engine("reader"), kept, 4)
    assert seen[kept[1]][1] != expected_bytes(kept[1], WORLD)[1]  # the byte check would have caught it
    assert seen[kept[1]][0] == expected_bytes(kept[1], WORLD)[0]


def test_a_restart_drops_a_chunk_only_some_ranks_have_on_disk(start_node, node_dir):
    """A crash mid-spill leaves a chunk's file on rank 0 only: the restarted pool cannot load it, so the drops it
    issues while it is made run on its own executors (the file goes), and the complete chunks are still adopted."""
    kept, files = written(start_node, node_dir, True)
    os.remove(files[0])  # rank 1's file of the first chunk: rank 0's alone is left
    node = start_node(disk_store(node_dir, 4, True), socket_name="s")
    reader = node.engine("reader")
    partial = node.pool.executors[0].disk.file_path(kept[0].storage_name(0))  # type: ignore[union-attr]
    wait_for(lambda: not os.path.exists(partial), "the partial copy's drop")
    assert not on_disk(node, kept[:1]) and on_disk(node, kept[1:])
    seen = promoted_bytes(reader, kept[1:], len(kept) - 1)
    assert {key: seen[key] for key in kept[1:]} == {key: expected_bytes(key, WORLD) for key in kept[1:]}
