"""The scheduler half's state of one request (scheduler.py runs the steps over it): its block-table mirror, the
chunks it stores and loads, the hit last answered for it, and its part in a P/D hand-off (handoff.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...store.commands import Tier
from ...store.keys import ChunkKey
from .handoff import Receiving


@dataclass
class AnsweredLookup:
    """The last hit answered for a request, kept until `update_state_after_alloc` turns it into loads."""

    first_chunk: int
    keys: list[ChunkKey]  # the chosen key of each hit chunk (complete or without end state)
    num_computed_tokens: int
    through: bool = False  # the hit may end inside its last chunk (a P/D hand-off's prompt, plain groups only)
    sliced: bool = False  # it loads into this step's forward (load_mode.py), not before the request is scheduled


@dataclass
class RequestState:
    """What the scheduler half keeps of one request, from its first lookup until its last command settled."""

    request: Any  # vLLM's Request: block hashes, token counts, status
    blocks: list[list[int]] = field(default_factory=list)  # mirror of the block table, per scheduler group
    next_chunk: int = 0  # chunks before it are stored, held, or passed over
    stores: set[int] = field(default_factory=set)  # store cmd ids not yet completed by every rank
    loads: set[int] = field(default_factory=set)
    lookup: Optional[AnsweredLookup] = None
    found_in: dict[int, Tier] = field(default_factory=dict)  # chunk -> the tier its first lookup found it in
    keys: list[ChunkKey] = field(default_factory=list)  # of chunks 0.. whose hashes exist
    asked: Optional[int] = None  # tokens vLLM had computed when it last asked for a hit (counted at allocation)
    claimed_to: int = 0  # tokens its admission's claim reaches: not computed, whatever vLLM counts while it loads
    finished: bool = False
    no_hits: bool = False  # a load of this request failed: it recomputes, and never loads again
    adapter_digest: Optional[bytes] = None  # the content of the request's LoRA adapter: re-keys its chunks
    bypass: bool = False  # a LoRA adapter nothing may name (lora_identity.py): no loads or stores, vLLM computes
    handoff_ask: bool = False  # a prefill engine's request for a P/D hand-off (handoff.py): its tail stored too
    tail_planned: bool = False
    tail_key: Optional[ChunkKey] = None  # that tail, stored (or already held)
    receiving: Optional[Receiving] = None  # a decode engine's request: the hand-off of its prefill engine
