"""The store planner on its own: block windows, the blocks a stored chunk reads and which chunks are safe to store,
for real plan groups (presets with full, sliding-window, compressed, boundary and recurrent groups) and drawn block
tables, checked against the layout's definition worked out row by row (slots.py's docstring: stored row r of chunk c
is token c * chunk + (chunk - stored_tokens) + r * compress_ratio, in logical block token // tokens_per_block)."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.integration.vllm import adapter
from lmcache_npu.integration.vllm.fence import StoreRead
from lmcache_npu.integration.vllm.store_planner import StorePlanner
from lmcache_npu.layout.discovery import LayoutGroup
from lmcache_npu.layout.slots import chunk_slots
from lmcache_npu.store.commands import Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.transfer import BlockWindow

PRESETS = ["llama3-8b", "gpt-oss-120b", "deepseek-v4-flash", "qwen3-next-80b"]
SCHEDULER_BLOCK = 16
MAX_CHUNK = 24  # chunks 0..23: several of deepseek-v4's 512- and 16384-token blocks, and sliding windows far behind


@functools.cache
def planner_of(preset: str) -> StorePlanner:
    from lmcache_npu.tools.presets import preset_layout

    layout, _ = preset_layout(preset, "ascend", num_blocks=4)
    num_scheduler_groups = 1 + max(g.scheduler_group for g in layout.groups)
    return StorePlanner.of(layout.groups, layout.plan.chunk_tokens, num_scheduler_groups, SCHEDULER_BLOCK)


def row_blocks(group: LayoutGroup, chunk_tokens: int, chunk: int) -> list[int]:
    """The logical blocks of a chunk's stored rows in one plan group, row by row."""
    first = chunk * chunk_tokens + chunk_tokens - group.stored_tokens
    return [(first + r * group.compress_ratio) // group.tokens_per_block for r in range(group.rows_per_chunk)]


def expected_window(planner: StorePlanner, tables: Sequence[Sequence[int]], first: int, end: int) -> BlockWindow:
    firsts, ids = [], []
    for sg in range(planner.num_scheduler_groups):
        blocks = {b for g in planner.moved if g.scheduler_group == sg
                  for c in range(first, end) for b in row_blocks(g, planner.chunk_tokens, c)}
        lo, hi = (min(blocks), max(blocks) + 1) if blocks else (0, 0)
        firsts.append(lo)
        ids.append(tuple(tables[sg][lo:hi]) if blocks else ())
    return BlockWindow(tuple(firsts), tuple(ids))


def expected_read(planner: StorePlanner, tables: Sequence[Sequence[int]], request_id: str, chunk: int) -> StoreRead:
    blocks: set[int] = set()
    states: set[int] = set()
    for g in planner.moved:
        table = tables[g.scheduler_group]
        ids = {table[b] for b in row_blocks(g, planner.chunk_tokens, chunk) if b < len(table)}
        blocks |= ids
        states |= ids if g.recurrent else set()
    return StoreRead(request_id, (chunk + 1) * planner.chunk_tokens, tuple(sorted(blocks - {0})),
                     frozenset(states - {0}))


def expected_safe(planner: StorePlanner, tables: Sequence[Sequence[int]], first: int, count: int,
                  computed_before: int) -> tuple[list[bool], list[bool]]:
    size = planner.chunk_tokens
    storable, complete = [True] * count, [True] * count
    for i, chunk in enumerate(range(first, first + count)):
        for g in planner.moved:
            table = tables[g.scheduler_group]
            rows_ok = all(b < len(table) and table[b] != 0 for b in row_blocks(g, size, chunk))
            if g.keeps_blocks:
                storable[i] &= rows_ok
            elif g.windowed:
                live = adapter.first_live_window_token(computed_before, g.sliding_window, g.tokens_per_block)
                storable[i] &= rows_ok and chunk * size + size - g.stored_tokens >= live
            elif g.recurrent:
                complete[i] &= rows_ok and (chunk + 1) * size > computed_before
            else:
                storable[i] &= rows_ok and (chunk + 1) * size > computed_before
    return storable, complete


def window_problems(planner: StorePlanner, tables: Sequence[Sequence[int]], first: int, end: int,
                    window: BlockWindow) -> list[str]:
    """How `window` differs from the window of chunks [first, end), and rows it cannot place that the table can."""
    problems = []
    if window != expected_window(planner, tables, first, end):
        problems.append(f"window {window} is not {expected_window(planner, tables, first, end)}")
    chunks = np.arange(first, end)
    for g in planner.moved:
        sg = g.scheduler_group
        whole = chunk_slots(g, planner.chunk_tokens, tables[sg], chunks)
        part = chunk_slots(g, planner.chunk_tokens, window.block_ids[sg], chunks, first_block=window.first_block[sg])
        if not np.array_equal(whole, part):
            problems.append(f"group {g.index}: the window places other slots than the whole table")
    return problems


@st.composite
def requests(draw: st.DrawFn) -> tuple[StorePlanner, list[list[int]], int, int]:
    """A preset's planner, block tables (0: vLLM's null block, a freed or never allocated one) and a chunk range."""
    planner = planner_of(draw(st.sampled_from(PRESETS)))
    first = draw(st.integers(0, MAX_CHUNK - 1))
    end = draw(st.integers(first + 1, min(first + 8, MAX_CHUNK)))
    tables = []
    for sg in range(planner.num_scheduler_groups):
        needed = max([1 + b for g in planner.moved if g.scheduler_group == sg
                      for b in row_blocks(g, planner.chunk_tokens, end - 1)], default=1)
        length = draw(st.integers(0, needed + 2))
        tables.append(draw(st.lists(st.integers(0, 4 * MAX_CHUNK).map(lambda b: b if b % 7 else 0),
                                    min_size=length, max_size=length)))
    return planner, tables, first, end


@settings(max_examples=300, deadline=None)
@given(case=requests())
def test_the_window_holds_exactly_the_blocks_of_the_chunks_rows(case) -> None:
    planner, tables, first, end = case
    assert window_problems(planner, tables, first, end, planner.window(tables, first, end)) == []


def test_negative_control_a_window_one_chunk_short_is_noticed() -> None:
    planner = planner_of("gpt-oss-120b")
    tables = [list(range(1, 12)), list(range(20, 31))]
    short = planner.window(tables, 2, 4)
    assert window_problems(planner, tables, 2, 5, short) != []
    moved = BlockWindow(short.first_block, (short.block_ids[0], (99,) + short.block_ids[1][1:]))
    assert len(window_problems(planner, tables, 2, 4, moved)) == 2  # one wrong block id: both checks see it
    assert window_problems(planner, tables, 2, 4, short) == []  # control: the right window passes


@settings(max_examples=300, deadline=None)
@given(case=requests())
def test_a_stored_chunk_reads_the_blocks_of_its_rows(case) -> None:
    planner, tables, first, end = case
    window = planner.window(tables, first, end)
    for chunk in range(first, end):
        assert planner.read_of("r", window, chunk) == expected_read(planner, tables, "r", chunk)


@settings(max_examples=300, deadline=None)
@given(case=requests(), chunks_before=st.integers(0, MAX_CHUNK + 1), offset=st.integers(0, 1023))
def test_safe_chunks_follow_each_groups_rule(case, chunks_before: int, offset: int) -> None:
    planner, tables, first, end = case
    computed = chunks_before * planner.chunk_tokens + offset % planner.chunk_tokens  # tokens computed before the step
    storable, complete = planner.safe_chunks(tables, first, end - first, computed)
    assert (storable.tolist(), complete.tolist()) == expected_safe(planner, tables, first, end - first, computed)


def test_negative_control_a_row_in_the_null_block_or_out_of_the_window_is_unsafe() -> None:
    planner = planner_of("gpt-oss-120b")  # 128-token chunks and blocks, group 0 a 128-token sliding window
    tables = [list(range(1, 12)), list(range(20, 31))]
    storable, complete = planner.safe_chunks(tables, 0, 4, computed_before=512)
    assert storable.tolist() == [False, False, False, True] and complete.all()  # chunks 0-2 left the window
    holed = [tables[0], tables[1][:2] + [0] + tables[1][3:]]
    assert planner.safe_chunks(holed, 3, 1, computed_before=0)[0].tolist() == [True]  # control: block 2 not read
    assert planner.safe_chunks(holed, 2, 1, computed_before=0)[0].tolist() == [False]  # it reads the null block


def test_a_recurrent_chunk_overwritten_before_this_step_is_incomplete_not_unsafe() -> None:
    planner = planner_of("qwen3-next-80b")  # 1024-token chunks, three mamba groups and one full-attention group
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    storable, complete = planner.safe_chunks(tables, 0, 3, computed_before=2048)
    assert storable.tolist() == [True, True, True] and complete.tolist() == [False, False, True]


def test_pick_and_plan_name_the_chunks_their_windows_and_the_copies_without_end_state() -> None:
    planner = planner_of("qwen3-next-80b")
    keys = [ChunkKey("n" * 32, bytes([i])) for i in range(4)]
    picked, partial_keys = planner.pick(5, keys, np.array([True, False, True, True]),
                                        np.array([True, True, False, True]))
    assert picked == [(5, keys[0]), (7, keys[2].without_end_state()), (8, keys[3])]
    assert partial_keys == {keys[2].without_end_state()}
    tables = [list(range(100 + 10 * sg, 110 + 10 * sg)) for sg in range(4)]
    commands = [Store(40 + i, key, i, "r", chunk) for i, (chunk, key) in enumerate(picked)]
    plan, reads = planner.plan("r", tables, commands, partial_keys)
    assert plan.request_id == "r" and plan.cmd_ids == (40, 41, 42) and plan.without_end_state == (41,)
    assert plan.window == expected_window(planner, tables, 5, 9)
    assert plan.window.first_block == (5, 5, 5, 5) and plan.window.block_ids[3] == (135, 136, 137, 138)
    assert reads == [(40 + i, expected_read(planner, tables, "r", c)) for i, (c, _) in enumerate(picked)]


@pytest.mark.parametrize("first_token, end_token, expected", [(0, 16, (5,)), (2, 50, (5, 7, 8)), (16, 17, ()),
                                                               (48, 64, (8,))])
def test_error_blocks_are_the_first_groups_blocks_of_the_loaded_tokens(first_token: int, end_token: int,
                                                                      expected: tuple[int, ...]) -> None:
    planner = planner_of("llama3-8b")
    assert planner.error_blocks([[5, 0, 7, 8, 9]], first_token, end_token) == expected
