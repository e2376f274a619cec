"""ChunkBatch: one transfer call's chunks, validated and cut into runs before any launch."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .. import _host
from .plan import GROUP_DESC_DTYPE, MAX_U32, RUN_DESC_DTYPE, Direction, TransferPlan

SlotArray = Union[torch.Tensor, np.ndarray]


def _as_slot_matrix(plan: TransferPlan, group: int, slots: Optional[SlotArray], num_chunks: int) -> np.ndarray:
    rows = plan.rows_per_chunk[group]
    if slots is None:
        raise ValueError(f"group {group}: slots are required ({rows} rows per chunk); only skipped groups may pass None")
    array = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
    if array.dtype.kind not in "iu":
        raise ValueError(f"group {group}: slots must be integers, got dtype {array.dtype}")
    if array.shape != (num_chunks, rows):
        raise ValueError(f"group {group}: slots have shape {tuple(array.shape)}, expected ({num_chunks}, {rows})")
    if array.dtype.kind == "u" and array.dtype.itemsize >= 8 and array.size:
        # uint64 above 2^63 - 1 would wrap to a negative int64: 2^64 - 1 becomes -1, a skipped row
        bad = np.argwhere(array > np.iinfo(np.int64).max)
        if bad.size:
            c, r = (int(x) for x in bad[0])
            raise ValueError(f"group {group}, chunk {c}, row {r}: slot {int(array[c, r])} ({array.dtype}) exceeds "
                             f"the int64 range (max {np.iinfo(np.int64).max}); slots are signed, -1 skips a row")
    return np.ascontiguousarray(array, dtype=np.int64)


_OUT_OF_RANGE, _TWICE = 1, 2  # csrc/host/slot_runs.h, SlotProblem


def _slot_runs(plan: TransferPlan, group: int, matrix: np.ndarray, direction: Direction) -> np.ndarray:
    """The group's runs: each chunk's rows cut into maximal stretches of consecutive slots inside one block (a store
    keeps its stretches of skipped rows: they become zeros), natively (csrc/host/slot_runs.h: every transfer builds
    them). Raises, naming the row, for a slot outside the group's pages or one a load would write twice (the page
    would then depend on core timing)."""
    rows_per_block = plan.group_rows_per_block[group]
    limit = plan.group_num_blocks[group] * rows_per_block
    runs, problem, at, again = _host.slot_runs(matrix, rows_per_block, limit, direction == Direction.STORE,
                                               direction == Direction.LOAD)
    return _checked_runs(plan, group, CutRuns(matrix, runs, problem, at, again))


@dataclass(frozen=True)
class CutRuns:
    """One group's slot matrix cut into runs natively (csrc/host/slot_runs.h, or move_runs.h from block windows),
    with the first problem the cut found (0: none) and the row-major positions it names."""

    slots: np.ndarray  # (chunks, rows_per_chunk) int64
    runs: np.ndarray  # RunDesc bytes
    problem: int
    at: int
    again: int


def _checked_runs(plan: TransferPlan, group: int, cut: CutRuns) -> np.ndarray:
    """The cut's runs, or the problem it found raised naming the group, chunk, row and slot."""
    matrix, rows = cut.slots, cut.slots.shape[1]
    if cut.problem == _OUT_OF_RANGE:
        rows_per_block = plan.group_rows_per_block[group]
        limit = plan.group_num_blocks[group] * rows_per_block
        c, r = divmod(cut.at, rows)
        raise ValueError(
            f"group {group}, chunk {c}, row {r}: slot {int(matrix[c, r])} is outside [0, {limit}) "
            f"({plan.group_num_blocks[group]} blocks x {rows_per_block} rows); use -1 to skip a row"
        )
    if cut.problem == _TWICE:
        raise ValueError(
            f"group {group}: slot {int(matrix.reshape(-1)[cut.at])} is the load target of chunk {cut.at // rows} row "
            f"{cut.at % rows} and of chunk {cut.again // rows} row {cut.again % rows}"
        )
    # no field narrowed a value: first_slot < the group's rows <= MAX_SLOT_ROWS (plan), first_row and num_rows
    # <= rows_per_chunk <= MAX_SLOT_ROWS (plan), chunk < num_chunks <= MAX_U32 (ChunkBatch.build)
    return cut.runs.view(RUN_DESC_DTYPE)


