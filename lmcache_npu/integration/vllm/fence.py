"""The page fence's scheduler side: which stores still in flight read a block the step being built writes.

The scheduler half keeps a `PageFence`: per store command, the blocks its chunk reads (`StoreReads`, until every
rank completed the store). Each step it collects what the step writes (`StepWrites`); the store commands whose
blocks meet the writes go to the workers in the connector metadata, and only their batches hold the model's stream
(the safety argument: docs/architecture.md, "The worker's ordering arguments"). Comparison is by block id, one pool
for every KV-cache group.
One refinement keeps a long block (DeepSeek-V4's c128 block holds 16384 tokens) from fencing every step: a request
writing its own block from token t on touches only rows of tokens >= t, so its own stores of chunks ending at or
before t (their rows are of earlier tokens) are not disturbed, unless they read a recurrent state, which fills its
whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from ...layout.discovery import LayoutGroup
from ...transfer.plans import LoadPlan
from .adapter import ScheduledRequest


@dataclass(frozen=True)
class StoreRead:
    """What one store command reads: rows of tokens before `end_token` of `request_id`, in `blocks`."""

    request_id: str
    end_token: int
    blocks: tuple[int, ...]
    state_blocks: frozenset[int]  # blocks holding a recurrent state whole (any write to the block replaces it)


@dataclass(frozen=True)
class WriteGeometry:
    """Per scheduler group, tokens per logical block (the largest of its plan groups: the earliest block a write can
    reach; 0 where no plan group says, so its whole table counts as written), and the groups holding a recurrent
    state (a write replaces a whole block)."""

    block_tokens: tuple[int, ...]
    state_groups: frozenset[int]

    @classmethod
    def of(cls, groups: Sequence[LayoutGroup], num_scheduler_groups: int) -> "WriteGeometry":
        block_tokens = [0] * num_scheduler_groups
        for g in groups:
            if g.scheduler_group < len(block_tokens):
                block_tokens[g.scheduler_group] = max(block_tokens[g.scheduler_group], g.tokens_per_block)
        return cls(tuple(block_tokens), frozenset(g.scheduler_group for g in groups if g.recurrent))


class StepWrites:
    """The blocks one step writes: `anywhere` (new, zeroed, loaded, recurrent-state blocks: any row may change) and
    `from_token` (a request's own blocks, written from its first uncomputed token on)."""

    def __init__(self, geometry: WriteGeometry) -> None:
        self.geometry = geometry
        self.anywhere_blocks: set[int] = set()
        self.own: dict[int, tuple[str, int]] = {}
        self.unknown = False  # a write the mirror cannot place: the fence must cover every store

    def collect(self, scheduled: ScheduledRequest, tables: Sequence[Sequence[int]], had_table: bool) -> None:
        """A tracked request's writes this step; `tables` is its block-table mirror with this step's ids in,
        `had_table` whether the mirror held a table before them."""
        if scheduled.block_ids is not None and not scheduled.replace:
            if had_table:  # freshly handed blocks (maybe freed by another request): written or zeroed now
                self.anywhere(b for ids in scheduled.block_ids for b in ids)
            else:
                self.unknown = True  # appended ids, no table to place them in
        whole = scheduled.replace  # a new or resumed request's blocks past its hit are all fresh
        for sg, blocks in tail_blocks(tables, scheduled.num_computed_tokens, self.geometry.block_tokens):
            if whole or sg in self.geometry.state_groups:
                self.anywhere(blocks)
            else:
                self.from_token(scheduled.request_id, scheduled.num_computed_tokens, blocks)

    def collect_untracked(self, scheduled: ScheduledRequest) -> None:
        """A request scheduled before the connector saw it: nothing of it is mirrored."""
        if scheduled.replace and scheduled.block_ids is not None:
            for _, blocks in tail_blocks(scheduled.block_ids, scheduled.num_computed_tokens,
                                         self.geometry.block_tokens):
                self.anywhere(blocks)
        else:
            self.unknown = True  # its current block is in no output the scheduler kept

    def collect_outside_forward(self, loads: Iterable[LoadPlan], zeroed: Iterable[int]) -> None:
        """What vLLM and the workers write besides the forward: each load its window (blocks vLLM just handed to the
        loading request), and the new blocks vLLM zeroes first."""
        for plan in loads:
            self.anywhere(b for ids in plan.window.block_ids for b in ids)
        self.anywhere(zeroed)
        self.anywhere_blocks.discard(0)  # vLLM's null block holds nothing a store reads

    def anywhere(self, blocks: Iterable[int]) -> None:
        self.anywhere_blocks.update(blocks)

    def from_token(self, request_id: str, first_token: int, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self.own.setdefault(block, (request_id, first_token)) != (request_id, first_token):
                self.anywhere_blocks.add(block)  # two writers of one block: a stale mirror, count it whole

    def __contains__(self, block: int) -> bool:
        return block in self.anywhere_blocks or block in self.own


class StoreReads:
    """Blocks read by store commands some rank may still run, indexed by block."""

    def __init__(self) -> None:
        self._reads: dict[int, StoreRead] = {}
        self._readers: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def add(self, cmd_id: int, read: StoreRead) -> None:
        self._reads[cmd_id] = read
        for block in read.blocks:
            self._readers.setdefault(block, set()).add(cmd_id)

    def forget(self, cmd_id: int) -> None:
        """Every rank completed the store: its kernel is done with the pages everywhere."""
        read = self._reads.pop(cmd_id, None)
        for block in read.blocks if read is not None else ():
            readers = self._readers.get(block)
            if readers is not None:
                readers.discard(cmd_id)
                if not readers:
                    del self._readers[block]

    def conflicting(self, writes: StepWrites) -> list[int]:
        """Store commands reading a block the step writes (rows of theirs included), in id order."""
        out: set[int] = set()
        for block in writes.anywhere_blocks:
            out.update(self._readers.get(block, ()))
        for block, (request_id, first_token) in writes.own.items():
            if block in writes.anywhere_blocks:
                continue
            for cmd_id in self._readers.get(block, ()):
                read = self._reads[cmd_id]
                if read.request_id != request_id or read.end_token > first_token or block in read.state_blocks:
                    out.add(cmd_id)
        return sorted(out)


class PageFence:
    """The scheduler's fence state: the blocks of stores in flight, and this step's stores' reads, which join them
    once the step's fence is decided (this step's stores run behind its forward)."""

    def __init__(self, geometry: WriteGeometry) -> None:
        self.geometry = geometry
        self.reads = StoreReads()
        self.step_reads: list[tuple[int, StoreRead]] = []

    def step_writes(self) -> Optional[StepWrites]:
        """A collector for this step's writes; None with no store in flight, where no write needs a fence."""
        return StepWrites(self.geometry) if len(self.reads) > 0 else None

    def fenced(self, writes: StepWrites) -> Optional[list[int]]:
        """The in-flight stores that read a block the step writes; None when some write could not be placed."""
        return None if writes.unknown else self.reads.conflicting(writes)

    def end_step(self) -> None:
        for cmd_id, read in self.step_reads:
            self.reads.add(cmd_id, read)
        self.step_reads = []


def tail_blocks(tables: Iterable[Sequence[int]], num_computed_tokens: int,
                block_tokens: Sequence[int]) -> Iterator[tuple[int, Sequence[int]]]:
    """(scheduler group, blocks) a scheduled request may write: every block from the one holding its first uncomputed
    token to the table's end (new tokens, a recurrent state in the last token's block, speculative and lookahead
    blocks); the blocks before hold computed tokens, vLLM's own prefix hits among them, never rewritten. A group of
    unknown block length (0) counts whole."""
    for sg, table in enumerate(tables):
        tokens = block_tokens[sg] if sg < len(block_tokens) else 0
        yield sg, table[num_computed_tokens // tokens if tokens else 0:]
