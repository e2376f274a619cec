"""The CUDA backend's host side of a transfer: runs cut into pieces, items in staging order cut into slices, and the
copy engine's steps (pure numpy: runs without a GPU)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction
from lmcache_npu.ops.cuda.work_order import (
    MAX_SLICES,
    PackedPart,
    copy_table,
    prefix_order,
    slice_bounds,
    sliced_load_order,
    sliced_load_tables,
    split_runs,
    work_order,
)

from .strategies import Case, cases

DIRECTIONS = st.sampled_from([Direction.STORE, Direction.LOAD])


def _batch(case: Case, direction: Direction, objects: list[torch.Tensor] | None = None) -> ChunkBatch:
    plan = case.geometry.plan()
    if objects is None:
        objects = list(torch.zeros((case.num_chunks, plan.object_bytes), dtype=torch.uint8))
    return ChunkBatch.build(plan, case.slots, objects, direction)


def _pieces(order, slice_index: int) -> list[tuple[int, int, int]]:
    """The work order's (chunk, offset in object, length) pieces of one slice."""
    return [(c, o, n) for c, o, n, k in order.piece_table.tolist() if k == slice_index]


def _rows(runs: np.ndarray) -> set[tuple[int, int, int]]:
    """(chunk, row, slot) of every row the runs name."""
    out = set()
    for run in runs:
        for r in range(int(run["num_rows"])):
            slot = int(run["first_slot"]) + r if run["first_slot"] >= 0 else -1
            out.add((int(run["chunk"]), int(run["first_row"]) + r, slot))
    return out


