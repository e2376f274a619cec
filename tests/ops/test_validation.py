"""Bad input is refused before launch with a message naming the thing and the rule; nothing is touched."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu import _emu
from lmcache_npu.ops import ChunkBatch, Direction, GroupSpec, PageLayout, Plane, TransferPlan, get_backend
from lmcache_npu.ops.plan import CORE_STATUS_DTYPE, RUN_DESC_DTYPE

from .oracle import Geometry, allocate, good_slots, oracle_load, small_geometry
from .strategies import Placement, placements



@pytest.fixture(params=["torch", "emu", "host"])
def backend(request: pytest.FixtureRequest):
    return get_backend(request.param)


def assert_untouched(geometry: Geometry, objects: torch.Tensor, before_pages, before_objects) -> None:
    assert torch.equal(objects, before_objects)
    for rp, b in zip(geometry.raw_planes, before_pages):
        assert torch.equal(rp.raw, b)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda s: s[0].__setitem__((0, 17), 64), "group 0, chunk 0, row 17: slot 64 is outside [0, 64)"),
        (lambda s: s[1].__setitem__((0, 3), -2), "group 1, chunk 0, row 3: slot -2 is outside [0, 48)"),
        (lambda s: s.__setitem__(1, s[1][:, :4]), "group 1: slots have shape (1, 4), expected (1, 8)"),
        (lambda s: s.__setitem__(0, s[0].astype(np.float32)), "group 0: slots must be integers"),
        (lambda s: s.__setitem__(1, None), "group 1: slots are required"),
        (lambda s: s.pop(), "slots has 1 entries, the plan has 2 groups"),
    ],
)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_bad_slots_raise_before_launch(backend, mutate, message: str, direction: str) -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    slots = good_slots()
    mutate(slots)
    objects = torch.full((1, plan.object_bytes), 9, dtype=torch.uint8)
    before_pages, before_objects = [rp.raw.clone() for rp in geometry.raw_planes], objects.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(backend, direction)(plan, slots, objects)
    assert_untouched(geometry, objects, before_pages, before_objects)


def test_duplicate_load_target_is_refused(backend) -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    slots = [np.concatenate([np.arange(16), np.arange(16)]).reshape(1, 32), np.arange(8).reshape(1, 8)]
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group 0: slot 0 is the load target of chunk 0 row 0 and of chunk 0 row 16"):
        backend.load(plan, slots, objects)
    backend.store(plan, slots, objects)  # reading one page twice is fine


def test_overlapping_store_objects_are_refused(backend) -> None:
    plan = small_geometry().plan()
    arena = torch.zeros(plan.object_bytes + 64, dtype=torch.uint8)
    objects = [arena[: plan.object_bytes], arena[64: 64 + plan.object_bytes]]
    slots = [np.arange(64).reshape(2, 32), np.arange(16).reshape(2, 8)]
    with pytest.raises(ValueError, match="chunks 0 and 1: store objects overlap"):
        backend.store(plan, slots, objects)


def test_short_object_is_refused(backend) -> None:
    plan = small_geometry().plan()
    with pytest.raises(ValueError, match=f"chunk 0: object holds 10 B, the plan needs {plan.object_bytes} B"):
        backend.store(plan, good_slots(), [torch.zeros(10, dtype=torch.uint8)])


def raw_pages(num_blocks: int, rows: int, row_bytes: int, stride: int) -> torch.Tensor:
    raw = torch.zeros(num_blocks * max(stride, rows * row_bytes) + rows * row_bytes, dtype=torch.uint8)
    return torch.as_strided(raw, (num_blocks, rows * row_bytes), (stride, 1))


@pytest.mark.parametrize(
    "groups,planes,chunk_tokens,message",
    [
        ([GroupSpec(16)], [Plane(raw_pages(4, 16, 8, 100), 0, 16, 8)], 32, "block stride 100 B is smaller than a block's rows \\(128 B\\)"),
        ([GroupSpec(16)], [Plane(raw_pages(4, 16, 8, 128), 1, 16, 8)], 32, "group 1 does not exist"),
        ([GroupSpec(64, compress_ratio=4)], [Plane(raw_pages(4, 8, 8, 64), 0, 8, 8)], 32,
         "rows_per_block 8 x compress_ratio 4 must equal group 0's tokens_per_block 64"),
        ([GroupSpec(16, compress_ratio=128)], [], 32, "chunk_tokens 32 is not a multiple of compress_ratio 128"),
        ([GroupSpec(16)], [Plane(raw_pages(4, 16, 8, 128), 0, 16, 8), Plane(raw_pages(5, 16, 8, 128), 0, 16, 8)], 32,
         "has 5 blocks of 16 rows but the group's other planes have 4 blocks of 16 rows"),
        ([GroupSpec(16)], [Plane(raw_pages(4, 16, 48, 768), 0, 16, 48, PageLayout.FRACTAL_NZ, 16)], 32,
         "FRACTAL_NZ unit of 16 B is not a multiple of 32 B"),
        ([GroupSpec(16)], [Plane(torch.zeros(4, 128, dtype=torch.float16), 0, 16, 8)], 32, "2-D uint8 tensor"),
        ([GroupSpec(16)], [Plane(raw_pages(4, 16, 8, 128)[:, :64], 0, 16, 8)], 32, "pages hold 64 B per block"),
        ([GroupSpec(16, sliding_window=0)], [], 32, "sliding_window must be >= 1"),
    ],
)
def test_malformed_plans_are_refused(groups, planes, chunk_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferPlan(groups, planes, chunk_tokens)


def test_310p_rules_are_checked_before_launch() -> None:
    g = torch.Generator().manual_seed(1)
    odd = Geometry([GroupSpec(16)], [allocate(4, 16, 132, 0, 0, g)], 32)
    with pytest.raises(ValueError, match="row_bytes 132 is not a multiple of 32 B; 310p has no DataCopyPad"):
        get_backend("emu", soc="310p").store(odd.plan(), [np.arange(32).reshape(1, 32)],
                                             torch.zeros(1, odd.plan().object_bytes, dtype=torch.uint8))
    bf16 = Geometry([GroupSpec(16)], [allocate(4, 16, 64, 0, 0, g, dtype=torch.bfloat16)], 32)
    with pytest.raises(ValueError, match="310p has no bf16"):
        get_backend("emu", soc="310p").store(bf16.plan(), [np.arange(32).reshape(1, 32)],
                                             torch.zeros(1, bf16.plan().object_bytes, dtype=torch.uint8))


def test_skipped_groups_are_never_touched() -> None:
    g = torch.Generator().manual_seed(5)
    geometry = Geometry([GroupSpec(16), GroupSpec(8, sliding_window=8, skip=True, skip_reason="state")],
                        [allocate(4, 16, 64, 0, 0, g), allocate(4, 8, 4096, 0, 1, g)], 32)
    plan = geometry.plan()
    assert [p.group for p in plan.moved_planes] == [0]
    state_before = geometry.raw_planes[1].raw.clone()
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    for name in ("torch", "emu", "host"):
        backend = get_backend(name)
        backend.store(plan, [np.arange(32).reshape(1, 32), None], objects)
        backend.load(plan, [np.arange(32).reshape(1, 32), None], objects)
    assert torch.equal(geometry.raw_planes[1].raw, state_before)


def launch_raw(plan: TransferPlan, batch: ChunkBatch, runs: np.ndarray, status: np.ndarray, pages_writable: bool,
               tile_bytes: Optional[int] = None, zero_tile_bytes: Optional[int] = None,
               atomic_add_on_entry: bool = False):
    tiling = _emu.ub_tiling(196608)
    tiling = {"tile_bytes": tiling["tile_bytes"] if tile_bytes is None else tile_bytes,
              "zero_tile_bytes": tiling["zero_tile_bytes"] if zero_tile_bytes is None else zero_tile_bytes}
    objects = batch.object_addresses()
    regions = [(p.base_addr, p.extent_bytes, pages_writable, p.label) for p in plan.moved_planes]
    regions += [(o.data_ptr(), plan.object_bytes, not pages_writable, "obj") for o in batch.objects]
    for name, a in (("planes", plan.plane_table), ("groups", batch.group_table), ("runs", runs), ("objects", objects)):
        regions.append((a.ctypes.data, a.nbytes, False, name))
    regions.append((status.ctypes.data, status.nbytes, True, "status"))
    _emu.launch(target="a2", block_dim=len(status), ub_bytes=196608, order="sequential", seed=0,
                planes=plan.plane_table.ctypes.data, groups=batch.group_table.ctypes.data, runs=runs.ctypes.data,
                objects=objects.ctypes.data, status=status.ctypes.data, total_items=batch.total_items,
                num_planes=len(plan.plane_table), num_groups=len(batch.group_table), num_runs=len(runs),
                num_chunks=batch.num_chunks, direction=int(batch.direction), tile_bytes=tiling["tile_bytes"],
                zero_tile_bytes=tiling["zero_tile_bytes"], regions=regions, atomic_add_on_entry=atomic_add_on_entry)


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_previous_kernels_atomic_add_does_not_turn_writes_into_sums(direction) -> None:
    """The emulator starts each core with atomic add on, as a previous kernel on the stream may leave it; the kernel
    turns it off at entry, so pages and objects get the bytes, not the bytes plus what was there."""
    geometry = small_geometry()
    plan = geometry.plan()
    g = torch.Generator().manual_seed(11)
    objects = torch.randint(0, 256, (1, plan.object_bytes), dtype=torch.uint8, generator=g)
    for rp in geometry.raw_planes:  # what an add would add to: random bytes everywhere
        rp.raw.copy_(torch.randint(0, 256, rp.raw.shape, dtype=torch.uint8, generator=g))
    batch = ChunkBatch.build(plan, good_slots(), objects, direction)
    if direction == Direction.LOAD:
        expected_pages = oracle_load(geometry, good_slots(), objects.numpy())
    else:
        expected_objects = objects.clone()
        get_backend("torch").store(plan, good_slots(), expected_objects)
    status = np.zeros(4, dtype=CORE_STATUS_DTYPE)
    launch_raw(plan, batch, batch.runs, status, pages_writable=direction == Direction.LOAD, atomic_add_on_entry=True)
    assert int(status["items_rejected"].sum()) == 0
    if direction == Direction.LOAD:
        for rp, want in zip(geometry.raw_planes, expected_pages):
            assert np.array_equal(rp.raw.numpy(), want)
    else:
        assert torch.equal(objects, expected_objects)


@pytest.mark.parametrize(
    "field,value",
    [("first_slot", 10_000), ("first_slot", 15), ("num_rows", 40), ("chunk", 7), ("first_row", 31), ("num_rows", 0)],
)
def test_kernel_rejects_malformed_runs_without_writing(field: str, value: int) -> None:
    """Bypassing host validation: the kernel's own checks skip the item, and the emulator sees no stray write."""
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.LOAD)
    runs = batch.runs.copy()
    runs[0][field] = value
    objects.copy_(torch.randint(0, 256, objects.shape, dtype=torch.uint8))
    slots_without_run0 = good_slots()
    r0 = batch.runs[0]
    slots_without_run0[0][r0["chunk"], r0["first_row"]: r0["first_row"] + r0["num_rows"]] = -1
    expected = oracle_load(geometry, slots_without_run0, objects.numpy())
    status = np.zeros(4, dtype=CORE_STATUS_DTYPE)
    launch_raw(plan, batch, runs, status, pages_writable=True)
    assert int(status["items_rejected"].sum()) == 2  # run 0 x the two planes of group 0
    for rp, want in zip(geometry.raw_planes, expected):
        assert np.array_equal(rp.raw.numpy(), want)


