"""The lookup rules: which held chunks a hit may claim, given what the tiers answer about the request's keys.

End state. A chunk whose recurrent (end-state) rows vLLM did not keep is stored under a second key
(`ChunkKey.without_end_state`); a hit may pass through such chunks but must end on a complete one, since the
request resumes from the last chunk's end state.

Speculative decoding. Draft and MTP layers' KV is stored and loaded with the rest: vLLM (and vllm-ascend) put those
layers in KV-cache groups like any other (DeepSeek MTP layers in the target's MLA group, DeepSeek-V4's in a
sliding-window group flagged `is_eagle_group`), and a chunk holds every group. With an EAGLE-family drafter (EAGLE,
EAGLE-3, MTP, DFlash: `adapter.eagle_block_drop`), the drafter's row at position p is computed from the target's
hidden state at p and the token at p + 1, so the last row of a chunk depends on a token the chunk's key does not
name. vLLM's rule for its own prefix cache is to match one block more than it uses and drop it
(`drop_eagle_block`); it does not trim a connector's external tokens. The rule here is the same at chunk
granularity: a hit claims only chunks followed by one more chunk some tier holds (complete, or without its end
state), and the extra chunk is neither reserved, promoted nor loaded; the hit thus ends one chunk earlier than
without a drafter, as vLLM's own hits end one block earlier. Stores are unchanged: with any speculative config vLLM
calls `wait_for_save` after drafting (`finalize_kv_connector`), so a step's stores are queued behind the draft
model's writes too (worker.py). ngram and draft-model drafting keep no row tied to the next token: no chunk is
dropped.

The scheduler half asks the index (`presence`, `lookup`); these functions only read its answers.
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
