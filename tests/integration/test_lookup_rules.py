"""lookup.py's rules on made-up tier answers: a hit passes through chunks held without end state but ends on a
complete one, and with an EAGLE-family drafter it claims every held chunk but the last."""

from __future__ import annotations

from lmcache_npu.integration.vllm import lookup
from lmcache_npu.store.commands import Tier
from lmcache_npu.store.index.contract import LookupResult
from lmcache_npu.store.keys import ChunkKey

KEYS = [ChunkKey("n" * 32, bytes([i])) for i in range(5)]
PARTIAL = [k.without_end_state() for k in KEYS]


def answers(held: str) -> list[bool]:
    """`presence` of `probes(KEYS, True)` for a pattern per chunk: C complete, P without end state, - neither."""
    return [h == "C" for h in held] + [h == "P" for h in held]


def test_probes_ask_for_the_copies_without_end_state_only_with_end_state_groups() -> None:
    assert lookup.probes(KEYS, False) == KEYS
    assert lookup.probes(KEYS, True) == KEYS + PARTIAL


def test_a_hit_passes_through_chunks_without_end_state_and_ends_on_a_complete_one() -> None:
    assert lookup.through_partial(KEYS, answers("CPCP-")) == [KEYS[0], PARTIAL[1], KEYS[2]]
    assert lookup.through_partial(KEYS, answers("PPPPP")) == []  # no complete chunk: no hit
    assert lookup.through_partial(KEYS, answers("C-CCC")) == [KEYS[0]]  # a gap ends the run


def test_the_indexs_hit_is_cut_back_to_its_last_complete_chunk() -> None:
    chosen = [KEYS[0], PARTIAL[1], KEYS[2]]
    arena = (Tier.ARENA,) * 3
    assert lookup.ending_complete(LookupResult(3, 3, arena), chosen, KEYS) == (LookupResult(3, 3, arena), chosen)
    # the index lost chunk 2 meanwhile: a hit ending on chunk 1 (without end state) claims chunk 0 only
    assert lookup.ending_complete(LookupResult(2, 1, arena[:2]), chosen, KEYS) == (
        LookupResult(1, 1, arena[:1]), [KEYS[0]])
    assert lookup.ending_complete(LookupResult(0, 0, ()), chosen, KEYS) == (LookupResult(0, 0, ()), [])


def test_eagle_claims_every_held_chunk_but_the_last() -> None:
    assert lookup.held_run(answers("CPC--"), 5, has_end_state=True) == 3
    assert lookup.held_run(answers("CPC--"), 5, has_end_state=False) == 1  # control: no end-state groups, no P
    assert [lookup.claimable_before_last_held(held, 5) for held in range(4)] == [0, 0, 1, 2]
    assert lookup.claimable_before_last_held(4, limit=2) == 2
