"""What the scheduler asks one step to move for one request: the chunks, the part of its block table they touch, and
which rows to leave alone. Plain picklable dataclasses; the connector's metadata carries them to every worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockWindow:
    """Part of one request's block table: per scheduler group, the ids of logical blocks starting at `first_block`
    (vLLM's null block 0 marks a block it freed or never allocated)."""

    first_block: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LoadPlan:
    """One request's loads of this step: chunks `[first_token // chunk, end_token // chunk)` into its pages."""

    request_id: str
    cmd_ids: tuple[int, ...]  # one Load per chunk, in chunk order
    window: BlockWindow
    first_token: int  # vLLM's own prefix cache computed the tokens before this one: their rows are left alone
    end_token: int  # the hit's end (rows from it on are left alone); only the chunk ending here loads end-state rows
    error_block_ids: tuple[int, ...] = ()  # what an invalid-block report names if the load fails
    refused: str = ""  # the index could not issue the loads (the reason): the worker reports a failed load


@dataclass(frozen=True)
class StorePlan:
    """One request's stores of this step, run after the forward that computed their last tokens."""

    request_id: str
    cmd_ids: tuple[int, ...]
    window: BlockWindow
    without_end_state: tuple[int, ...] = ()  # cmd ids stored with their end-state rows left out (zeros)
    tail_end: int = 0  # >0: a prompt's partial last chunk (a P/D hand-off), rows from this token on stored as zeros
