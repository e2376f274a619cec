"""A worker mapping the node's segments never writes them: the node's slots hold other engines' chunks when a worker
attaches, so its pre-fault (pageable or on the way to registration with a device) must leave every byte as it was.
The negative control runs the write pre-fault the guard keeps attachments from, and the same byte check sees it."""

from __future__ import annotations

import os

import numpy as np

from lmcache_npu.platform.host_memory import SegmentPinning
from lmcache_npu.store import segments as segments_module
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.segments import SegmentState

from tests.store.test_segments import FakeRegistrar

from .harness import Node, OBJECT_BYTES, store_config

WORLD = 2
SLOTS = 64


def fill(node: Node) -> list[bytes]:
    """Every byte of every rank's segments set to a known pattern (as chunks stored earlier would); the patterns."""
    node.client("scheduler")  # the first attach makes the pool
    patterns = []
    for rank, arena in enumerate(node.pool.arenas):
        pattern = b""
        for index in range(len(arena.memory.segments)):
            view = arena.memory.segment_view(index)
            view[:] = np.random.default_rng(rank * 100 + index).integers(1, 256, view.size, dtype=np.uint8)
            pattern += view.tobytes()
        patterns.append(pattern)
    return patterns


def contents(arena: HostArena) -> bytes:
    return b"".join(arena.memory.segment_view(i).tobytes() for i in range(len(arena.memory.segments)))


def test_a_worker_attaching_keeps_every_byte_of_the_node(start_node):
    node = start_node(store_config(SLOTS, WORLD, arena_segment_bytes=16 * 8192))  # 4 segments per rank
    patterns = fill(node)
    workers = [node.worker("A", rank) for rank in range(WORLD)]
    assert [contents(worker.arena) for worker in workers] == patterns
    assert [contents(arena) for arena in node.pool.arenas] == patterns
    assert len(workers[0].arena.memory.segments) == 4


def pinned_attach(node: Node, rank: int) -> HostArena:
    """Rank `rank`'s segments mapped the way a worker with a device maps them: each pre-faulted and registered."""
    fds = [os.dup(fd) for fd in node.pool.arenas[rank].segment_fds]
    arena = HostArena(SLOTS, OBJECT_BYTES, pinning=SegmentPinning([FakeRegistrar()]), hugepages="off",
                      segment_bytes=16 * 8192, shared_fds=fds)
    assert arena.wait_ready(30)
    arena.memory.close_segment_files()
    return arena


def test_a_worker_registering_the_segments_with_a_device_keeps_every_byte(start_node):
    node = start_node(store_config(SLOTS, WORLD, arena_segment_bytes=16 * 8192))
    patterns = fill(node)
    arena = pinned_attach(node, 1)
    assert all(s.state is SegmentState.LIVE and s.prefaulted_by == "populate" for s in arena.memory.segments)
    assert contents(arena) == patterns[1] and contents(node.pool.arenas[1]) == patterns[1]
    arena.close()


def test_negative_control_the_write_pre_fault_an_attachment_skips_would_erase_the_node(start_node, monkeypatch):
    original = segments_module.SegmentedMemory._prefault_segment

    def as_if_not_attached(self, segment):  # the guard gone: the segment looks like fresh memory of our own
        self.attached = False
        return original(self, segment)

    monkeypatch.setattr(segments_module.SegmentedMemory, "_prefault_segment", as_if_not_attached)
    node = start_node(store_config(SLOTS, WORLD, arena_segment_bytes=16 * 8192))
    patterns = fill(node)
    arena = pinned_attach(node, 1)
    assert all(s.prefaulted_by == "write" for s in arena.memory.segments)
    assert contents(node.pool.arenas[1]) != patterns[1]  # the byte check sees the node's chunks erased
    assert contents(node.pool.arenas[0]) == patterns[0]
    arena.close()
