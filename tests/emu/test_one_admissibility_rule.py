"""One admissibility rule for every backend (csrc/common/transfer_plan.h: ContractItemInTables, ContractAdmissible).

Behaviour: the host backend (lmcache_npu._host) and the AscendC kernel under the emulator (lmcache_npu._emu) are fed
the same tables, each forged to break one rule of the contract, and must reject exactly the same work items: the same
items_rejected, the same bytes everywhere, and not one byte written for a rejected item (every other item moves).
Source: no backend keeps its own copy of a check the contract holds, and each calls the contract first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from lmcache_npu import _emu, _host
from lmcache_npu.ops import ChunkBatch, Direction, GroupSpec, PageLayout, Plane, TransferPlan
from lmcache_npu.ops.plan import CORE_STATUS_DTYPE

ROOT = Path(__file__).resolve().parents[2]
ROWS = 16  # rows_per_block of both groups, so a plane named into the other group fails only the group-index rule
BLOCKS = 4
PAD = 32  # bytes between blocks: the block stride is not the block size
SLACK = 96  # bytes before block 0 and after the last block, which no item may touch
CORES = 3
UB_BYTES = 196608
SENTINEL = 0x77


@dataclass
class Tables:
    planes: np.ndarray
    groups: np.ndarray
    runs: np.ndarray
    objects: np.ndarray  # chunk object addresses
    counts: dict[str, int] = field(default_factory=dict)  # table sizes passed instead of the tables' own

    def items(self, group: int, planes: list[int] | None = None, runs: list[int] | None = None) -> list[tuple[int, int]]:
        """(plane index, run index) of every work item of `group`, or of the named planes and runs of it."""
        g = self.groups[group]
        plane_range = range(int(g["plane_begin"]), int(g["plane_begin"]) + int(g["plane_count"]))
        run_range = range(int(g["run_begin"]), int(g["run_begin"]) + int(g["run_count"]))
        return [(p, r) for p in plane_range if planes is None or p in planes
                for r in run_range if runs is None or r in runs]


@dataclass
class Setup:
    plan: TransferPlan
    raws: list[torch.Tensor]  # each plane's whole buffer: slack, blocks and padding
    objects: torch.Tensor
    batch: ChunkBatch

    def tables(self) -> Tables:
        return Tables(self.plan.plane_table.copy(), self.batch.group_table.copy(), self.batch.runs.copy(),
                      self.batch.object_addresses())

    def state(self) -> list[np.ndarray]:
        return [self.objects.numpy().copy(), *(raw.numpy().copy() for raw in self.raws)]

    def restore(self, state: list[np.ndarray]) -> None:
        self.objects.copy_(torch.from_numpy(state[0]))
        for raw, saved in zip(self.raws, state[1:]):
            raw.copy_(torch.from_numpy(saved))


def make_setup(direction: Direction) -> Setup:
    """Two groups of 16-row blocks: planes 0 and 1 (64 and 96 B rows) in group 0, plane 2 (32 B rows) in group 1;
    two chunks, with a zero run in each group and blocks out of order."""
    gen = torch.Generator().manual_seed(32)
    raws, planes = [], []
    for group, row_bytes in ((0, 64), (0, 96), (1, 32)):
        stride = ROWS * row_bytes + PAD
        raw = torch.randint(0, 256, (2 * SLACK + (BLOCKS - 1) * stride + ROWS * row_bytes,), dtype=torch.uint8,
                            generator=gen)
        pages = torch.as_strided(raw, (BLOCKS, ROWS * row_bytes), (stride, 1), SLACK)
        planes.append(Plane(pages, group, ROWS, row_bytes, name=f"p{len(planes)}"))
        raws.append(raw)
    plan = TransferPlan([GroupSpec(16), GroupSpec(32, compress_ratio=2)], planes, chunk_tokens=32)
    block = lambda b: np.arange(b * ROWS, (b + 1) * ROWS)  # noqa: E731 - the slots of one block
    chunk1 = np.concatenate([block(3), block(1)])
    chunk1[4:8] = -1
    group1 = np.stack([block(3), block(1)])
    group1[1, :2] = -1
    slots = [np.stack([np.concatenate([block(2), block(0)]), chunk1]), group1]
    if direction == Direction.STORE:
        objects = torch.full((2, plan.object_bytes), SENTINEL, dtype=torch.uint8)
    else:
        objects = torch.randint(0, 256, (2, plan.object_bytes), dtype=torch.uint8, generator=gen)
    return Setup(plan, raws, objects, ChunkBatch.build(plan, slots, objects, direction))


def arguments(setup: Setup, tables: Tables) -> dict[str, int]:
    return {"planes": tables.planes.ctypes.data, "groups": tables.groups.ctypes.data, "runs": tables.runs.ctypes.data,
            "objects": tables.objects.ctypes.data, "total_items": setup.batch.total_items,
            "num_planes": tables.counts.get("num_planes", len(tables.planes)),
            "num_groups": tables.counts.get("num_groups", len(tables.groups)),
            "num_runs": tables.counts.get("num_runs", len(tables.runs)),
            "num_chunks": tables.counts.get("num_chunks", setup.batch.num_chunks),
            "direction": int(setup.batch.direction)}


def run_host(setup: Setup, tables: Tables) -> tuple[int, int]:
    report = _host.transfer(**arguments(setup, tables), object_bytes=setup.plan.object_bytes)
    return report["items_done"], report["items_rejected"]


def run_emu(setup: Setup, tables: Tables) -> tuple[int, int]:
    args = arguments(setup, tables)
    status = np.zeros(CORES, dtype=CORE_STATUS_DTYPE)
    load = setup.batch.direction == Direction.LOAD
    regions = [(p.base_addr, p.extent_bytes, load, f"pages:{p.name}") for p in setup.plan.moved_planes]
    regions += [(o.data_ptr(), setup.plan.object_bytes, not load, f"object:{i}") for i, o in
                enumerate(setup.batch.objects)]
    regions += [(a.ctypes.data, a.nbytes, False, name) for name, a in
                (("planes", tables.planes), ("groups", tables.groups), ("runs", tables.runs),
                 ("objects", tables.objects))]
    regions.append((status.ctypes.data, status.nbytes, True, "core status"))
    tiling = _emu.ub_tiling(UB_BYTES)
    _emu.launch(**args, target="a2", block_dim=CORES, ub_bytes=UB_BYTES, order="shuffled", seed=5,
                status=status.ctypes.data, tile_bytes=tiling["tile_bytes"],
                zero_tile_bytes=tiling["zero_tile_bytes"], regions=regions)
    return int(status["items_done"].sum()), int(status["items_rejected"].sum())


def destination(setup: Setup, original: Tables, plane_index: int, run_index: int) -> tuple[int, slice] | None:
    """Where item (plane, run) of the unforged tables writes: (index into Setup.state(), byte range); None: nowhere."""
    plane, run = original.planes[plane_index], original.runs[run_index]
    row_bytes, rows = int(plane["row_bytes"]), int(run["num_rows"])
    if setup.batch.direction == Direction.STORE:
        start = int(run["chunk"]) * setup.plan.object_bytes + int(plane["object_offset_bytes"]) + \
            int(run["first_row"]) * row_bytes
        return 0, slice(start, start + rows * row_bytes)
    if int(run["first_slot"]) < 0:
        return None  # a load's zero run leaves its pages alone
    block, row = divmod(int(run["first_slot"]), int(plane["rows_per_block"]))
    start = SLACK + block * int(plane["block_stride_bytes"]) + row * row_bytes
    return 1 + plane_index, slice(start, start + rows * row_bytes)


def expected_state(setup: Setup, before: list[np.ndarray], moved: list[np.ndarray], original: Tables,
                   victims: list[tuple[int, int]]) -> list[np.ndarray]:
    """`moved` (every item moved) with the victims' destinations as they were before the call."""
    expected = [a.copy() for a in moved]
    for plane_index, run_index in victims:
        where = destination(setup, original, plane_index, run_index)
        if where is not None:
            index, span = where
            expected[index].reshape(-1)[span] = before[index].reshape(-1)[span]
    return expected


