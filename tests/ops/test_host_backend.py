"""What is specific to the host backend (memcpy over host memory): its own bounds checks on forged tables, threads,
NZ pages, its report, and its refusals. Bytes against the oracle, each comparison with a negative control."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu import _host
from lmcache_npu.ops import ChunkBatch, Direction, GroupSpec, get_backend
from lmcache_npu.ops.host_backend import HostBackend

from .oracle import Geometry, allocate, good_slots, oracle_load, oracle_store, small_geometry
from .strategies import Case, cases



def nz_geometry(seed: int) -> tuple[Geometry, list[np.ndarray]]:
    """One FRACTAL_NZ plane (4 columns of 32 B units) beside an ND plane, with skipped rows and shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    geometry = Geometry([GroupSpec(16)], [allocate(6, 16, 128, 32, 0, g, nz_unit=32, dtype=torch.float16),
                                          allocate(6, 16, 40, 0, 0, g)], 32)
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(6)[:4]
    slots = (blocks.reshape(-1, 1) * 16 + np.arange(16)).reshape(2, 32)
    slots[rng.random(slots.shape) < 0.25] = -1
    return geometry, [slots]


def pages_of(geometry: Geometry) -> list[np.ndarray]:
    return [rp.raw.numpy().copy() for rp in geometry.raw_planes]


def differing_planes(geometry: Geometry, expected: list[np.ndarray]) -> list[int]:
    return [i for i, (rp, want) in enumerate(zip(geometry.raw_planes, expected)) if not np.array_equal(rp.raw.numpy(),
                                                                                                       want)]


def test_a_forged_run_is_rejected_moves_no_byte_and_raises() -> None:
    """A run that leaves its block, edited into the run table after ChunkBatch validated it: the two items of that
    run (one per plane of group 0) move nothing, every other item moves, and the report turns into an error."""
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.randint(0, 256, (1, plan.object_bytes), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(1))
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.LOAD)
    run0 = batch.runs[0].copy()
    batch.runs[0]["num_rows"] = 17  # slot 0 + 17 rows crosses into block 1
    slots_without_run0 = good_slots()
    slots_without_run0[0][run0["chunk"], run0["first_row"]: run0["first_row"] + run0["num_rows"]] = -1
    expected = oracle_load(geometry, slots_without_run0, objects.numpy())
    with pytest.raises(RuntimeError, match="rejected 2"):
        get_backend("host").transfer(batch)
    assert differing_planes(geometry, expected) == []
    rp = geometry.raw_planes[0]  # negative control: the rejected rows would have differed had they moved
    start, length = rp.row_offsets(int(run0["first_slot"]))[0]
    segment = objects.numpy()[0, :length]
    assert not np.array_equal(rp.raw.numpy()[start:start + length], segment)


@pytest.mark.parametrize(
    "table,field,value",
    [("runs", "first_slot", 10_000), ("runs", "chunk", 1), ("runs", "first_row", 31), ("runs", "num_rows", 0),
     ("groups", "plane_count", 9), ("groups", "item_begin", 1), ("planes", "object_offset_bytes", 1 << 20),
     ("planes", "layout", 7), ("planes", "group_index", 1)],
)
def test_every_forged_table_field_is_rejected_before_a_store_writes(table: str, field: str, value: int) -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.full((1, plan.object_bytes), 0x77, dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.STORE)
    planes = plan.plane_table.copy()
    target = {"runs": batch.runs, "groups": batch.group_table, "planes": planes}[table]
    target[0][field] = value
    report = _host.transfer(planes=planes.ctypes.data, groups=batch.group_table.ctypes.data,
                            runs=batch.runs.ctypes.data, objects=batch.object_addresses().ctypes.data,
                            total_items=batch.total_items, num_planes=len(planes),
                            num_groups=len(batch.group_table), num_runs=len(batch.runs), num_chunks=1,
                            object_bytes=plan.object_bytes, direction=int(Direction.STORE))
    assert report["items_rejected"] >= 1
    assert report["items_done"] + report["items_rejected"] == batch.total_items
    if table != "groups":  # a forged run or plane 0 refuses item (plane 0, run 0), whose rows start the object
        first_rows = 1 if field == "num_rows" else int(ChunkBatch.build(plan, good_slots(), objects,
                                                                         Direction.STORE).runs[0]["num_rows"])
        head = objects.numpy()[0, :first_rows * plan.plane_table[0]["row_bytes"]]
        assert (head == 0x77).all(), "a rejected item wrote its object rows"


