"""Plane-subset plans (a sliced load's slices, per-slice stores) through the CUDA backend: a subset store writes its
planes' segments and no byte of another plane, and subset loads launched back to back (each returning once enqueued,
none finished before the last is launched) land what the whole plan's load would, touching no other plane."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction, get_backend

from ..ops.strategies import Case, cases
from .cuda_marks import CUDA_KERNELS
from .test_cuda import to_cuda

pytestmark = CUDA_KERNELS


def _segments(plan, indices):
    return [(plan.object_offsets[i], plan.rows_per_chunk[p.group] * p.row_bytes)
            for i, p in enumerate(plan.moved_planes) if i in indices]


def _random_objects(count: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).pin_memory() for _ in range(count)]


@settings(max_examples=40, deadline=None)
@given(case=cases(soc="a2"), path=st.sampled_from(["staging", "mapped"]), pipeline=st.booleans())
def test_subset_stores_and_back_to_back_subset_loads_are_byte_exact(case: Case, path: str, pipeline: bool) -> None:
    case = to_cuda(case)
    plan = case.geometry.plan()
    n = len(plan.moved_planes)
    if n < 2:
        return
    backend = get_backend("cuda", path=path, pipeline=pipeline, load_tail_bytes=100, load_tail_share=3)
    backend.prepare(plan)
    nbytes = plan.object_bytes
    whole = _random_objects(case.num_chunks, nbytes, case.seed)
    backend.transfer(ChunkBatch.build(plan, case.slots, whole, Direction.STORE))
    chosen = [i for i in range(n) if i % 2 == 0]
    subset = plan.plane_subset(chosen)
    backend.prepare(subset)
    partial = _random_objects(case.num_chunks, nbytes, case.seed + 1)
    before = [o.clone() for o in partial]
    backend.transfer(ChunkBatch.build(subset, case.slots, partial, Direction.STORE))
    for c in range(case.num_chunks):
        for offset, length in _segments(plan, chosen):
            assert torch.equal(partial[c][offset: offset + length], whole[c][offset: offset + length])
        for offset, length in _segments(plan, [i for i in range(n) if i not in chosen]):
            assert torch.equal(partial[c][offset: offset + length], before[c][offset: offset + length]), \
                "a subset store wrote bytes of a plane outside the subset"
    for raw in case.geometry.raw_planes:  # scrub the pages: the loads must write every row back
        raw.raw.copy_(torch.randint(0, 256, raw.raw.shape, dtype=torch.uint8, device=raw.raw.device))
    full_batch = ChunkBatch.build(plan, case.slots, whole, Direction.LOAD)
    singles = [plan.plane_subset([i]) for i in range(n)]
    for single in singles:
        backend.prepare(single)
    pending = [backend.launch(full_batch.for_plan(single)) for single in singles]
    assert all(p.asynchronous for p in pending)
    for p in pending:
        p.finish()
    again = _random_objects(case.num_chunks, nbytes, case.seed + 2)
    backend.transfer(ChunkBatch.build(plan, case.slots, again, Direction.STORE))
    for c in range(case.num_chunks):
        for offset, length in _segments(plan, range(n)):
            assert torch.equal(again[c][offset: offset + length], whole[c][offset: offset + length]), \
                "back-to-back subset loads did not land the whole plan's bytes"