Forge = Callable[[Tables], None]
Victims = Callable[[Tables], list[tuple[int, int]]]


def _set(table: str, row: int, field_name: str, value: int) -> Forge:
    return lambda t: getattr(t, table)[row].__setitem__(field_name, value)


def _one_less(name: str, table: str) -> Forge:
    return lambda t: t.counts.__setitem__(name, len(getattr(t, table)) - 1)


def _both(first: Forge, second: Forge) -> Forge:
    def forge(tables: Tables) -> None:
        first(tables)
        second(tables)
    return forge


# One case per rule of the contract: (rule, forge, the items of the unforged tables it must refuse).
CASES: list[tuple[str, Forge, Victims]] = [
    ("group index names another group", _set("planes", 0, "group_index", 1), lambda t: t.items(0, planes=[0])),
    ("group index past the group table", _set("planes", 2, "group_index", 9), lambda t: t.items(1)),
    ("plane range wraps past 2**32", _set("groups", 0, "plane_begin", 0xFFFFFFFF), lambda t: t.items(0)),
    ("run range wraps past 2**32", _set("groups", 1, "run_begin", 0xFFFFFFFF), lambda t: t.items(1)),
    ("plane index past the plane table", _one_less("num_planes", "planes"), lambda t: t.items(1)),
    ("run index past the run table", _one_less("num_runs", "runs"), lambda t: t.items(1, runs=[len(t.runs) - 1])),
    ("chunk past the object table", _set("runs", 0, "chunk", 2), lambda t: t.items(0, runs=[0])),
    ("empty run", _set("runs", 0, "num_rows", 0), lambda t: t.items(0, runs=[0])),
    ("rows past the chunk", _set("runs", 0, "first_row", 31), lambda t: t.items(0, runs=[0])),
    ("slot past the plane", _set("runs", 0, "first_slot", BLOCKS * ROWS), lambda t: t.items(0, runs=[0])),
    ("run crosses its block", _set("runs", 0, "first_slot", 8), lambda t: t.items(0, runs=[0])),
    ("rows_per_block zero", _set("planes", 1, "rows_per_block", 0), lambda t: t.items(0, planes=[1])),
    ("rows_per_block not the group's", _set("planes", 1, "rows_per_block", 8), lambda t: t.items(0, planes=[1])),
    ("row_bytes zero", _set("planes", 1, "row_bytes", 0), lambda t: t.items(0, planes=[1])),
    ("unknown layout", _set("planes", 0, "layout", 7), lambda t: t.items(0, planes=[0])),
    ("NZ without a unit", _both(_set("planes", 0, "layout", int(PageLayout.FRACTAL_NZ)),
                                _set("planes", 0, "nz_unit_bytes", 0)), lambda t: t.items(0, planes=[0])),
    # 64 B is a unit the AscendC rules accept on their own: only the contract's "unit divides the row" refuses it
    ("NZ unit not dividing the row", _both(_set("planes", 2, "layout", int(PageLayout.FRACTAL_NZ)),
                                           _set("planes", 2, "nz_unit_bytes", 64)), lambda t: t.items(1)),
]


