"""Plane-subset plans (a sliced load's slices, per-slice stores) on staged device paths: the CUDA work order's copies
and the NPU backend's copies move only the subset's planes. A store never writes a byte of a plane outside the subset
into an object, a load stages every byte its kernel reads; a subset planned like a full plan (whole spans) is caught.
Pure numpy: runs without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction, GroupSpec, TransferPlan
from lmcache_npu.ops.cuda.work_order import copy_table, slice_bounds, work_order
from lmcache_npu.ops.device_staging import object_pieces, plane_segments
from lmcache_npu.ops.npu_backend import NpuBackend

from .oracle import Geometry, allocate
from .strategies import Case, cases
from .test_cuda_work_order import _apply

STAGING = 1 << 40  # any device address: the copies only offset from it


def _subset(case: Case, pick: int) -> tuple[TransferPlan, TransferPlan]:
    """The case's plan and a nonempty proper subset of its moved planes (every other one from `pick`); the plan
    itself where it has fewer than two."""
    plan = case.geometry.plan()
    n = len(plan.moved_planes)
    if n < 2:
        return plan, plan
    return plan, plan.plane_subset([i for i in range(n) if (i + pick) % 2 == 0] or [0])


def _masks(full: TransferPlan, subset: TransferPlan, batch: ChunkBatch) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, byte) masks: the subset's item bytes, and every byte of a plane outside the subset."""
    nbytes, chunks = full.object_bytes, batch.num_chunks
    own = np.zeros((chunks, nbytes), dtype=bool)
    order = work_order(batch)
    for run_id, plane_id, _, _ in order.items.tolist():
        run, plane = order.runs[run_id], subset.moved_planes[plane_id]
        begin = subset.object_offsets[plane_id] + int(run["first_row"]) * plane.row_bytes
        own[int(run["chunk"]), begin: begin + int(run["num_rows"]) * plane.row_bytes] = True
    foreign = np.zeros((chunks, nbytes), dtype=bool)
    kept = {id(p) for p in subset.moved_planes}
    for offset, plane in zip(full.object_offsets, full.moved_planes):
        if id(plane) not in kept:
            foreign[:, offset: offset + full.rows_per_chunk[plane.group] * plane.row_bytes] = True
    return own, foreign


def _copied(copies: np.ndarray, objects: list[torch.Tensor], nbytes: int) -> np.ndarray:
    mask = np.zeros((len(objects), nbytes), dtype=bool)
    for _, host_at, length, _ in copies.tolist():
        for c, obj in enumerate(objects):
            base = obj.data_ptr()
            if base <= host_at < base + nbytes:
                first = host_at - base
                while length > 0:  # a merged copy runs on into the next object of its storage
                    take = min(length, nbytes - first)
                    mask[c, first: first + take] = True
                    length, c, first = length - take, c + 1, 0
                break
    return mask


def _store_writes(case: Case, subset: TransferPlan, full: TransferPlan, pipelined: bool) -> tuple[bool, bool]:
    """Simulates a subset store through staging: (its item bytes reached the objects, no foreign byte changed)."""
    nbytes = full.object_bytes
    rng = np.random.default_rng(case.seed)
    objects = list(torch.from_numpy(rng.integers(0, 256, (case.num_chunks, nbytes), dtype=np.uint8)))
    before = np.stack([o.numpy().copy() for o in objects])
    batch = ChunkBatch.build(subset, case.slots, objects, Direction.STORE)
    own, foreign = _masks(full, subset, batch)
    order = work_order(batch, pipelined, 100, slice_bounds(case.num_chunks * nbytes, Direction.STORE, pipelined, 64))
    staging = rng.integers(0, 256, case.num_chunks * nbytes, dtype=np.uint8)  # the kernel's output, and leftovers
    _apply(copy_table(STAGING, batch, order, pipelined), staging, STAGING, objects, to_device=False)
    after = np.stack([o.numpy() for o in objects])
    landed = np.array_equal(after[own], staging.reshape(case.num_chunks, nbytes)[own])
    return landed, np.array_equal(after[foreign], before[foreign])


@settings(deadline=None)
@given(case=cases(soc="a2"), pick=st.integers(0, 1), pipelined=st.booleans())
def test_a_subset_store_writes_its_planes_and_never_another(case: Case, pick: int, pipelined: bool) -> None:
    full, subset = _subset(case, pick)
    landed, untouched = _store_writes(case, subset, full, pipelined)
    assert landed, "a stored row of the subset did not reach its object"
    assert untouched, "a subset store wrote bytes of a plane outside the subset"


