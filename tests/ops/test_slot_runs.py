"""ChunkBatch's runs (csrc/host/slot_runs.h): every row of every chunk in exactly one maximal run, the first slot out
of range and the smallest slot a load writes twice found at the rows numpy order names."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu import _host
from lmcache_npu.ops.plan import RUN_DESC_DTYPE


@st.composite
def slot_matrices(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    chunks, rows = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    rows_per_block = draw(st.integers(1, 6))
    limit = draw(st.integers(1, 40))
    start = draw(st.integers(-1, limit - 1))
    matrix = np.empty((chunks, rows), dtype=np.int64)
    slot = start
    for c in range(chunks):  # mostly consecutive slots, with skips, jumps and repeats drawn in
        for r in range(rows):
            step = draw(st.sampled_from([1, 1, 1, 0, -1, 5, "skip"]))
            slot = -1 if step == "skip" else min(max(slot + step, 0), limit - 1)
            matrix[c, r] = slot
    if draw(st.booleans()):  # a slot outside [-1, limit) somewhere
        matrix[draw(st.integers(0, chunks - 1)), draw(st.integers(0, rows - 1))] = draw(
            st.sampled_from([-2, -7, limit, limit + 3]))
    return matrix, rows_per_block, limit


def _cut(matrix: np.ndarray, rows_per_block: int, limit: int, zero_runs: bool, unique: bool):
    runs, problem, at, again = _host.slot_runs(matrix, rows_per_block, limit, zero_runs, unique)
    return runs.view(RUN_DESC_DTYPE), problem, at, again


def _covers(runs: np.ndarray, matrix: np.ndarray, rows_per_block: int, zero_runs: bool) -> bool:
    """Every run is one chunk's consecutive slots inside one block (or skipped rows), runs are maximal, and every
    row the transfer moves is in exactly one run."""
    seen = np.zeros(matrix.shape, dtype=np.int64)
    previous = None
    for run in runs.tolist():
        first_slot, chunk, first_row, num_rows = run
        if num_rows < 1 or first_row + num_rows > matrix.shape[1]:
            return False
        slots = matrix[chunk, first_row: first_row + num_rows]
        if first_slot < 0:
            if not zero_runs or (slots >= 0).any():
                return False
        elif not ((slots == first_slot + np.arange(num_rows)).all() and
                  first_slot // rows_per_block == (first_slot + num_rows - 1) // rows_per_block):
            return False
        if previous is not None and previous[1] == chunk and previous[2] + previous[3] == first_row:
            end = previous[0] + previous[3]  # the next row continues the previous run: it should have been merged
            if (first_slot < 0 and previous[0] < 0) or (first_slot >= 0 and previous[0] >= 0 and first_slot == end
                                                         and end % rows_per_block != 0):
                return False
        seen[chunk, first_row: first_row + num_rows] += 1
        previous = run
    moved = np.ones(matrix.shape, dtype=bool) if zero_runs else matrix >= 0
    return bool((seen[moved] == 1).all() and (seen[~moved] == 0).all())


@settings(deadline=None, max_examples=300)
@given(case=slot_matrices(), zero_runs=st.booleans(), unique=st.booleans())
def test_runs_cover_every_row_once_and_problems_are_the_first_numpy_finds(case, zero_runs: bool,
                                                                          unique: bool) -> None:
    matrix, rows_per_block, limit = case
    runs, problem, at, again = _cut(matrix, rows_per_block, limit, zero_runs, unique)
    flat = matrix.reshape(-1)
    outside = np.flatnonzero((flat < -1) | (flat >= limit))
    live = np.flatnonzero(flat >= 0)
    values, counts = np.unique(flat[live], return_counts=True)
    twice = values[counts > 1]
    if outside.size:
        assert (problem, at) == (1, int(outside[0]))
    elif unique and twice.size:
        where = np.flatnonzero(flat == twice[0])
        assert (problem, at, again) == (2, int(where[0]), int(where[1]))
    else:
        assert problem == 0
        assert _covers(runs, matrix, rows_per_block, zero_runs)


@settings(deadline=None, max_examples=100)
@given(case=slot_matrices(), data=st.data())
def test_the_run_check_notices_a_lost_or_shifted_run(case, data: st.DataObject) -> None:
    matrix, rows_per_block, limit = case
    matrix = np.where((matrix < -1) | (matrix >= limit), -1, matrix)
    runs, problem, _, _ = _cut(matrix, rows_per_block, limit, True, False)
    assert problem == 0 and _covers(runs, matrix, rows_per_block, True)
    index = data.draw(st.integers(0, len(runs) - 1))
    if data.draw(st.booleans()):
        broken = runs[np.arange(len(runs)) != index]
    else:
        broken = runs.copy()
        broken[index]["first_slot"] = (broken[index]["first_slot"] + 1) if broken[index]["first_slot"] >= 0 else 0
    assert not _covers(broken, matrix, rows_per_block, True)


def test_an_empty_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="rows_per_block"):
        _host.slot_runs(np.zeros((1, 4), dtype=np.int64), 0, 8, False, True)
