"""The page fence's scheduler side: which stores still in flight read a block the step being built writes.

The scheduler half keeps, per store command, the blocks its chunk reads (`StoreReads`, until every rank completed
the store) and collects what a step writes (`StepWrites`); the store commands whose blocks meet the writes go to the
workers in the connector metadata, and only their batches hold the model's stream (the safety argument is in
`worker.py`'s docstring). Comparison is by block id, one pool for every KV-cache group. One refinement keeps a long
block (DeepSeek-V4's c128 block holds 16384 tokens) from fencing every step: a request writing its own block from
token t on touches only rows of tokens >= t, so its own stores of chunks ending at or before t (their rows are of
earlier tokens) are not disturbed, unless they read a recurrent state, which fills its whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence


@dataclass(frozen=True)
class StoreRead:
    """What one store command reads: rows of tokens before `end_token` of `request_id`, in `blocks`."""

    request_id: str
    end_token: int
    blocks: tuple[int, ...]
    state_blocks: frozenset[int]  # blocks holding a recurrent state whole (any write to the block replaces it)


class StepWrites:
    """The blocks one step writes: `anywhere` (new, zeroed, loaded, recurrent-state blocks: any row may change) and
    `from_token` (a request's own blocks, written from its first uncomputed token on)."""

    def __init__(self) -> None:
        self.anywhere_blocks: set[int] = set()
        self.own: dict[int, tuple[str, int]] = {}

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


def tail_blocks(tables: Iterable[Sequence[int]], num_computed_tokens: int,
                block_tokens: Sequence[int]) -> Iterator[tuple[int, Sequence[int]]]:
    """(scheduler group, blocks) a scheduled request may write: every block from the one holding its first uncomputed
    token to the table's end (new tokens, a recurrent state in the last token's block, speculative and lookahead
    blocks); the blocks before hold computed tokens, vLLM's own prefix hits among them, never rewritten. A group of
    unknown block length (0) counts whole."""
    for sg, table in enumerate(tables):
        tokens = block_tokens[sg] if sg < len(block_tokens) else 0
        yield sg, table[num_computed_tokens // tokens if tokens else 0:]