@settings(deadline=None)
@given(case=cases(soc="a2"), pick=st.integers(0, 1), pipelined=st.booleans())
def test_a_subset_load_stages_its_planes_only(case: Case, pick: int, pipelined: bool) -> None:
    full, subset = _subset(case, pick)
    nbytes = full.object_bytes
    rng = np.random.default_rng(case.seed)
    objects = list(torch.from_numpy(rng.integers(1, 256, (case.num_chunks, nbytes), dtype=np.uint8)))
    batch = ChunkBatch.build(subset, case.slots, objects, Direction.LOAD)
    own, foreign = _masks(full, subset, batch)
    order = work_order(batch, pipelined, 100, slice_bounds(case.num_chunks * nbytes, Direction.LOAD, pipelined))
    copies = copy_table(STAGING, batch, order, pipelined)
    staging = np.zeros(case.num_chunks * nbytes, dtype=np.uint8)
    _apply(copies, staging, STAGING, objects, to_device=True)
    want = np.stack([o.numpy() for o in objects])
    assert np.array_equal(staging.reshape(case.num_chunks, nbytes)[own], want[own]), "a loaded byte was not staged"
    assert not (_copied(copies, objects, nbytes) & foreign).any(), "a subset load copied another plane's bytes"


def _three_planes_case() -> Case:
    """One group of three planes: a subset of the outer two has a foreign plane between its items."""
    generator = torch.Generator().manual_seed(3)
    planes = [allocate(8, 16, 128, 0, 0, generator) for _ in range(3)]
    slots = [np.arange(32, dtype=np.int64).reshape(2, 16) + 16]
    return Case(Geometry([GroupSpec(16)], planes, 16), slots, 2, seed=3)


def test_control_a_subset_planned_as_a_full_plan_is_caught() -> None:
    case = _three_planes_case()
    full = case.geometry.plan()
    subset = full.plane_subset([0, 2])
    assert subset.partial and not full.partial
    landed, untouched = _store_writes(case, subset, full, pipelined=False)
    assert landed and untouched
    subset.partial = False  # the old planning: one span from the first item to the last, plane 1 included
    landed, untouched = _store_writes(case, subset, full, pipelined=False)
    assert landed and not untouched, "the check missed a store that wrote another plane's bytes"


def test_plane_segments_merge_across_alignment_gaps_only() -> None:
    case = _three_planes_case()
    full = case.geometry.plan()
    assert plane_segments(full) == [(0, 3 * 16 * 128)]  # 2048 B planes: back to back
    assert plane_segments(full.plane_subset([0, 2])) == [(0, 2048), (4096, 2048)]
    assert object_pieces(full, 2) == [(0, 0, full.object_bytes), (1, 0, full.object_bytes)]


@settings(deadline=None)
@given(case=cases(soc="a2"), pick=st.integers(0, 1), direction=st.sampled_from([Direction.STORE, Direction.LOAD]))
def test_npu_copies_of_a_subset_cover_its_planes_only(case: Case, pick: int, direction: Direction) -> None:
    full, subset = _subset(case, pick)
    nbytes = full.object_bytes
    objects = list(torch.zeros((case.num_chunks, nbytes), dtype=torch.uint8))
    batch = ChunkBatch.build(subset, case.slots, objects, direction)
    own, foreign = _masks(full, subset, batch)
    copies = NpuBackend._copies(batch, STAGING, nbytes)
    rows = np.stack([copies["device"], copies["host"], copies["bytes"], np.zeros(len(copies), dtype=np.uint64)],
                    axis=1).astype(np.uint64).reshape(-1, 4)
    copied = _copied(rows, objects, nbytes)
    assert copied[own].all(), "a byte of the subset's rows is not copied"
    assert not (copied & foreign).any(), "the npu copies reach a plane outside the subset"


@settings(deadline=None)
@given(case=cases(soc="a2"), pick=st.integers(0, 1), direction=st.sampled_from([Direction.STORE, Direction.LOAD]))
def test_for_plan_equals_a_batch_built_on_the_subset(case: Case, pick: int, direction: Direction) -> None:
    full, subset = _subset(case, pick)
    objects = list(torch.zeros((case.num_chunks, full.object_bytes), dtype=torch.uint8))
    whole = ChunkBatch.build(full, case.slots, objects, direction)
    derived, built = whole.for_plan(subset), ChunkBatch.build(subset, case.slots, objects, direction)
    assert derived.total_items == built.total_items and derived.payload_bytes == built.payload_bytes
    assert np.array_equal(derived.group_table, built.group_table) and np.array_equal(derived.runs, built.runs)


def test_for_plan_refuses_a_plan_that_is_no_subset() -> None:
    case = _three_planes_case()
    plan = case.geometry.plan()
    objects = list(torch.zeros((case.num_chunks, plan.object_bytes), dtype=torch.uint8))
    whole = ChunkBatch.build(plan, case.slots, objects, Direction.LOAD)
    other = _three_planes_case().geometry.plan()  # the same geometry on other pages
    with pytest.raises(ValueError, match="not a plane subset"):
        whole.for_plan(other.plane_subset([0]))