@settings(deadline=None)
@given(case=cases(soc="a2"), piece_bytes=st.sampled_from([0, 1, 33, 1000, 1 << 16]), direction=DIRECTIONS)
def test_pieces_name_exactly_the_batchs_rows_and_stay_small(case: Case, piece_bytes: int,
                                                           direction: Direction) -> None:
    batch = _batch(case, direction)
    plan = batch.plan
    runs, groups = split_runs(batch, piece_bytes)
    for g, (before, after) in enumerate(zip(batch.group_table, groups)):
        old = batch.runs[before["run_begin"]: before["run_begin"] + before["run_count"]]
        new = runs[after["run_begin"]: after["run_begin"] + after["run_count"]]
        assert _rows(new) == _rows(old), f"group {g}: the pieces name other rows than the runs"
        assert int(new["num_rows"].sum()) == int(old["num_rows"].sum()), f"group {g}: a row is named twice"
        planes = plan.moved_planes[after["plane_begin"]: after["plane_begin"] + after["plane_count"]]
        if piece_bytes and planes and new.size:
            widest = max(p.row_bytes for p in planes)
            assert (new["num_rows"] <= max(1, piece_bytes // widest)).all()
        rpb = int(before["rows_per_block"])
        live = new[new["first_slot"] >= 0]
        assert ((live["first_slot"] % rpb + live["num_rows"]) <= rpb).all(), "a piece crosses a block boundary"
    assert int(groups["run_count"].sum()) == runs.size


@settings(deadline=None)
@given(case=cases(soc="a2"), first=st.sampled_from([64, 1000, 1 << 16, 2 << 20]), growth=st.sampled_from([2, 4]),
       share=st.sampled_from([2, 24]), piece_bytes=st.sampled_from([0, 100, 1 << 16]), direction=DIRECTIONS,
       pipelined=st.booleans())
def test_slices_cover_every_item_and_payload_byte_once(case: Case, first: int, growth: int, share: int,
                                                       piece_bytes: int, direction: Direction,
                                                       pipelined: bool) -> None:
    batch = _batch(case, direction)
    plan = batch.plan
    bounds = slice_bounds(batch.num_chunks * plan.object_bytes, direction, pipelined, first, growth, share)
    order = work_order(batch, pipelined, piece_bytes, bounds)
    expected_items = sum(int(g["run_count"]) * int(g["plane_count"]) for g in order.group_table)
    assert len(order.items) == expected_items
    assert int(order.slice_items.sum()) == expected_items
    assert 0 < order.slice_items.size <= MAX_SLICES or expected_items == 0
    assert pipelined or order.slice_items.size <= 1
    assert (np.diff(order.items[:, 2].astype(np.int64)) >= 0).all(), "slices must follow item order"
    covered = np.zeros((case.num_chunks, plan.object_bytes), dtype=np.int32)
    for chunk, offset, length, _ in order.piece_table.tolist():
        assert 0 <= offset and offset + length <= plan.object_bytes and length > 0
        covered[chunk, offset: offset + length] += 1
    assert covered.max(initial=0) <= 1, "a byte is copied by two slices"
    offsets = plan.object_offsets
    for item in order.items:  # every item's bytes lie inside its own slice's pieces
        run, plane = order.runs[item[0]], plan.moved_planes[item[1]]
        lo = offsets[item[1]] + int(run["first_row"]) * plane.row_bytes
        hi = lo + int(run["num_rows"]) * plane.row_bytes
        inside = [(c, o, n) for c, o, n in _pieces(order, item[2]) if c == run["chunk"] and o <= lo and hi <= o + n]
        assert inside, "an item's bytes are not in its slice"


def test_slice_sizes_per_direction() -> None:
    mib = 1 << 20
    store = slice_bounds(268 * mib, Direction.STORE, True, first=mib, growth=4)
    assert list(np.diff(store, prepend=0) // mib) == [1, 4, 16, 64, 183]
    load = slice_bounds(240 * mib, Direction.LOAD, True, tail_bytes=2 * mib, tail_share=12)
    # the kernel starts on 218 MiB while the last 22 MiB cross PCIe in halving slices
    assert list(np.diff(load, prepend=0)) == [218 * mib, 11 * mib, 11 * mib // 2, 11 * mib // 4, 11 * mib // 4]
    assert list(slice_bounds(7 * mib, Direction.STORE, False)) == [7 * mib]
    assert list(slice_bounds(5, Direction.LOAD, True, tail_bytes=0, tail_share=2)) == [3, 4, 5]
    assert list(slice_bounds(1, Direction.LOAD, True)) == [1]
    assert len(slice_bounds(1 << 40, Direction.STORE, True, first=1, growth=2)) <= MAX_SLICES


def _apply(copies: np.ndarray, staging: np.ndarray, staging_address: int, objects: list[torch.Tensor],
           to_device: bool) -> None:
    """What the copy engine does with the rows: bytes between the staging array and the host objects."""
    for staging_at, host_at, nbytes, _ in copies.tolist():
        for obj in objects:
            base = obj.data_ptr()
            if base <= host_at < base + obj.numel():  # a merged copy runs on into the next object of its storage
                host = torch.as_strided(obj, (nbytes,), (1,), obj.storage_offset() + host_at - base).numpy()
                device = staging[staging_at - staging_address: staging_at - staging_address + nbytes]
                if to_device:
                    device[:] = host
                else:
                    host[:] = device
                break
        else:
            raise AssertionError(f"copy from an address in no object: {host_at:#x}")


@settings(deadline=None)
@given(case=cases(soc="a2"), pipelined=st.booleans(), first=st.sampled_from([64, 1 << 20]), direction=DIRECTIONS,
       adjacent=st.booleans(), drop=st.booleans())
def test_copies_move_every_payload_byte_between_staging_and_objects(case: Case, pipelined: bool, first: int,
                                                                     direction: Direction, adjacent: bool,
                                                                     drop: bool) -> None:
    plan = case.geometry.plan()
    nbytes = plan.object_bytes
    if adjacent:  # one allocation, objects back to back: copies merge across chunks
        objects = list(torch.zeros((case.num_chunks, nbytes), dtype=torch.uint8))
    else:
        objects = [torch.zeros(nbytes + 64, dtype=torch.uint8)[:nbytes] for _ in range(case.num_chunks)]
    batch = _batch(case, direction, objects)
    order = work_order(batch, pipelined, 100, slice_bounds(case.num_chunks * nbytes, direction, pipelined, first))
    staging_address = 1 << 40  # any device address: the copies only offset from it
    copies = copy_table(staging_address, batch, order, pipelined)
    assert (np.diff(copies[:, 3].astype(np.int64)) >= 0).all(), "copies must follow slice order"
    rng = np.random.default_rng(case.seed)
    moved = np.zeros((case.num_chunks, nbytes), dtype=bool)
    for chunk, offset, length, _ in order.piece_table.tolist():
        moved[chunk, offset: offset + length] = True
    dropped = drop and len(copies) > 0
    if dropped:  # negative control: a lost copy leaves bytes behind
        copies = copies[1:]
    staging = np.zeros(case.num_chunks * nbytes, dtype=np.uint8)
    if direction == Direction.STORE:
        staging[:] = rng.integers(1, 256, staging.size, dtype=np.uint8)
        _apply(copies, staging, staging_address, objects, to_device=False)
        got = np.stack([o.numpy() for o in objects])
        ok = np.array_equal(got[moved], staging.reshape(case.num_chunks, nbytes)[moved])
    else:
        for o in objects:
            o.copy_(torch.from_numpy(rng.integers(1, 256, nbytes, dtype=np.uint8)))
        _apply(copies, staging, staging_address, objects, to_device=True)
        want = np.stack([o.numpy() for o in objects])
        ok = np.array_equal(staging.reshape(case.num_chunks, nbytes)[moved], want[moved])
    if dropped:
        assert not ok, "the check missed a dropped copy"
    else:
        assert ok, "a payload byte was not copied"


def _slice_masks(order, num_chunks: int, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, byte) masks of a two-slice work order: the mapped prefix's bytes, and those moved through staging."""
    masks = np.zeros((2, num_chunks, nbytes), dtype=bool)
    for k in (0, 1):
        for chunk, offset, length in _pieces(order, k):
            masks[k, chunk, offset: offset + length] = True
    return masks[0], masks[1]


@settings(deadline=None)
@given(case=cases(soc="a2"), share=st.sampled_from([2, 3, 24]), piece_bytes=st.sampled_from([0, 100, 1 << 16]),
       drop=st.booleans())
def test_a_mapped_prefix_and_the_copies_write_every_stored_byte_once(case: Case, share: int, piece_bytes: int,
                                                                    drop: bool) -> None:
    plan = case.geometry.plan()
    nbytes = plan.object_bytes
    objects = [torch.zeros(nbytes + 64, dtype=torch.uint8)[:nbytes] for _ in range(case.num_chunks)]
    batch = _batch(case, Direction.STORE, objects)
    order = prefix_order(batch, piece_bytes, share)
    if order is None:  # the split would leave a side empty: the store runs unsplit
        return
    assert order.slice_items.size == 2 and (order.items[:, 2] <= 1).all()
    rng = np.random.default_rng(case.seed)
    kernel_output = rng.integers(1, 256, (case.num_chunks, nbytes), dtype=np.uint8)  # never 0
    prefix, staged = _slice_masks(order, case.num_chunks, nbytes)
    assert not (prefix & staged).any(), "a byte is both written by the kernel and copied"
    # The kernel: the prefix's items straight into the objects, the rest into staging (whose prefix holds zeros).
    staging = np.where(prefix, 0, kernel_output).reshape(-1)
    for chunk, obj in enumerate(objects):
        obj.numpy()[prefix[chunk]] = kernel_output[chunk][prefix[chunk]]
    staging_address = 1 << 40
    copies = copy_table(staging_address, batch, order, False, from_slice=1)
    dropped = drop and len(copies) > 0
    if dropped:  # negative control: a lost copy leaves the staged bytes behind
        copies = copies[1:]
    _apply(copies, staging, staging_address, objects, to_device=False)
    got = np.stack([o.numpy() for o in objects])
    written = prefix | staged
    ok = np.array_equal(got[written], kernel_output[written])
    if dropped:
        assert not ok, "the check missed a dropped copy"
    else:
        assert ok, "a stored byte is missing, or a copy overwrote the prefix with staging's bytes"


@settings(deadline=None)
@given(case=cases(soc="a2"), share=st.sampled_from([2, 3, 24]), piece_bytes=st.sampled_from([0, 100, 1 << 16]),
       drop=st.booleans())
def test_a_mapped_prefix_load_reads_every_loaded_byte_from_the_object(case: Case, share: int, piece_bytes: int,
                                                                     drop: bool) -> None:
    """A load's kernel reads slice 0's items from the host objects and the rest from staging, which the copies
    filled from slice 1 only: every byte it reads holds the object's byte, whatever was in staging before."""
    plan = case.geometry.plan()
    nbytes = plan.object_bytes
    rng = np.random.default_rng(case.seed)
    objects = [torch.from_numpy(rng.integers(1, 256, nbytes + 64, dtype=np.uint8))[:nbytes]
               for _ in range(case.num_chunks)]
    batch = _batch(case, Direction.LOAD, objects)
    order = prefix_order(batch, piece_bytes, share)
    if order is None:  # the split would leave a side empty: the load runs unsplit
        return
    assert order.slice_items.size == 2 and (order.items[:, 2] <= 1).all()
    mapped, staged = _slice_masks(order, case.num_chunks, nbytes)
    assert not (mapped & staged).any(), "a byte is both read from the host and copied"
    staging = np.zeros(case.num_chunks * nbytes, dtype=np.uint8)  # zeros: a byte the copies missed reads 0
    staging_address = 1 << 40
    copies = copy_table(staging_address, batch, order, False, from_slice=1)
    dropped = drop and len(copies) > 0
    if dropped:  # negative control: a lost copy leaves zeros where the kernel reads staging
        copies = copies[1:]
    _apply(copies, staging, staging_address, objects, to_device=True)
    want = np.stack([o.numpy() for o in objects])
    read = np.where(mapped, want, staging.reshape(case.num_chunks, nbytes))  # what the kernel's items read
    ok = np.array_equal(read[mapped | staged], want[mapped | staged])
    if dropped:
        assert not ok, "the check missed a dropped copy"
    else:
        assert ok, "a loaded byte is missing from staging"


def _item_bytes(order, plan, k: int, num_chunks: int) -> np.ndarray:
    """(chunk, byte) mask of what slice k's kernel reads from staging: its items' rows of their planes."""
    mask = np.zeros((num_chunks, plan.object_bytes), dtype=bool)
    first = int(order.slice_items[:k].sum())
    for run_id, plane_id, slice_id, _ in order.items[first: first + int(order.slice_items[k])].tolist():
        assert slice_id == k
        run, plane = order.runs[run_id], plan.moved_planes[plane_id]
        begin = plan.object_offsets[plane_id] + int(run["first_row"]) * plane.row_bytes
        mask[int(run["chunk"]), begin: begin + int(run["num_rows"]) * plane.row_bytes] = True
    return mask


@settings(deadline=None)
@given(case=cases(soc="a2"), piece_bytes=st.sampled_from([0, 100, 1 << 16]), data=st.data(), lose=st.booleans())
def test_a_sliced_loads_slices_copy_what_their_kernels_read_and_no_later_slices_bytes(case: Case, piece_bytes: int,
                                                                                      data, lose: bool) -> None:
    plan = case.geometry.plan()
    n, nbytes = len(plan.moved_planes), plan.object_bytes
    count = data.draw(st.integers(1, 5), label="slices")
    plane_slice = np.array(data.draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n), label="planes"))
    adjacent = data.draw(st.booleans(), label="one allocation")  # objects back to back: copies merge across chunks
    objects = (list(torch.zeros((case.num_chunks, nbytes), dtype=torch.uint8)) if adjacent
               else [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(case.num_chunks)])
    batch = _batch(case, Direction.LOAD, objects)
    order = sliced_load_order(batch, plane_slice, count, piece_bytes)
    staging_address = 1 << 40
    planned = sliced_load_tables(batch, plane_slice, count, piece_bytes, staging_address, 24,
                                 lambda nbytes: np.zeros(max(nbytes, 64), np.uint8)).copies  # the runtime's copies
    copies = copy_table(staging_address, batch, order, True)
    assert np.array_equal(planned, copies), "the planned copies differ from the stretches of the pieces"
    assert order.slice_items.size == count and int(order.slice_items.sum()) == len(order.items)
    assert sorted(map(tuple, order.items[:, :2].tolist())) == sorted(
        map(tuple, work_order(batch, False, piece_bytes).items[:, :2].tolist())), "items lost or doubled"
    assert (order.items[:, 2] == plane_slice[order.items[:, 1]]).all(), "an item is in another slice than its plane"
    runs, plane_id = order.runs[order.items[:, 0]], order.items[:, 1]
    rows = np.array([p.row_bytes for p in plan.moved_planes], dtype=np.int64)[plane_id]
    start = (runs["chunk"].astype(np.int64) * nbytes + np.array(plan.object_offsets, dtype=np.int64)[plane_id]
             + runs["first_row"].astype(np.int64) * rows)
    same_slice = order.items[1:, 2] == order.items[:-1, 2]
    assert (np.diff(order.items[:, 2].astype(np.int64)) >= 0).all(), "items out of slice order"
    assert (np.diff(start)[same_slice] > 0).all(), "a slice's items are out of staging order"
    copies = planned
    assert (np.diff(copies[:, 3].astype(np.int64)) >= 0).all(), "copies must follow slice order"
    lost = lose and len(copies) > 0
    if lost:  # negative control: a lost copy leaves a byte some kernel reads unstaged
        copies = copies[np.arange(len(copies)) != data.draw(st.integers(0, len(copies) - 1), label="lost")]
    staged_by = np.full((case.num_chunks, nbytes), -1, dtype=np.int64)
    for staging_at, _, length, k in copies.tolist():
        at = staging_at - staging_address
        flat = staged_by.reshape(-1)[at: at + length]
        flat[flat < 0] = k
    complete = True
    for k in range(count):
        reads = _item_bytes(order, plan, k, case.num_chunks)
        complete &= bool((staged_by[reads] == k).all())
        later = np.zeros_like(reads)
        for j in range(k + 1, count):
            later |= _item_bytes(order, plan, j, case.num_chunks)
        assert not (staged_by[later & ~reads] == k).any() or lost, "a slice copied a later slice's bytes"
    if lost:
        assert not complete, "the check missed a lost copy"
    else:
        assert complete, "a slice's kernel reads bytes its copies did not stage"


def _packed_mismatches(buffer: np.ndarray, tables, order, objects: np.ndarray, status_bytes: int) -> list[str]:
    """The packed parts that differ from the work order's arrays (zeros where the kernel counts and reports)."""
    expected = {PackedPart.GROUPS: order.group_table, PackedPart.RUNS: order.runs, PackedPart.OBJECTS: objects,
                PackedPart.ITEMS: order.items, PackedPart.SLICE_ITEMS: order.slice_items,
                PackedPart.COUNTERS: np.zeros(order.slice_items.size, dtype=np.uint32),
                PackedPart.STATUS: np.zeros(status_bytes, dtype=np.uint8)}
    wrong = []
    for part, array in expected.items():
        want = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        at = int(tables.offsets[part])
        if at % 64 or not np.array_equal(buffer[at: at + want.size], want):
            wrong.append(part.name)
    return wrong


@settings(deadline=None)
@given(case=cases(soc="a2"), piece_bytes=st.sampled_from([0, 100, 1 << 16]), staged=st.booleans(),
       small=st.booleans(), data=st.data())
def test_the_packed_sliced_tables_are_the_orders_tables_and_zeros(case: Case, piece_bytes: int, staged: bool,
                                                                   small: bool, data) -> None:
    """What the CUDA backend's native call reads, packed by one native call: every part equals the work order's
    (a grown buffer too), counters and status are zeroed over stale bytes, copies carry the staging address."""
    plan = case.geometry.plan()
    count = data.draw(st.integers(1, 5), label="slices")
    n = len(plan.moved_planes)
    plane_slice = np.array(data.draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n), label="planes"))
    batch = _batch(case, Direction.LOAD)
    order = sliced_load_order(batch, plane_slice, count, piece_bytes)
    staging, status_bytes = (1 << 40) if staged else 0, 24
    buffers = [np.full(64 if small else 1 << 20, 0xAB, dtype=np.uint8)]

    def buffer(nbytes: int) -> np.ndarray:
        if buffers[-1].size < nbytes:
            buffers.append(np.full(nbytes, 0xAB, dtype=np.uint8))
        return buffers[-1]

    tables = sliced_load_tables(batch, plane_slice, count, piece_bytes, staging, status_bytes, buffer)
    objects = (staging + np.arange(batch.num_chunks, dtype=np.uint64) * np.uint64(plan.object_bytes) if staged
               else batch.object_addresses())
    assert tables.table_bytes <= buffers[-1].size
    assert _packed_mismatches(buffers[-1], tables, order, objects, status_bytes) == []
    assert (tables.num_items, tables.num_runs, tables.num_groups) == (len(order.items), order.runs.size,
                                                                      len(order.group_table))
    assert np.array_equal(tables.slice_items, order.slice_items)
    want = copy_table(staging, batch, order, True) if staged else np.zeros((0, 4), dtype=np.uint64)
    assert np.array_equal(tables.copies, want), "the packed copies differ from the order's"
    # negative control: one wrong byte in a part is noticed
    parts = [p for p in (PackedPart.GROUPS, PackedPart.OBJECTS, PackedPart.STATUS)]
    part = data.draw(st.sampled_from(parts), label="corrupted part")
    buffers[-1][int(tables.offsets[part])] ^= 0x01
    assert _packed_mismatches(buffers[-1], tables, order, objects, status_bytes) == [part.name]


