"""Chunk rows to page slots (csrc/host/block_slots.h) against a numpy statement of layout/slots.py's formula and of
the masks KVMover applies per move: every slot, every refusal."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu import _host

SKIP = -1


def oracle(g: SimpleNamespace, table: list[int], first_block: int, null_block: int, index: np.ndarray,
           first: np.ndarray, end: np.ndarray, store: np.ndarray, bare: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The formula and the masks in numpy, row by row of the docs (layout/slots.py, DeviceMove)."""
    ids = np.asarray(table, dtype=np.int64)
    tokens = (index[:, None] * g.chunk_tokens + (g.chunk_tokens - g.stored_tokens)
              + np.arange(g.rows_per_chunk)[None, :] * g.compress_ratio)
    logical = tokens // g.tokens_per_block - first_block
    present = (logical >= 0) & (logical < ids.size)
    physical = np.where(present, ids[np.clip(logical, 0, max(ids.size - 1, 0))] if ids.size else -1, -1)
    if null_block >= 0:
        present &= physical != null_block
    slots = np.where(present & (physical >= 0),
                     physical * g.rows_per_block + (tokens % g.tokens_per_block) // g.compress_ratio, SKIP)
    loads = ~store[:, None]
    slots[loads & (tokens < first[:, None])] = SKIP
    if g.recurrent:
        last = ((index + 1) * g.chunk_tokens == end)[:, None]
        slots[np.broadcast_to((loads & ~last) | (~loads & bare[:, None]), slots.shape)] = SKIP
    else:
        slots[loads & (tokens >= end[:, None])] = SKIP
    written = ~loads & ~(bare[:, None] if g.recurrent else np.zeros_like(bare[:, None]))
    past = written & (end[:, None] > 0) & (tokens >= end[:, None])
    refused = (written & ~past & (slots < 0)).any(axis=1)
    slots[past] = SKIP
    return slots, refused


@st.composite
def cases(draw: st.DrawFn):
    ratio = draw(st.sampled_from([1, 1, 2, 4]))
    tokens_per_block = ratio * draw(st.integers(1, 4))
    chunk_tokens = tokens_per_block * draw(st.integers(1, 3))
    recurrent = draw(st.booleans())
    stored = tokens_per_block if recurrent else ratio * draw(st.integers(1, chunk_tokens // ratio))
    g = SimpleNamespace(chunk_tokens=chunk_tokens, stored_tokens=stored, tokens_per_block=tokens_per_block,
                        compress_ratio=ratio, rows_per_block=tokens_per_block // ratio,
                        rows_per_chunk=1 if recurrent else stored // ratio, recurrent=recurrent)
    count = draw(st.integers(1, 5))
    index = np.array(draw(st.lists(st.integers(0, 4), min_size=count, max_size=count)), dtype=np.int64)
    table = draw(st.lists(st.integers(0, 9), min_size=0, max_size=24))
    first_block = draw(st.sampled_from([0, 0, 1, 3]))
    null_block = draw(st.sampled_from([-1, 0]))
    span = 8 * chunk_tokens
    first = np.array(draw(st.lists(st.one_of(st.just(0), st.integers(0, span)), min_size=count, max_size=count)),
                     dtype=np.int64)
    end = np.array(draw(st.lists(st.sampled_from([0, span, span, *range(0, span, max(1, chunk_tokens // 2))]),
                                 min_size=count, max_size=count)), dtype=np.int64)
    store = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    bare = np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    return g, table, first_block, null_block, index, first, end, store, bare


def _native(g, table, first_block, null_block, index, first, end, store, bare):
    return _host.block_slots(g.chunk_tokens, g.stored_tokens, g.tokens_per_block, g.compress_ratio, g.rows_per_block,
                             g.rows_per_chunk, g.recurrent, table, first_block, null_block, index.tolist(),
                             first.tolist(), end.tolist(), store.tolist(), bare.tolist())


@settings(deadline=None, max_examples=400)
@given(case=cases(), corrupt=st.booleans())
def test_native_slots_and_refusals_match_the_formula(case, corrupt: bool) -> None:
    slots, refused = _native(*case)
    expected_slots, expected_refused = oracle(*case)
    if corrupt:  # negative control: one wrong slot is noticed
        slots = slots.copy()
        slots.reshape(-1)[0] += 1
        assert not np.array_equal(slots, expected_slots)
        return
    assert np.array_equal(slots, expected_slots)
    assert np.array_equal(refused, expected_refused)


@settings(deadline=None, max_examples=100)
@given(case=cases())
def test_without_moves_only_the_formula_applies(case) -> None:
    g, table, first_block, null_block, index, *_ = case
    slots, _ = _host.block_slots(g.chunk_tokens, g.stored_tokens, g.tokens_per_block, g.compress_ratio,
                                 g.rows_per_block, g.rows_per_chunk, g.recurrent, table, first_block, null_block,
                                 index.tolist())
    count = len(index)
    loads = (np.zeros(count, dtype=np.int64), np.full(count, 1 << 40), np.zeros(count, dtype=bool),
             np.zeros(count, dtype=bool))
    expected, _ = oracle(SimpleNamespace(**{**vars(g), "recurrent": False}), table, first_block, null_block, index,
                         *loads)
    assert np.array_equal(slots, expected)


def test_a_group_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens_per_block"):
        _host.block_slots(16, 16, 0, 1, 16, 16, False, [1], 0, 0, [0])
