"""Chunk rows to page slots: where each stored row of a chunk lives, given a request's block table.

For chunk c of a plan group, stored row r is the token `t = c * chunk_tokens + (chunk_tokens - stored_tokens)
+ r * compress_ratio` (the tail of the chunk), found in logical block `t // tokens_per_block` at row
`(t % tokens_per_block) // compress_ratio`. A recurrent group stores one row, the state after the chunk's
last token, which this formula lands on because its stored tail is one whole block.

A block table may be a window of the request's table: `first_block` names the logical block of its first id, so
a transfer needs only the ids its chunks touch (`stored_block_span`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from .. import _host
from .discovery import KVLayout, LayoutGroup

BlockIds = Union[Sequence[int], np.ndarray]


def row_tokens(group: LayoutGroup, chunk_tokens: int, chunks: BlockIds) -> np.ndarray:
    """(len(chunks), rows_per_chunk): the first token each stored row covers."""
    index = np.asarray(chunks, dtype=np.int64).reshape(-1, 1)
    rows = np.arange(group.rows_per_chunk, dtype=np.int64).reshape(1, -1)
    return index * chunk_tokens + (chunk_tokens - group.stored_tokens) + rows * group.compress_ratio


def stored_block_span(group: LayoutGroup, chunk_tokens: int, first_chunk: int, end_chunk: int) -> tuple[int, int]:
    """(first, end) logical blocks that hold the stored rows of chunks [first_chunk, end_chunk) (end exclusive)."""
    if group.skipped or end_chunk <= first_chunk:
        return 0, 0
    first_token = first_chunk * chunk_tokens + (chunk_tokens - group.stored_tokens)
    last_token = end_chunk * chunk_tokens - group.compress_ratio  # first token of the last stored row
    return first_token // group.tokens_per_block, last_token // group.tokens_per_block + 1


def chunk_slots(group: LayoutGroup, chunk_tokens: int, block_ids: BlockIds, chunks: BlockIds,
                null_block: Optional[int] = 0, first_block: int = 0) -> np.ndarray:
    """(len(chunks), rows_per_chunk) slots of `chunks` (chunk indices in the request) for one plan group.

    `block_ids` is the scheduler group's block table for the request, or a window of it starting at logical block
    `first_block`; a row in a block outside it or in the null block (vLLM frees sliding-window blocks to block 0)
    gets -1, which a store writes as zeros and a load leaves alone. Computed natively (csrc/host/block_slots.h).
    """
    slots, _ = _host.block_slots(*slot_geometry(group, chunk_tokens), _ids(block_ids), first_block,
                                 -1 if null_block is None else null_block, _ids(chunks))
    return slots


def slot_geometry(group: LayoutGroup, chunk_tokens: int) -> tuple[int, int, int, int, int, int, bool]:
    """The group's numbers `_host.block_slots` takes first (csrc/host/block_slots.h, SlotGroup)."""
    return (chunk_tokens, group.stored_tokens, group.tokens_per_block, group.compress_ratio, group.rows_per_block,
            group.rows_per_chunk, group.recurrent)


def _ids(values: BlockIds) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def layout_slots(layout: KVLayout, block_tables: Sequence[BlockIds], chunks: BlockIds,
                 null_block: Optional[int] = 0) -> list[Optional[np.ndarray]]:
    """Slots of every plan group (None for skipped groups) from one block table per scheduler group."""
    out: list[Optional[np.ndarray]] = []
    for g in layout.groups:
        if g.skipped:
            out.append(None)
        else:
            out.append(chunk_slots(g, layout.plan.chunk_tokens, block_tables[g.scheduler_group], chunks, null_block))
    return out