@pytest.fixture(params=[Direction.STORE, Direction.LOAD], ids=["store", "load"])
def setup(request: pytest.FixtureRequest) -> Setup:
    return make_setup(request.param)


@pytest.fixture
def moved(setup: Setup) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(state before, state after every item moved): the unforged tables on both backends, which must agree."""
    before = setup.state()
    assert run_host(setup, setup.tables()) == (setup.batch.total_items, 0)
    after = setup.state()
    setup.restore(before)
    assert run_emu(setup, setup.tables()) == (setup.batch.total_items, 0)
    assert all(np.array_equal(a, b) for a, b in zip(setup.state(), after)), "host and emulator moved different bytes"
    setup.restore(before)
    return before, after


@pytest.mark.parametrize("rule,forge,victims", CASES, ids=[c[0] for c in CASES])
def test_host_and_emulator_reject_the_same_items_and_write_none_of_their_bytes(
        setup: Setup, moved: tuple[list[np.ndarray], list[np.ndarray]], rule: str, forge: Forge,
        victims: Victims) -> None:
    before, after = moved
    original = setup.tables()
    refused = victims(original)
    assert refused, f"{rule}: the case names no item"
    expected = expected_state(setup, before, after, original, refused)
    reports = {}
    for name, run in (("host", run_host), ("emu", run_emu)):
        setup.restore(before)
        tables = setup.tables()
        forge(tables)
        reports[name] = run(setup, tables)
        for index, (got, want) in enumerate(zip(setup.state(), expected)):
            assert np.array_equal(got, want), f"{rule}: {name} left buffer {index} other than expected"
    assert reports["host"] == reports["emu"], f"{rule}: host and emulator disagree: {reports}"
    assert reports["host"][1] == len(refused), f"{rule}: {reports['host']} for {len(refused)} refused items"


def test_negative_control_the_group_index_case_cuda_used_to_miss_would_move_bytes(
        setup: Setup, moved: tuple[list[np.ndarray], list[np.ndarray]]) -> None:
    """CUDA's own Admissible had no group-index check: plane 0 named into group 1 (same rows_per_block) passed every
    other rule. Had the item moved, the buffers would be `after`; both backends leave the item's bytes alone, and
    that difference is what the test above compares."""
    before, after = moved
    original = setup.tables()
    for run in (run_host, run_emu):
        setup.restore(before)
        tables = setup.tables()
        tables.planes[0]["group_index"] = 1
        run(setup, tables)
        got = setup.state()
        assert not all(np.array_equal(a, b) for a, b in zip(got, after)), "the forged plane's items moved"
        expected = expected_state(setup, before, after, original, original.items(0, planes=[0]))
        flipped = [a.copy() for a in expected]
        index, span = next(w for w in (destination(setup, original, 0, r) for _, r in original.items(0, planes=[0]))
                           if w is not None)
        flipped[index].reshape(-1)[span.start] ^= 0x01
        assert not all(np.array_equal(a, b) for a, b in zip(got, flipped)), "a flipped byte went unnoticed"


# A check of the contract, as a pattern that matches a backend's own copy of it (comments stripped).
COMMON_CHECKS = {
    "group index": r"group_index\s*!=",
    "plane/run in the group's range": r"-\s*group\.(plane|run)_begin",
    "chunk bound": r"run\.chunk\s*>=",
    "rows inside the chunk": r"run\.num_rows\s*>\s*group\.rows_per_chunk",
    "rows_per_block of the group": r"rows_per_block\s*!=\s*group\.rows_per_block",
    "run inside one block": r"%\s*plane\.rows_per_block\)\s*\+\s*run\.num_rows",
    "slot inside the plane": r"slot\W*(/\s*plane\.rows_per_block\s*)?>=[^;]*num_blocks",
    "NZ unit divides the row": r"row_bytes\s*%\s*(plane\.nz_unit_bytes|unit)\b",
    "indices inside the tables": r"(plane_index|work\.[xy])\s*>=\s*[\w.]*num_(planes|runs)",
}
BACKENDS = ["csrc/host/kv_transfer_host.cpp", "csrc/ascendc/kv_transfer.h", "csrc/cuda/kv_transfer.cu"]


def own_copies(source: str) -> list[str]:
    code = re.sub(r"//[^\n]*", "", source)
    return [name for name, pattern in COMMON_CHECKS.items() if re.search(pattern, code)]


@pytest.mark.parametrize("path", BACKENDS)
def test_no_backend_keeps_its_own_copy_of_a_common_check(path: str) -> None:
    source = (ROOT / path).read_text()
    assert own_copies(source) == [], f"{path} re-implements part of ContractAdmissible"
    assert "ContractAdmissible(" in source and "ContractItemInTables(" in source


def test_the_contract_holds_every_common_check() -> None:
    contract = (ROOT / "csrc/common/transfer_plan.h").read_text()
    assert own_copies(contract) == [name for name in COMMON_CHECKS if name != "indices inside the tables"]
    assert re.search(r"plane_index\s*<\s*num_planes\s*&&\s*run_index\s*<\s*num_runs", contract)


def test_negative_control_the_old_cuda_copy_is_caught() -> None:
    """The CUDA kernel's Admissible and Paired as they were before the contract held the rule."""
    old_cuda = """
    if (work.x >= num_runs || work.y >= num_planes) return;
    if (run.chunk >= num_chunks || run.num_rows == 0) return false;  // a comment: group_index != g
    if (static_cast<uint64_t>(run.first_row) + run.num_rows > group.rows_per_chunk) return false;
    if (plane.rows_per_block == 0 || plane.rows_per_block != group.rows_per_block || plane.row_bytes == 0) return false;
    if (slot / plane.rows_per_block >= plane.num_blocks) return false;
    if (static_cast<uint64_t>(slot % plane.rows_per_block) + run.num_rows > plane.rows_per_block) return false;
    return plane.layout == kPageFractalNZ && plane.nz_unit_bytes > 0 && plane.row_bytes % plane.nz_unit_bytes == 0;
    return work.x >= group.run_begin && work.x - group.run_begin < group.run_count;
    """
    assert own_copies(old_cuda) == [name for name in COMMON_CHECKS if name != "group index"]