@pytest.mark.parametrize("tile_bytes, zero_tile_bytes", [(0, None), (16, None), (48, None), (None, 0), (None, 40)])
def test_the_kernel_refuses_tiles_dma_cannot_move_without_touching_memory(tile_bytes, zero_tile_bytes) -> None:
    """A tile of 0 bytes looped forever; under 32 B or not a multiple of 32 B no DataCopy can move it. The kernel
    refuses every item of the launch (run in a child process, so a hang fails the test instead of the suite)."""
    import multiprocessing

    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.randint(0, 256, (1, plan.object_bytes), dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.LOAD)
    status = np.zeros(4, dtype=CORE_STATUS_DTYPE)
    pages_before = [rp.raw.clone() for rp in geometry.raw_planes]
    shared = multiprocessing.get_context("fork").Array("b", status.nbytes)

    def child() -> None:
        launch_raw(plan, batch, batch.runs, status, pages_writable=True, tile_bytes=tile_bytes,
                   zero_tile_bytes=zero_tile_bytes)
        shared[:] = status.tobytes()
        for rp, before in zip(geometry.raw_planes, pages_before):
            assert torch.equal(rp.raw, before), "the refused launch wrote pages"

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    if process.is_alive():
        process.kill()
        pytest.fail(f"the kernel hung with tile_bytes={tile_bytes}, zero_tile_bytes={zero_tile_bytes}")
    assert process.exitcode == 0
    report = np.frombuffer(bytes(shared[:]), dtype=CORE_STATUS_DTYPE)
    assert int(report["items_rejected"].sum()) == batch.total_items and int(report["items_done"].sum()) == 0
    assert int(report["bytes_moved"].sum()) == 0


