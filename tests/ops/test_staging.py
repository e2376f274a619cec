"""The device staging buffer the CUDA and NPU backends share (run here on CPU tensors): a store can copy out only
kernel output or zeros, never host bytes an earlier load brought in nor another plan's payload; and host objects
adjacent in memory travel in one copy."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.ops import Direction, GroupSpec
from lmcache_npu.ops.device_staging import StagingBuffer, host_stretches

from .oracle import Geometry, allocate, payload_mask

HOST_BYTE = 0xEE  # what a load copies in: another object's alignment gaps


def _geometry(row_bytes: int, seed: int) -> Geometry:
    g = torch.Generator().manual_seed(seed)
    return Geometry([GroupSpec(16)], [allocate(2, 16, row_bytes, 0, 0, g), allocate(2, 16, 4, 0, 0, g)], 16)


GEOMETRIES = [_geometry(33, 0), _geometry(20, 1), _geometry(7, 2)]  # 33 and 7 leave gaps; 16 rows of 20 + 4 B tile 384 B
PLANS = [g.plan() for g in GEOMETRIES]
PAYLOAD = [payload_mask(g) for g in GEOMETRIES]


def test_the_plans_cover_both_kinds() -> None:
    assert [p.gap_free for p in PLANS] == [False, True, False]
    assert [bool(m.all()) for m in PAYLOAD] == [False, True, False]


@given(steps=st.lists(st.tuples(st.sampled_from([Direction.LOAD, Direction.STORE]), st.integers(1, 8),
                                st.integers(0, len(PLANS) - 1)), min_size=1, max_size=12))
def test_a_store_copies_out_only_its_own_output_or_zeros(steps) -> None:
    staging = StagingBuffer()
    for direction, chunks, which in steps:
        plan, payload = PLANS[which], np.tile(PAYLOAD[which], chunks)
        view = staging.get(plan, chunks * plan.object_bytes, direction)
        assert view.numel() == chunks * plan.object_bytes
        if direction == Direction.LOAD:
            view.fill_(HOST_BYTE)  # the host-to-device copy, gaps included
            continue
        view[torch.from_numpy(payload)] = 0xA0 + which  # the kernel writes every payload byte of a store
        leaked = view.numpy()[~payload]
        assert not leaked.any(), f"a store of plan {which} would copy out {leaked[:8].tolist()} from its gaps"


def test_only_the_dirty_range_is_zeroed_and_a_repeated_store_keeps_its_bytes() -> None:
    plan = PLANS[0]
    size = plan.object_bytes
    staging = StagingBuffer()
    staging.get(plan, 4 * size, Direction.LOAD).fill_(HOST_BYTE)
    assert staging.dirty == (0, 4 * size)
    store = staging.get(plan, size, Direction.STORE)
    assert bool((store == 0).all())
    assert staging.dirty == (size, 4 * size), "bytes past this store still hold host bytes"
    store.fill_(0x11)
    assert bool((staging.get(plan, size, Direction.STORE) == 0x11).all()), "a store after a store zeroed again"
    assert bool((staging.get(plan, 4 * size, Direction.STORE)[size:] == 0).all())
    assert staging.dirty == (0, 0)
    gap_free = PLANS[1]
    staging.get(gap_free, 2 * gap_free.object_bytes, Direction.LOAD).fill_(HOST_BYTE)
    assert staging.dirty == (0, 4 * size), "another plan's bytes are dirty for this one"
    assert bool((staging.get(gap_free, 2 * gap_free.object_bytes, Direction.STORE) == HOST_BYTE).all()), \
        "a gap-free plan's store overwrites every byte itself: zeroing would only cost time"


def test_negative_control_a_buffer_that_skips_zeroing_is_caught() -> None:
    class Careless(StagingBuffer):
        def get(self, plan, nbytes, direction):  # type: ignore[no-untyped-def]
            return super().get(plan, nbytes, Direction.LOAD)  # never zeroes

    plan = PLANS[0]
    staging = Careless()
    staging.get(plan, plan.object_bytes, Direction.LOAD).fill_(HOST_BYTE)
    assert bool((staging.get(plan, plan.object_bytes, Direction.STORE).numpy()[~PAYLOAD[0]] == HOST_BYTE).all())


def test_adjacent_host_objects_share_one_copy_and_others_do_not() -> None:
    object_bytes = 64
    arena = torch.arange(6 * object_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    slots = [arena[i * object_bytes:(i + 1) * object_bytes] for i in range(6)]
    alone = torch.full((object_bytes,), 7, dtype=torch.uint8)
    objects = [slots[0], slots[1], slots[2], slots[4], alone, slots[5]]
    whole = [(c, 0, object_bytes) for c in range(len(objects))]
    assert host_stretches(objects, whole, object_bytes) == [
        (0, 0, 3 * object_bytes), (3, 0, object_bytes), (4, 0, object_bytes), (5, 0, object_bytes)]
    pieces = [(0, 0, 10), (0, 10, 20), (0, 40, 24), (1, 0, 5)]  # a gap at [30, 40) breaks the stretch
    assert host_stretches(objects, pieces, object_bytes) == [(0, 0, 30), (0, 40, 29)]
