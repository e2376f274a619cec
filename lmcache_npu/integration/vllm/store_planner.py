"""Store planning: which of a request's chunks are safe to read now, and the part of its block table a step's loads
and stores touch.

A pure function of the plan groups (from the workers' handshake) and the request's block tables, one list of block
ids per scheduler group: it asks no index and reads no vLLM object, so the rules are tested on their own
(tests/integration/test_store_planner.py). The scheduler half asks the index which of the safe chunks to store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...layout.discovery import LayoutGroup
from ...layout.slots import chunk_slots, row_tokens, stored_block_span
from ...store.commands import BlockWindow, DeviceMove, Store
from ...store.keys import ChunkKey
from ...transfer.plans import StorePlan
from . import adapter
from .fence import StoreRead

BlockTables = Sequence[Sequence[int]]  # per scheduler group, a request's block ids


@dataclass(frozen=True)
class StorePlanner:
    """The plan groups an engine moves (skipped ones left out), its chunk size and its scheduler's groups."""

    moved: tuple[LayoutGroup, ...]
    chunk_tokens: int
    num_scheduler_groups: int
    scheduler_block_size: int

    @classmethod
    def of(cls, groups: Sequence[LayoutGroup], chunk_tokens: int, num_scheduler_groups: int,
           scheduler_block_size: int) -> "StorePlanner":
        return cls(tuple(g for g in groups if not g.skipped), chunk_tokens, num_scheduler_groups,
                   scheduler_block_size)

    def safe_chunks(self, tables: BlockTables, first_chunk: int, count: int,
                    computed_before: int) -> tuple[np.ndarray, np.ndarray]:
        """(storable, complete) of chunks [first_chunk, first_chunk + count) for a request that had computed
        `computed_before` tokens before this step: a chunk is storable when every row it stores sits in a block it
        still owns, and complete unless its end state (a recurrent group's) was already overwritten."""
        chunk = self.chunk_tokens
        chunks = np.arange(first_chunk, first_chunk + count)
        storable = np.ones(count, dtype=bool)
        complete = np.ones(count, dtype=bool)
        for g in self.moved:
            table = tables[g.scheduler_group] if g.scheduler_group < len(tables) else []
            rows_ok = (chunk_slots(g, chunk, table, chunks) >= 0).all(axis=1)
            if g.keeps_blocks:
                storable &= rows_ok
            elif g.windowed:  # rows already out of the window may sit in blocks vLLM freed and reused
                live = adapter.first_live_window_token(computed_before, g.sliding_window, g.tokens_per_block)
                storable &= rows_ok & (row_tokens(g, chunk, chunks)[:, 0] >= live)
            else:  # recurrent state and chunked-local blocks are rewritten by the next step
                this_step = (chunks + 1) * chunk > computed_before
                if g.recurrent:
                    complete &= rows_ok & this_step
                else:
                    storable &= rows_ok & this_step
        return storable, complete

    @staticmethod
    def pick(first_chunk: int, keys: Sequence[ChunkKey], storable: np.ndarray,
             complete: np.ndarray) -> tuple[list[tuple[int, ChunkKey]], set[ChunkKey]]:
        """The (chunk, key) pairs to store, an incomplete chunk under its key without end state, and those keys."""
        picked = [(first_chunk + i, key if whole else key.without_end_state())
                  for i, (key, ok, whole) in enumerate(zip(keys, storable, complete)) if ok]
        without_end_state = {key for (_, key), whole in zip(picked, complete[storable]) if not whole}
        return picked, without_end_state

    def plan(self, request_id: str, tables: BlockTables, commands: Sequence[Store],
             without_end_state: set[ChunkKey]) -> tuple[StorePlan, list[tuple[int, StoreRead]]]:
        """One request's store plan for the index's store commands, and what each command reads (the page fence's
        input)."""
        indices = [c.chunk_index for c in commands]
        window = self.window(tables, min(indices), max(indices) + 1)
        reads = [(c.cmd_id, self.read_of(request_id, window, c.chunk_index)) for c in commands]
        moves = tuple(DeviceMove(c, window, without_end_state=c.key in without_end_state) for c in commands)
        return StorePlan(request_id, moves, window), reads

    def window(self, tables: BlockTables, first_chunk: int, end_chunk: int) -> BlockWindow:
        """The part of the request's block table that chunks [first_chunk, end_chunk) touch, per scheduler group."""
        firsts, ids = [], []
        for sg in range(self.num_scheduler_groups):
            spans = [stored_block_span(g, self.chunk_tokens, first_chunk, end_chunk)
                     for g in self.moved if g.scheduler_group == sg]
            spans = [s for s in spans if s[1] > s[0]]
            if not spans:
                firsts.append(0)
                ids.append(())
                continue
            lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
            firsts.append(lo)
            ids.append(tuple(tables[sg][lo:hi]) if sg < len(tables) else ())
        return BlockWindow(tuple(firsts), tuple(ids))

    def read_of(self, request_id: str, window: BlockWindow, chunk_index: int) -> StoreRead:
        """The blocks one stored chunk reads, every plan group (the null block left out)."""
        blocks: set[int] = set()
        states: set[int] = set()
        for g in self.moved:
            lo, hi = stored_block_span(g, self.chunk_tokens, chunk_index, chunk_index + 1)
            first = window.first_block[g.scheduler_group]
            ids = window.block_ids[g.scheduler_group][max(lo - first, 0):max(hi - first, 0)]
            blocks.update(ids)
            if g.recurrent:
                states.update(ids)
        blocks.discard(0)
        return StoreRead(request_id, (chunk_index + 1) * self.chunk_tokens, tuple(sorted(blocks)),
                         frozenset(states - {0}))

    def error_blocks(self, tables: BlockTables, first_token: int, end_token: int) -> tuple[int, ...]:
        """The blocks of tokens [first_token, end_token) an invalid-block report names: the first scheduler group's
        (vLLM maps them through that table), the null block left out."""
        block = self.scheduler_block_size
        ids = tables[0][first_token // block:(end_token + block - 1) // block]
        return tuple(i for i in ids if i != 0)


def mirror_blocks(blocks: list[list[int]], scheduled: adapter.ScheduledRequest) -> list[list[int]]:
    """A request's block-table mirror after this step's ids: a whole table (new or resumed request, or a mirror that
    has none yet) or the newly allocated ones appended."""
    if scheduled.block_ids is None:
        return blocks
    if scheduled.replace or not blocks:
        return [list(ids) for ids in scheduled.block_ids]
    for table, new in zip(blocks, scheduled.block_ids):
        table.extend(new)
    return blocks