def test_emu_violation_is_a_runtime_error_with_a_rule() -> None:
    geometry = small_geometry()
    plan = geometry.plan()
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    batch = ChunkBatch.build(plan, good_slots(), objects, Direction.STORE)
    status = np.zeros(2, dtype=CORE_STATUS_DTYPE)
    regions_without_objects = []
    with pytest.raises(_emu.EmuViolation) as info:
        tiling = _emu.ub_tiling(196608)
        _emu.launch(target="a2", block_dim=2, ub_bytes=196608, order="sequential", seed=0,
                    planes=plan.plane_table.ctypes.data, groups=batch.group_table.ctypes.data,
                    runs=batch.runs.ctypes.data, objects=batch.object_addresses().ctypes.data,
                    status=status.ctypes.data, total_items=batch.total_items, num_planes=len(plan.plane_table),
                    num_groups=2, num_runs=len(batch.runs), num_chunks=1, direction=0,
                    tile_bytes=tiling["tile_bytes"], zero_tile_bytes=tiling["zero_tile_bytes"],
                    regions=regions_without_objects)
    assert isinstance(info.value, RuntimeError)
    assert info.value.rule == "gm-bounds"
    assert RUN_DESC_DTYPE.itemsize == _emu.RUN_DESC_BYTES


# --- the native boundary: what the kernels' int32/uint32 tables cannot address, and memory that overlaps ---

