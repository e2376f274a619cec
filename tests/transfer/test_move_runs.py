"""A transfer's slots and checked runs from its moves and block windows in one native call (csrc/host/move_runs.h),
against the calls it replaces: block_slots per window and group, refused moves dropped, slot_runs per moved group."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu import _host


@st.composite
def groups(draw: st.DrawFn, tables: int):
    if draw(st.integers(0, 5)) == 0:
        return None  # a skipped group: no slots
    ratio = draw(st.sampled_from([1, 1, 2]))
    tokens_per_block = ratio * draw(st.integers(1, 4))
    chunk_tokens = tokens_per_block * draw(st.integers(1, 3))
    recurrent = draw(st.booleans())
    stored = tokens_per_block if recurrent else ratio * draw(st.integers(1, chunk_tokens // ratio))
    rows_per_block = tokens_per_block // ratio
    return SimpleNamespace(
        geometry=(chunk_tokens, stored, tokens_per_block, ratio, rows_per_block, 1 if recurrent else stored // ratio,
                  recurrent),
        table=draw(st.integers(0, tables - 1)), moved=draw(st.integers(0, 4)) > 0, rows_per_block=rows_per_block,
        limit=rows_per_block * draw(st.sampled_from([6, 10, 40])))


@st.composite
def cases(draw: st.DrawFn):
    tables = draw(st.integers(1, 2))
    group_list = draw(st.lists(groups(tables), min_size=1, max_size=3))
    count = draw(st.integers(1, 7))
    cuts = sorted(draw(st.lists(st.integers(1, count - 1), max_size=2, unique=True))) if count > 1 else []
    windows = []
    for end in [*cuts, count]:
        windows.append((end, draw(st.sampled_from([0, -1])),
                        [draw(st.lists(st.integers(0, 9), max_size=12)) for _ in range(tables)],
                        [draw(st.sampled_from([0, 1, 2])) for _ in range(tables)]))
    store = draw(st.booleans())
    index = draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))
    first = draw(st.lists(st.sampled_from([0, 0, 3, 9]), min_size=count, max_size=count))
    end = draw(st.lists(st.sampled_from([0, 12, 40, 200]), min_size=count, max_size=count))
    bare = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    return group_list, windows, index, first, end, [store] * count, bare, store


def _arguments(group_list):
    return [None if g is None else (*g.geometry, g.table, g.moved, g.rows_per_block if g.moved else 0,
                                    g.limit if g.moved else 0) for g in group_list]


def _one_call_at_a_time(group_list, windows, index, first, end, stores, bare, store):
    """What the mover and ChunkBatch.build did before: per window and group block_slots, then per group slot_runs."""
    count = len(index)
    refused = np.zeros(count, dtype=bool)
    slots = []
    for g in group_list:
        if g is None:
            slots.append(None)
            continue
        parts, begin = [], 0
        for window_end, null_block, tables, first_blocks in windows:
            part = slice(begin, window_end)
            matrix, refused_here = _host.block_slots(*g.geometry, tables[g.table], first_blocks[g.table], null_block,
                                                     index[part], first[part], end[part], stores[part], bare[part])
            parts.append(matrix)
            refused[part] |= refused_here
            begin = window_end
        slots.append(np.concatenate(parts))
    out = []
    for g, matrix in zip(group_list, slots):
        if g is None:
            out.append(None)
            continue
        kept = matrix[~refused]
        if g.moved and kept.shape[0]:
            runs, problem, at, again = _host.slot_runs(np.ascontiguousarray(kept), g.rows_per_block, g.limit, store,
                                                       not store)
        else:
            runs, problem, at, again = np.zeros(0, dtype=np.uint8), 0, 0, 0
        out.append((kept, runs, problem, at, again))
    return refused, out


def _differences(native, expected) -> list[str]:
    (refused, per_group), (want_refused, want_groups) = native, expected
    wrong = [] if np.array_equal(refused, want_refused) else ["refused"]
    for g, (got, want) in enumerate(zip(per_group, want_groups)):
        if (got is None) != (want is None):
            wrong.append(f"group {g}: presence")
        elif got is not None:
            slots, runs, problem, at, again = got
            if not np.array_equal(slots, want[0]):
                wrong.append(f"group {g}: slots")
            if (problem, at, again) != tuple(want[2:]):
                wrong.append(f"group {g}: problem")
            elif problem == 0 and bytes(runs) != bytes(want[1]):
                wrong.append(f"group {g}: runs")
    return wrong


@settings(deadline=None, max_examples=300)
@given(case=cases(), corrupt=st.booleans())
def test_one_call_cuts_what_the_calls_one_at_a_time_cut(case, corrupt: bool) -> None:
    group_list, windows, index, first, end, stores, bare, store = case
    native = _host.move_runs(_arguments(group_list), windows, index, first, end, stores, bare, store, not store)
    expected = _one_call_at_a_time(*case)
    if corrupt:  # negative control: one wrong slot (or, without any, one wrong refusal) is noticed
        refused, per_group = expected
        wrong_groups = list(per_group)
        live = [g for g, cut in enumerate(per_group) if cut is not None and cut[0].size]
        if live:
            g = live[0]
            slots = per_group[g][0].copy()
            slots.reshape(-1)[0] += 1
            wrong_groups[g] = (slots, *per_group[g][1:])
            assert _differences(native, (refused, wrong_groups)) == [f"group {g}: slots"]
        else:
            flipped = refused.copy()
            flipped[0] = not flipped[0]
            assert "refused" in _differences(native, (flipped, per_group))
    assert _differences(native, expected) == []


def test_windows_and_tables_that_do_not_fit_the_moves_are_refused_by_name() -> None:
    group = SimpleNamespace(geometry=(4, 4, 4, 1, 4, 4, False), table=1, moved=True, rows_per_block=4, limit=40)
    moves = ([0, 1], [0, 0], [8, 8], [False, False], [False, False], False, True)
    with pytest.raises(ValueError, match="cover 1 of 2 moves"):
        _host.move_runs(_arguments([group]), [(1, 0, [[1], [2]], [0, 0])], *moves)
    with pytest.raises(ValueError, match="reads block table 1, the window has 1"):
        _host.move_runs(_arguments([group]), [(2, 0, [[1, 2]], [0])], *moves)
    with pytest.raises(ValueError, match="one entry per move"):
        _host.move_runs(_arguments([group]), [(2, 0, [[1], [1, 2]], [0, 0])], [0], *moves[1:])
    refused, per_group = _host.move_runs(_arguments([group]), [(2, 0, [[9], [1, 2]], [0, 0])], *moves)
    assert not refused.any() and per_group[0][2] == 0 and per_group[0][0].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
