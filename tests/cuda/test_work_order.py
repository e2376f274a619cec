"""The CUDA backend's slicing of a batch for the copy engine (pure numpy: runs without a GPU)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction
from lmcache_npu.ops.cuda_backend import MAX_SLICES, work_order

from ..ops.strategies import Case, cases


@given(case=cases(soc="a2"), slice_bytes=st.sampled_from([64, 1000, 1 << 16, 2 << 20]),
       direction=st.sampled_from([Direction.STORE, Direction.LOAD]))
def test_slices_cover_every_item_and_payload_byte_once(case: Case, slice_bytes: int, direction: Direction) -> None:
    plan = case.geometry.plan()
    objects = torch.zeros((case.num_chunks, plan.object_bytes), dtype=torch.uint8)
    batch = ChunkBatch.build(plan, case.slots, objects, direction)
    order = work_order(batch, slice_bytes)
    assert len(order.items) == batch.total_items
    assert int(order.slice_items.sum()) == batch.total_items
    assert 0 < order.slice_items.size <= MAX_SLICES or batch.total_items == 0
    assert (np.diff(order.items[:, 2].astype(np.int64)) >= 0).all(), "slices must follow item order"
    covered = np.zeros((case.num_chunks, plan.object_bytes), dtype=np.int32)
    for pieces in order.pieces:
        for chunk, offset, length in pieces:
            assert 0 <= offset and offset + length <= plan.object_bytes and length > 0
            covered[chunk, offset: offset + length] += 1
    assert covered.max(initial=0) <= 1, "a byte is copied by two slices"
    offsets = plan.object_offsets
    for item in order.items:  # every item's bytes lie inside its own slice's pieces
        run, plane = batch.runs[item[0]], plan.moved_planes[item[1]]
        lo = offsets[item[1]] + int(run["first_row"]) * plane.row_bytes
        hi = lo + int(run["num_rows"]) * plane.row_bytes
        inside = [(c, o, n) for c, o, n in order.pieces[item[2]] if c == run["chunk"] and o <= lo and hi <= o + n]
        assert inside, "an item's bytes are not in its slice"


def test_slices_grow_geometrically() -> None:
    from lmcache_npu.ops.cuda_backend import slice_bounds

    mib = 1 << 20
    assert list(slice_bounds(268 * mib) // mib) == [2, 6, 14, 30, 62, 126, 190, 254, 268]
    assert list(slice_bounds(7 * mib)) == [2 * mib, 6 * mib, 7 * mib]
    assert len(slice_bounds(1 << 40, first=64)) == MAX_SLICES