def test_a_sliced_load_order_names_the_plane_outside_its_slices() -> None:
    from hypothesis import find

    case = find(cases(soc="a2"), lambda c: len(c.geometry.plan().moved_planes) >= 2)
    batch = _batch(case, Direction.LOAD)
    plane_slice = np.zeros(len(batch.plan.moved_planes), dtype=np.int64)
    plane_slice[1] = 3
    try:
        sliced_load_order(batch, plane_slice, 3)
    except ValueError as exc:
        assert batch.plan.moved_planes[1].label in str(exc) and "slice 3" in str(exc)
    else:
        raise AssertionError("a plane in slice 3 of 3 was accepted")
    try:
        sliced_load_tables(batch, plane_slice, 3, 0, 0, 24, lambda nbytes: np.zeros(max(nbytes, 64), np.uint8))
    except ValueError as exc:
        assert batch.plan.moved_planes[1].label in str(exc) and "slice 3" in str(exc)
    else:
        raise AssertionError("the packed planner accepted a plane in slice 3 of 3")
    try:
        sliced_load_order(batch, plane_slice[:1], 3)
    except ValueError as exc:
        assert "moved planes" in str(exc)
    else:
        raise AssertionError("too few plane slices were accepted")


def test_the_native_order_refuses_tables_that_point_outside_themselves() -> None:
    """A forged plane, group or run table is refused before any index is followed, naming the entry."""
    from hypothesis import find

    from lmcache_npu import _host

    case = find(cases(soc="a2"), lambda c: len(c.geometry.plan().moved_planes) >= 2)
    batch = _batch(case, Direction.LOAD)
    plan = batch.plan
    plane_slice = np.zeros(len(plan.moved_planes), dtype=np.int64)

    def order(planes=plan.plane_table, groups=batch.group_table, runs=batch.runs, chunks=batch.num_chunks):
        return _host.sliced_load_order(planes, groups, runs, plane_slice, 1, chunks, 1 << 16, plan.object_bytes)

    order()  # the real tables pass
    planes = plan.plane_table.copy()
    planes[0]["group_index"] = 99
    groups = batch.group_table.copy()
    groups[0]["run_count"] = len(batch.runs) + 1
    runs = batch.runs.copy()
    runs[0]["chunk"] = batch.num_chunks
    for forged, named in ((dict(planes=planes), "names group 99"), (dict(groups=groups), "outside the"),
                          (dict(runs=runs), "outside the batch's")):
        with pytest.raises(ValueError, match=named):
            order(**forged)
