"""The lookup rules: which held chunks a hit may claim, given what the tiers answer about the request's keys.

A hit may pass through chunks stored without their end state but ends on a complete one; with an EAGLE-family
drafter it claims only chunks followed by one more held chunk (vLLM's `drop_eagle_block`, per chunk). Why:
docs/architecture.md §4, "What a step stores" and "Speculative decoding". The scheduler half asks the index
(`presence`, `lookup`); these functions only read its answers.
"""

from __future__ import annotations

from typing import Sequence

from ...store.index.contract import LookupResult
from ...store.keys import ChunkKey


def probes(keys: Sequence[ChunkKey], has_end_state: bool) -> list[ChunkKey]:
    """The keys to ask the tiers about: every chunk's, then (with end-state groups) every chunk's without end
    state."""
    return list(keys) + [k.without_end_state() for k in keys] if has_end_state else list(keys)


def held_run(present: Sequence[bool], count: int, has_end_state: bool) -> int:
    """How many of `count` chunks from the first some tier holds, complete or without end state (`present` answers
    `probes`)."""
    held = 0
    while held < count and (present[held] or (has_end_state and present[count + held])):
        held += 1
    return held


def claimable_before_last_held(held: int, limit: int) -> int:
    """EAGLE/MTP: the chunks a hit may claim of a run of `held`, at most `limit`: all but the last, which only proves
    that the token after the claimed chunks' last row matches."""
    return min(limit, max(held - 1, 0))


def claimable_keys(keys: Sequence[ChunkKey], present: Sequence[bool], has_end_state: bool,
                   limit: int) -> tuple[list[ChunkKey], int]:
    """EAGLE/MTP: of `keys` (`present` answers their `probes`), the at most `limit` a hit may claim, and how many held
    chunks within the limit the one-chunk drop gives up."""
    held = held_run(present, len(keys), has_end_state)
    claimable = claimable_before_last_held(held, limit)
    return list(keys[:claimable]), min(limit, held) - claimable


def through_partial(keys: Sequence[ChunkKey], present: Sequence[bool]) -> list[ChunkKey]:
    """The key to claim per chunk of the longest held run (`present` answers `probes` with end state): the complete
    one where held, else the one without end state; cut after the last complete chunk."""
    chosen: list[ChunkKey] = []
    complete_end = 0
    for c, key in enumerate(keys):
        if present[c]:
            chosen.append(key)
            complete_end = c + 1
        elif present[len(keys) + c]:
            chosen.append(key.without_end_state())
        else:
            break
    return chosen[:complete_end]


def ending_complete(result: LookupResult, chosen: Sequence[ChunkKey],
                    keys: Sequence[ChunkKey]) -> tuple[LookupResult, list[ChunkKey]]:
    """The index's hit over `chosen`, cut back to its last complete chunk, and the keys it claims."""
    end = max((c + 1 for c in range(result.hit_chunks) if chosen[c] == keys[c]), default=0)
    return LookupResult(end, min(result.ready_chunks, end), result.sources[:end]), list(chosen[:end])