def as_chunk_objects(plan: TransferPlan,
                     objects: Union[torch.Tensor, Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The chunk objects as a tuple, each checked to be a contiguous 1-D uint8 tensor of at least the plan's object
    bytes; raises ValueError naming the first that is not."""
    items = list(objects.unbind(0)) if isinstance(objects, torch.Tensor) and objects.dim() == 2 else list(objects)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"chunk {i}: a chunk object must be a contiguous 1-D uint8 tensor")
        if t.numel() < plan.object_bytes:
            raise ValueError(f"chunk {i}: object holds {t.numel()} B, the plan needs {plan.object_bytes} B")
    return tuple(items)


def _check_disjoint(objects: Sequence[torch.Tensor], nbytes: int) -> None:
    """A store writes each object's first `nbytes`: two objects sharing one would hold whichever core wrote last."""
    spans = sorted((t.data_ptr(), i) for i, t in enumerate(objects))
    for (a, i), (b, j) in zip(spans, spans[1:]):
        if b < a + nbytes:
            raise ValueError(f"chunks {i} and {j}: store objects overlap ([{a:#x}, {a + nbytes:#x}) and "
                             f"[{b:#x}, {b + nbytes:#x})); each chunk needs its own {nbytes} B")


def _check_clear_of_pages(plan: TransferPlan, objects: Sequence[torch.Tensor]) -> None:
    """An object inside a plane's page range would be pages the transfer reads while writing, or the reverse;
    only objects on the planes' device share their address space."""
    local = [i for i, t in enumerate(objects) if t.device == plan.device]
    if not local or not plan.object_bytes:
        return
    starts = np.array([objects[i].data_ptr() for i in local], dtype=np.uint64)
    found = plan.page_spans.first_overlap(starts, plan.object_bytes)
    if found is not None:
        index, comb = found
        start = int(starts[index])
        raise ValueError(
            f"chunk {local[index]}: object [{start:#x}, {start + plan.object_bytes:#x}) overlaps the pages of plane "
            f"{comb.label} [{comb.base:#x}, {comb.end:#x}); a chunk object may share no byte with KV pages"
        )


@dataclass(frozen=True, eq=False)
class ChunkBatch:
    """The chunks of one transfer call, in one direction, with their run tables."""

    plan: TransferPlan
    direction: Direction
    slots: tuple[Optional[np.ndarray], ...]
    objects: tuple[torch.Tensor, ...]
    runs: np.ndarray
    group_table: np.ndarray
    total_items: int

    @property
    def num_chunks(self) -> int:
        return len(self.objects)

    @functools.cached_property
    def payload_bytes(self) -> int:
        """Bytes the transfer writes: every moved row (and, on store, the zeros of skipped rows); computed once."""
        rows: dict[int, int] = {}  # moved rows per group, counted once for all its planes
        total = 0
        for p in self.plan.moved_planes:
            if p.group not in rows:
                matrix = self.slots[p.group]
                rows[p.group] = matrix.size if self.direction == Direction.STORE else int(
                    np.count_nonzero(matrix >= 0))
            total += rows[p.group] * p.row_bytes
        return total

    @functools.cached_property
    def _addresses(self) -> np.ndarray:
        addresses = np.array([t.data_ptr() for t in self.objects], dtype=np.uint64)
        addresses.flags.writeable = False
        return addresses

    def object_addresses(self) -> np.ndarray:
        """Each chunk object's first byte (read once per batch, read-only)."""
        return self._addresses

    @functools.cached_property
    def _storages(self) -> np.ndarray:
        storages = np.array([t.untyped_storage().data_ptr() for t in self.objects], dtype=np.uint64)
        storages.flags.writeable = False
        return storages

    def object_storages(self) -> np.ndarray:
        """The allocation (storage) each chunk object lies in: one copy never spans two (read once per batch)."""
        return self._storages

    def native_tables(self) -> dict[str, np.ndarray]:
        """The plane, group, run and object tables native code reads by address; the caller keeps them alive for the
        call. An empty run table becomes one zero row, so every table has a valid address (the count stays 0)."""
        runs = self.runs if self.runs.size else np.zeros(1, dtype=self.runs.dtype)
        return {"planes": self.plan.plane_table, "groups": self.group_table, "runs": runs,
                "objects": self.object_addresses()}

    def native_arguments(self, tables: Mapping[str, np.ndarray]) -> dict[str, int]:
        """The keyword arguments every native transfer entry takes: `tables`' addresses and the batch's counts."""
        return {**{name: int(array.ctypes.data) for name, array in tables.items()},
                "total_items": self.total_items, "num_planes": len(tables["planes"]),
                "num_groups": len(tables["groups"]), "num_runs": int(self.runs.size), "num_chunks": self.num_chunks,
                "direction": int(self.direction)}

    def chunk_window(self, begin: int, end: int) -> "ChunkBatch":
        """Chunks [begin, end) as a batch of their own, chunk indices counted from `begin`: what a backend whose
        staging holds fewer chunks than the batch launches per window. Runs are already cut and checked."""
        if not 0 <= begin < end <= self.num_chunks:
            raise ValueError(f"chunk window [{begin}, {end}) is not inside the batch's {self.num_chunks} chunks")
        if begin == 0 and end == self.num_chunks:
            return self
        parts, table = [], self.group_table.copy()
        run_cursor = item_cursor = 0
        for g, group in enumerate(self.group_table):
            first = int(group["run_begin"])
            runs = self.runs[first: first + int(group["run_count"])]
            lo, hi = np.searchsorted(runs["chunk"], [begin, end])  # a group's runs are in chunk order (_runs)
            part = runs[lo:hi].copy()
            part["chunk"] -= begin
            table[g]["run_begin"], table[g]["run_count"], table[g]["item_begin"] = run_cursor, part.size, item_cursor
            run_cursor += part.size
            item_cursor += part.size * int(group["plane_count"])
            parts.append(part)
        return ChunkBatch(
            plan=self.plan,
            direction=self.direction,
            slots=tuple(None if matrix is None else matrix[begin:end] for matrix in self.slots),
            objects=self.objects[begin:end],
            runs=np.concatenate(parts) if parts else np.zeros(0, dtype=RUN_DESC_DTYPE),
            group_table=table,
            total_items=int(item_cursor),
        )

    @functools.cached_property
    def _plane_rows(self) -> frozenset[bytes]:
        return frozenset(row.tobytes() for row in self.plan.plane_table)

    def for_plan(self, plan: TransferPlan) -> "ChunkBatch":
        """This batch on `plan`, a plane subset of its plan (`TransferPlan.plane_subset`): the same checked slots and
        runs for the groups the subset keeps, nothing validated again (this batch was), so a sliced load checks its
        rows once and builds each slice's batch cheaply."""
        if plan is self.plan:
            return self
        own = self._plane_rows  # same pages at the same object offsets
        if (plan.groups != self.plan.groups or plan.object_bytes != self.plan.object_bytes
                or plan.rows_per_chunk != self.plan.rows_per_chunk
                or not all(row.tobytes() in own for row in plan.plane_table)):
            raise ValueError("for_plan: the plan is not a plane subset of the batch's plan")
        moved = set(plan.moved_group_indices())
        runs, table, items = _group_runs(plan, [
            self.runs[int(group["run_begin"]): int(group["run_begin"]) + int(group["run_count"])] if g in moved
            else self.runs[:0] for g, group in enumerate(self.group_table)])
        return ChunkBatch(
            plan=plan,
            direction=self.direction,
            slots=tuple(matrix if g in moved else None for g, matrix in enumerate(self.slots)),
            objects=self.objects,
            runs=runs,
            group_table=table,
            total_items=items,
        )

    def chunk_windows(self, chunks_per_window: int) -> list["ChunkBatch"]:
        """The batch cut into consecutive windows of at most `chunks_per_window` chunks."""
        if chunks_per_window < 1:
            raise ValueError(f"chunks_per_window must be at least 1, got {chunks_per_window}")
        return [self.chunk_window(begin, min(begin + chunks_per_window, self.num_chunks))
                for begin in range(0, self.num_chunks, chunks_per_window)]

    @classmethod
    def build(
        cls,
        plan: TransferPlan,
        slots: Sequence[Optional[SlotArray]],
        objects: Union[torch.Tensor, Sequence[torch.Tensor]],
        direction: Direction,
    ) -> "ChunkBatch":
        direction = Direction(direction)
        object_list = _checked_objects(plan, objects, direction)
        if len(slots) != len(plan.groups):
            raise ValueError(f"slots has {len(slots)} entries, the plan has {len(plan.groups)} groups")
        moved = plan.moved_group_set
        matrices = [_as_slot_matrix(plan, g, slots[g], len(object_list)) if g in moved else None
                    for g in range(len(plan.groups))]
        return cls._assembled(plan, direction, object_list, matrices, [
            _slot_runs(plan, g, matrices[g], direction) if g in moved  # type: ignore[arg-type]
            else _NO_RUNS for g in range(len(plan.groups))])

    @classmethod
    def from_cut_runs(
        cls,
        plan: TransferPlan,
        cuts: Sequence[Optional[CutRuns]],
        objects: Sequence[torch.Tensor],
        direction: Direction,
    ) -> "ChunkBatch":
        """`build` over slots already cut natively (one CutRuns per moved group, chunks in `objects`' order): the
        object checks and the cut's problems raise exactly as `build`'s."""
        direction = Direction(direction)
        object_list = _checked_objects(plan, objects, direction)
        if len(cuts) != len(plan.groups):
            raise ValueError(f"cut runs has {len(cuts)} entries, the plan has {len(plan.groups)} groups")
        moved = plan.moved_group_set
        matrices: list[Optional[np.ndarray]] = []
        runs: list[np.ndarray] = []
        for g, cut in enumerate(cuts):
            if g not in moved:
                matrices.append(None)
                runs.append(_NO_RUNS)
                continue
            if cut is None or cut.slots.shape != (len(object_list), plan.rows_per_chunk[g]):
                raise ValueError(f"group {g}: the cut runs cover {None if cut is None else cut.slots.shape}, the "
                                 f"batch needs ({len(object_list)}, {plan.rows_per_chunk[g]}) slots")
            matrices.append(cut.slots)
            runs.append(_checked_runs(plan, g, cut))
        return cls._assembled(plan, direction, object_list, matrices, runs)

    @classmethod
    def _assembled(cls, plan: TransferPlan, direction: Direction, objects: tuple[torch.Tensor, ...],
                   matrices: Sequence[Optional[np.ndarray]], runs_by_group: Sequence[np.ndarray]) -> "ChunkBatch":
        runs, table, items = _group_runs(plan, runs_by_group)
        return cls(plan=plan, direction=direction, slots=tuple(matrices), objects=objects, runs=runs,
                   group_table=table, total_items=items)


_NO_RUNS = np.zeros(0, dtype=RUN_DESC_DTYPE)
_NO_RUNS.flags.writeable = False


def _checked_objects(plan: TransferPlan, objects: Union[torch.Tensor, Sequence[torch.Tensor]],
                     direction: Direction) -> tuple[torch.Tensor, ...]:
    """The batch's chunk objects, refused before any launch where the kernel could not use them safely."""
    object_list = as_chunk_objects(plan, objects)
    num_chunks = len(object_list)
    if num_chunks < 1:
        raise ValueError("a transfer needs at least one chunk")
    if num_chunks > MAX_U32:
        raise ValueError(f"a transfer of {num_chunks} chunks exceeds {MAX_U32}, the kernel's uint32 chunk index")
    _check_clear_of_pages(plan, object_list)
    if direction == Direction.STORE:
        _check_disjoint(object_list, plan.object_bytes)
    return object_list


def _group_runs(plan: TransferPlan, runs_by_group: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """A batch's runs (its groups' in group order), its group table over `plan` and its item count."""
    moved = plan.moved_group_set
    table = np.zeros(len(plan.groups), dtype=GROUP_DESC_DTYPE)
    run_cursor = item_cursor = 0
    for g, runs in enumerate(runs_by_group):
        plane_begin, plane_count = plan.group_plane_range(g) if g in moved else (0, 0)
        if run_cursor + runs.size > MAX_U32:
            raise ValueError(f"group {g}: the transfer cuts into more than {MAX_U32} runs, the most the kernel's "
                             "uint32 run index holds; transfer fewer chunks at a time")
        table[g] = (plan.rows_per_chunk[g], plan.group_rows_per_block[g] or 0, plane_begin, plane_count,
                    run_cursor, runs.size, item_cursor)
        run_cursor += runs.size
        item_cursor += runs.size * plane_count
    runs = np.concatenate(runs_by_group) if runs_by_group else np.zeros(0, dtype=RUN_DESC_DTYPE)
    return runs, table, int(item_cursor)