MAX_I32, MAX_U32 = 2**31 - 1, 2**32 - 1


def meta_plane(num_blocks: int, rows_per_block: int, row_bytes: int, group: int = 0) -> Plane:
    """A plane of any size without memory: only plan construction reads it."""
    pages = torch.empty((num_blocks, rows_per_block * row_bytes), dtype=torch.uint8, device="meta")
    return Plane(pages, group, rows_per_block, row_bytes, name=f"big{group}")


@pytest.mark.parametrize(
    "groups,planes,chunk_tokens,message",
    [
        ([GroupSpec(1)], [meta_plane(2**31, 1, 1)], 1,
         f"group 0: 2147483648 blocks x 1 rows = 2147483648 rows exceed {MAX_I32}: the kernels address a slot as an "
         "int32"),
        ([GroupSpec(2**16, name="wide")], [meta_plane(2**15, 2**16, 1)], 2**16,
         f"group 0 (wide): 32768 blocks x 65536 rows = 2147483648 rows exceed {MAX_I32}"),
        ([GroupSpec(1)], [], 2**31, f"group 0: 2147483648 rows per chunk exceed {MAX_I32}"),
        ([GroupSpec(1)], [meta_plane(1, 1, 2**32)], 1,
         f"plane 0 (big0): row_bytes 4294967296 exceeds {MAX_U32}, the largest the kernel's uint32 plane field holds"),
    ],
)
def test_what_the_kernel_tables_cannot_hold_is_refused_at_plan_construction(groups, planes, chunk_tokens: int,
                                                                            message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TransferPlan(groups, planes, chunk_tokens)


def test_the_largest_addressable_group_is_accepted() -> None:
    """Negative control of the row limit: 2^31 - 1 rows (one short of the refusal) is a valid plan."""
    plan = TransferPlan([GroupSpec(1)], [meta_plane(MAX_I32, 1, 1)], 1)
    assert plan.group_num_blocks[0] * plan.group_rows_per_block[0] == MAX_I32
    assert int(plan.plane_table["num_blocks"][0]) == MAX_I32


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("bad", [2**64 - 1, 2**63])
def test_unsigned_slots_above_int64_are_refused_before_any_byte_moves(backend, direction: str, bad: int) -> None:
    """2^64 - 1 as uint64 used to become -1 (a skipped row: a store wrote zeros); 2^63 a negative slot."""
    geometry = small_geometry()
    plan = geometry.plan()
    slots = [s.astype(np.uint64) for s in good_slots()]
    slots[0][0, 5] = np.uint64(bad)
    objects = torch.full((1, plan.object_bytes), 9, dtype=torch.uint8)
    before_pages, before_objects = [rp.raw.clone() for rp in geometry.raw_planes], objects.clone()
    with pytest.raises(ValueError, match=re.escape(f"group 0, chunk 0, row 5: slot {bad} (uint64) exceeds the int64 "
                                                   "range")):
        getattr(backend, direction)(plan, slots, objects)
    assert_untouched(geometry, objects, before_pages, before_objects)


def test_unsigned_slots_in_range_move_the_same_bytes_as_signed_ones(backend) -> None:
    """Negative control: uint64 (and uint32) slot arrays are accepted and read as the same slots."""
    geometry = small_geometry()
    plan = geometry.plan()
    expected = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    backend.store(plan, good_slots(), expected)
    assert int(expected.sum()) > 0
    for dtype in (np.uint64, np.uint32):
        got = torch.full((1, plan.object_bytes), 9, dtype=torch.uint8)
        backend.store(plan, [s.astype(dtype) for s in good_slots()], got)
        assert torch.equal(got, expected)


def plane_in(raw: torch.Tensor, offset: int, num_blocks: int, block_bytes: int, stride: int, group: int,
             name: str) -> Plane:
    pages = torch.as_strided(raw, (num_blocks, block_bytes), (stride if num_blocks > 1 else block_bytes, 1), offset)
    return Plane(pages, group, 1, block_bytes, name=name)


def block_owners(size: int, offset: int, num_blocks: int, block_bytes: int, stride: int) -> np.ndarray:
    """Independent oracle: which block id of a plane owns each byte of the buffer (-1: none)."""
    owner = np.full(size, -1, dtype=np.int64)
    for b in range(num_blocks):
        start = offset + b * stride
        owner[start: start + block_bytes] = b
    return owner


@settings(max_examples=300, deadline=None)
@given(placements())
def test_planes_that_share_a_byte_they_may_not_are_refused(placement: Placement) -> None:
    """Same group: no byte in common. Different groups (one shared block pool): only under one block id."""
    size = placement.buffer_bytes
    raw = torch.zeros(size + 64, dtype=torch.uint8)
    planes = [plane_in(raw, o, n, b, s, g, name) for o, n, b, s, g, name in
              zip(placement.offset, placement.num_blocks, placement.block_bytes, placement.stride, placement.group,
                  ("A", "B"))]
    owners = [block_owners(size, o, n, b, s) for o, n, b, s in
              zip(placement.offset, placement.num_blocks, placement.block_bytes, placement.stride)]
    both = (owners[0] >= 0) & (owners[1] >= 0)
    same_group = placement.group[0] == placement.group[1]
    clash = bool(np.any(both & (same_group | (owners[0] != owners[1]))))
    if clash:
        with pytest.raises(ValueError, match=r"planes [AB] \(group \d, pages \[0x[0-9a-f]+, 0x[0-9a-f]+\)\) and [AB] "
                                             r"\(group \d, pages .*\) overlap: block \d+ \[0x"):
            TransferPlan([GroupSpec(1), GroupSpec(1)], planes, 1)
    else:
        TransferPlan([GroupSpec(1), GroupSpec(1)], planes, 1)


@given(block_bytes=st.integers(1, 64), pad=st.integers(0, 64), num_blocks=st.integers(1, 5),
       overlap=st.integers(0, 1), group_b=st.integers(0, 1))
@settings(max_examples=100, deadline=None)
def test_a_plane_one_byte_into_another_is_refused_and_an_adjacent_one_accepted(block_bytes: int, pad: int,
                                                                               num_blocks: int, overlap: int,
                                                                               group_b: int) -> None:
    stride = block_bytes + pad
    end = (num_blocks - 1) * stride + block_bytes
    raw = torch.zeros(2 * end + stride, dtype=torch.uint8)
    a = plane_in(raw, 0, num_blocks, block_bytes, stride, 0, "layer.0:k")
    b = plane_in(raw, end - overlap, num_blocks, block_bytes, stride, group_b, "layer.0:v")
    groups = [GroupSpec(1), GroupSpec(1)]
    if not overlap:
        TransferPlan(groups, [a, b], 1)
        return
    # block num_blocks - 1 of A meets block 0 of B: different ids, so even a second group may not share them
    if num_blocks == 1 and group_b == 1:
        TransferPlan(groups, [a, b], 1)  # block 0 of each: one block id, owned by one group at a time
        return
    base = raw.data_ptr()
    last = base + (num_blocks - 1) * stride
    with pytest.raises(ValueError, match=re.escape(
            f"block {num_blocks - 1} [{last:#x}, {last + block_bytes:#x}) and block 0 [{base + end - 1:#x}, "
            f"{base + end - 1 + block_bytes:#x}) share bytes")) as info:
        TransferPlan(groups, [a, b], 1)
    assert "planes layer.0:k (group 0" in str(info.value) and f"layer.0:v (group {group_b}" in str(info.value)


def test_interleaved_k_and_v_of_one_tensor_are_accepted() -> None:
    """CUDA flash [nb, 2, bs, h, d]: K and V page ranges overlap, their blocks do not."""
    raw = torch.zeros(8 * 2 * 64, dtype=torch.uint8)
    k = plane_in(raw, 0, 8, 64, 128, 0, "k")
    v = plane_in(raw, 64, 8, 64, 128, 0, "v")
    plan = TransferPlan([GroupSpec(1)], [k, v], 1)
    v_shifted = plane_in(raw, 63, 8, 64, 128, 0, "v")  # negative control: one byte into K's blocks
    with pytest.raises(ValueError, match="planes k .* and v .* overlap"):
        TransferPlan([GroupSpec(1)], [k, v_shifted], 1)
    assert len(plan.planes) == 2


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("overlap", [0, 1, 64])
def test_a_chunk_object_on_a_planes_pages_is_refused_before_any_byte_moves(backend, direction: str,
                                                                          overlap: int) -> None:
    """The object ends `overlap` bytes into the pages of a plane (0: adjacent, the negative control)."""
    g = torch.Generator().manual_seed(7)
    object_bytes = 32 * 32  # 32 rows per chunk of 32 B, a multiple of the 64 B object alignment
    raw = torch.randint(0, 256, (object_bytes + 4 * 512 + 64,), dtype=torch.uint8, generator=g)
    pages = torch.as_strided(raw, (4, 512), (512, 1), object_bytes)
    plan = TransferPlan([GroupSpec(16)], [Plane(pages, 0, 16, 32, name="layer.3:kv")], 32)
    assert plan.object_bytes == object_bytes
    obj = raw[overlap: object_bytes + overlap]
    assert obj.numel() == object_bytes
    slots = [np.arange(32).reshape(1, 32)]
    before = raw.clone()
    if overlap == 0:
        getattr(backend, direction)(plan, slots, [obj])
        return
    start = obj.data_ptr()
    with pytest.raises(ValueError, match=re.escape(
            f"chunk 0: object [{start:#x}, {start + object_bytes:#x}) overlaps the pages of plane layer.3:kv "
            f"[{pages.data_ptr():#x}, {pages.data_ptr() + 4 * 512:#x})")):
        getattr(backend, direction)(plan, slots, [obj])
    assert torch.equal(raw, before)


def test_a_chunk_object_on_a_skipped_groups_pages_is_refused(backend) -> None:
    """A skipped group's state moves nowhere, yet a store into its memory would still corrupt the model."""
    g = torch.Generator().manual_seed(5)
    geometry = Geometry([GroupSpec(16), GroupSpec(8, sliding_window=8, skip=True, skip_reason="state")],
                        [allocate(4, 16, 64, 0, 0, g), allocate(4, 8, 4096, 0, 1, g)], 32)
    plan = geometry.plan()
    state = geometry.raw_planes[1].raw
    obj = state[: plan.object_bytes]
    before = state.clone()
    with pytest.raises(ValueError, match=r"chunk 0: object .* overlaps the pages of plane p1"):
        backend.store(plan, [np.arange(32).reshape(1, 32), None], [obj])
    assert torch.equal(state, before)


def test_store_objects_overlapping_each_other_name_their_ranges(backend) -> None:
    plan = small_geometry().plan()
    arena = torch.zeros(2 * plan.object_bytes, dtype=torch.uint8)
    objects = [arena[: plan.object_bytes], arena[plan.object_bytes - 1: 2 * plan.object_bytes - 1]]
    slots = [np.arange(64).reshape(2, 32), np.arange(16).reshape(2, 8)]
    second = arena.data_ptr() + plan.object_bytes - 1
    with pytest.raises(ValueError, match=re.escape(f"chunks 0 and 1: store objects overlap ([{arena.data_ptr():#x}, "
                                                   f"{arena.data_ptr() + plan.object_bytes:#x}) and [{second:#x}, ")):
        backend.store(plan, slots, objects)
    assert int(arena.sum()) == 0
    adjacent = [arena[: plan.object_bytes], arena[plan.object_bytes:]]  # negative control
    backend.store(plan, slots, adjacent)
    assert int(arena.sum()) > 0