def test_the_unforged_tables_move_everything_with_the_same_call() -> None:
    """The positive twin of the forged-field test: the same raw call on untouched tables rejects nothing."""
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.full((1, plan.object_bytes), 0x77, dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.STORE)
    report = _host.transfer(planes=plan.plane_table.ctypes.data, groups=batch.group_table.ctypes.data,
                            runs=batch.runs.ctypes.data, objects=batch.object_addresses().ctypes.data,
                            total_items=batch.total_items, num_planes=len(plan.plane_table),
                            num_groups=len(batch.group_table), num_runs=len(batch.runs), num_chunks=1,
                            object_bytes=plan.object_bytes, direction=int(Direction.STORE))
    assert report == {"items_done": batch.total_items, "items_rejected": 0, "bytes_moved": batch.payload_bytes,
                      "dma_ops": batch.total_items}
    expected = oracle_store(geometry, good_slots(), np.full((1, plan.object_bytes), 0x77, dtype=np.uint8))
    assert np.array_equal(objects.numpy(), expected)


@settings(max_examples=25, deadline=None)
@given(case=cases(soc="a2", max_chunks=8), threads=st.sampled_from([2, 3, 5, 16]))
def test_threads_give_the_same_bytes_as_one_thread(case: Case, threads: int) -> None:
    plan = case.geometry.plan()
    seeded = np.random.default_rng(case.seed).integers(0, 256, (case.num_chunks, plan.object_bytes), dtype=np.uint8)
    one = torch.from_numpy(seeded.copy())
    many = torch.from_numpy(seeded.copy())
    single = get_backend("host").store(plan, case.slots, one)
    split = get_backend("host", threads=threads).store(plan, case.slots, many)
    assert torch.equal(one, many)
    assert single.dma_ops == split.dma_ops
    expected = oracle_store(case.geometry, case.slots, seeded)
    assert np.array_equal(many.numpy(), expected)
    for rp in case.geometry.raw_planes:
        rp.raw.copy_(torch.from_numpy(np.random.default_rng(case.seed + 1).integers(0, 256, rp.raw.numel(),
                                                                                      dtype=np.uint8)))
    expected_pages = oracle_load(case.geometry, case.slots, many.numpy())
    get_backend("host", threads=threads).load(plan, case.slots, many)
    assert differing_planes(case.geometry, expected_pages) == []


@pytest.mark.parametrize("threads", [1, 4])
def test_nz_pages_round_trip_exactly_with_one_copy_per_unit(threads: int) -> None:
    geometry, slots = nz_geometry(11)
    plan = geometry.plan()
    objects = torch.full((2, plan.object_bytes), 0x3C, dtype=torch.uint8)
    backend = get_backend("host", threads=threads)
    stats = backend.store(plan, slots, objects)
    expected = oracle_store(geometry, slots, np.full((2, plan.object_bytes), 0x3C, dtype=np.uint8))
    assert np.array_equal(objects.numpy(), expected)
    batch = ChunkBatch.build(plan, slots, objects, Direction.STORE)
    live = batch.runs[batch.runs["first_slot"] >= 0]
    skipped = batch.runs.size - live.size
    # NZ plane: one copy per 32 B unit of every live row (4 per row); ND plane: one per run; zero runs: one each
    assert stats.dma_ops == int(live["num_rows"].sum()) * 4 + live.size + 2 * skipped
    for rp in geometry.raw_planes:
        rp.raw.zero_()
    expected_pages = oracle_load(geometry, slots, objects.numpy())
    backend.load(plan, slots, objects)
    assert differing_planes(geometry, expected_pages) == []


def test_negative_control_a_flipped_byte_in_the_oracle_is_noticed() -> None:
    geometry, slots = nz_geometry(12)
    plan = geometry.plan()
    objects = torch.zeros((2, plan.object_bytes), dtype=torch.uint8)
    get_backend("host").store(plan, slots, objects)
    expected = oracle_store(geometry, slots, np.zeros((2, plan.object_bytes), dtype=np.uint8))
    assert np.array_equal(objects.numpy(), expected)
    live = np.flatnonzero(expected.reshape(-1))
    expected.reshape(-1)[live[len(live) // 2]] ^= 0x01
    assert not np.array_equal(objects.numpy(), expected)
    for rp in geometry.raw_planes:
        rp.raw.zero_()
    expected_pages = oracle_load(geometry, slots, objects.numpy())
    get_backend("host").load(plan, slots, objects)
    nz = expected_pages[0]
    nz[np.flatnonzero(nz)[0]] ^= 0x80
    assert differing_planes(geometry, expected_pages) == [0]


def test_report_counts_payload_and_one_copy_per_nd_item() -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    slots = good_slots()
    slots[0][0, 5:9] = -1
    objects = torch.zeros((1, plan.object_bytes), dtype=torch.uint8)
    stats = get_backend("host").store(plan, slots, objects)
    batch = ChunkBatch.build(plan, slots, objects, Direction.STORE)
    assert (stats.backend, stats.launches, stats.payload_bytes) == ("host", 1, batch.payload_bytes)
    assert stats.dma_ops == batch.total_items
    load = get_backend("host").load(plan, slots, objects)
    assert load.dma_ops == ChunkBatch.build(plan, slots, objects, Direction.LOAD).total_items


def test_after_kernel_is_told_once_after_the_copy() -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.zeros((1, plan.object_bytes), dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.STORE)
    seen: list[object] = []
    get_backend("host").transfer(batch, after_kernel=lambda event: seen.append((event, objects.count_nonzero())))
    assert len(seen) == 1 and seen[0][0] is None and int(seen[0][1]) > 0


@pytest.mark.parametrize("threads", [0, -1, _host.MAX_THREADS + 1, 2.0, "2", True, None])
def test_bad_thread_counts_are_refused(threads: object) -> None:
    with pytest.raises(ValueError, match="threads must be"):
        HostBackend(threads=threads)  # type: ignore[arg-type]


def test_the_native_module_refuses_a_bad_direction_or_thread_count() -> None:
    args = dict(planes=0, groups=0, runs=0, objects=0, total_items=0, num_planes=0, num_groups=0, num_runs=0,
                num_chunks=0, object_bytes=0)
    with pytest.raises(ValueError, match="direction 2 is neither"):
        _host.transfer(**args, direction=2)
    with pytest.raises(ValueError, match="threads 0 must be in"):
        _host.transfer(**args, direction=0, threads=0)
    with pytest.raises(ValueError, match="needs the plane, group, run and object tables"):
        _host.transfer(**{**args, "total_items": 1}, direction=0)
    assert _host.transfer(**args, direction=1) == {"items_done": 0, "items_rejected": 0, "bytes_moved": 0,
                                                   "dma_ops": 0}


def test_objects_off_the_host_are_refused_before_any_byte_moves() -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    before = pages_of(geometry)
    objects = [torch.empty(plan.object_bytes, dtype=torch.uint8, device="meta")]
    with pytest.raises(ValueError, match="host backend runs on host memory"):
        get_backend("host").load(plan, good_slots(), objects)
    assert differing_planes(geometry, before) == []


def test_wire_sizes_match_the_python_tables() -> None:
    from lmcache_npu.ops.plan import GROUP_DESC_DTYPE, LAYOUT_VERSION, PLANE_DESC_DTYPE, RUN_DESC_DTYPE

    assert (_host.PLANE_DESC_BYTES, _host.GROUP_DESC_BYTES, _host.RUN_DESC_BYTES) == (
        PLANE_DESC_DTYPE.itemsize, GROUP_DESC_DTYPE.itemsize, RUN_DESC_DTYPE.itemsize)
    assert _host.LAYOUT_VERSION == LAYOUT_VERSION


@settings(max_examples=60, deadline=None)
@given(first_slot=st.integers(-(2**31), 2**31 - 1), chunk=st.integers(0, 2**32 - 1),
       first_row=st.integers(0, 2**32 - 1), num_rows=st.integers(0, 2**32 - 1),
       direction=st.sampled_from([Direction.STORE, Direction.LOAD]))
def test_no_forged_run_writes_outside_the_pages_or_the_objects(first_slot: int, chunk: int, first_row: int,
                                                               num_rows: int, direction: Direction) -> None:
    """Any values in run 0: the item either passes every check and moves inside its plane and object, or is
    refused; the slack around every plane's blocks and the bytes past every object stay as they were."""
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.full((2, plan.object_bytes + 64), 0x42, dtype=torch.uint8)
    batch = ChunkBatch.build(plan, [np.arange(64).reshape(2, 32), np.arange(16).reshape(2, 8)], objects, direction)
    batch.runs[0] = (first_slot, chunk, first_row, num_rows)
    slack = [(rp.raw[:rp.offset].clone(), rp.raw[rp.offset + (rp.num_blocks - 1) * rp.block_stride
                                                + rp.rows_per_block * rp.row_bytes:].clone())
             for rp in geometry.raw_planes]
    pages_before = pages_of(geometry)
    try:
        get_backend("host").transfer(batch)
    except RuntimeError as exc:  # refused, or a forged run that passed moved another byte count than the batch's
        assert "rejected" in str(exc) or "B of payload" in str(exc)
    assert (objects[:, plan.object_bytes:] == 0x42).all(), "a forged run wrote past a chunk object"
    for rp, (head, tail) in zip(geometry.raw_planes, slack):
        end = rp.offset + (rp.num_blocks - 1) * rp.block_stride + rp.rows_per_block * rp.row_bytes
        assert torch.equal(rp.raw[:rp.offset], head) and torch.equal(rp.raw[end:], tail), \
            "a forged run wrote outside a plane's blocks"
    if direction == Direction.STORE:
        assert differing_planes(geometry, pages_before) == [], "a store wrote a page"
