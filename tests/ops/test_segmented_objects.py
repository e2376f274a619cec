"""Transfers whose chunk objects sit in different arena segments: every backend addresses each object on its own,
so a plan's chunks may land in any segment. Bytes against the oracle, with a negative control."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import TransferBackend, get_backend
from lmcache_npu.store.arena import HostArena

from .oracle import oracle_load, oracle_store, payload_mask
from .strategies import Case, cases

SENTINEL = 0xA5

BACKENDS: dict[str, Callable[[int], TransferBackend]] = {
    "torch": lambda seed: get_backend("torch"),
    "host": lambda seed: get_backend("host", threads=1 + seed % 3),
    "emu-a2": lambda seed: get_backend("emu", soc="a2", cores=5, order="shuffled", seed=seed),
    "emu-310p": lambda seed: get_backend("emu", soc="310p", cores=3, order="shuffled", seed=seed),
}


def segmented_round_trip(backend: TransferBackend, case: Case, slots_per_segment: int, order: list[int]) -> None:
    """Stores the case's chunks into arena slots spread over segments (chunk i into slot order[i]), checks every
    object byte, loads them back into fresh pages, checks every page byte; then flips one payload byte in one slot
    and checks that the load notices."""
    geometry = case.geometry
    plan = geometry.plan()
    num_slots = len(order)
    arena = HostArena(num_slots, plan.object_bytes, pinned=False, hugepages="off",
                      segment_bytes=slots_per_segment * (plan.object_bytes + 256 + 4095) // 4096 * 4096)
    used = order[:case.num_chunks]
    segments = {arena.memory.segments[s // arena.memory.slots_per_segment].index for s in used}
    assume(len(segments) >= min(case.num_chunks, 2))  # the point: chunks of one transfer in different segments
    for slot in range(num_slots):
        arena.slot(slot).fill_(SENTINEL)
    objects = [arena.slot(s) for s in used]
    expected = oracle_store(geometry, case.slots, np.stack([o.numpy() for o in objects]))

    backend.store(plan, case.slots, objects)

    payload = payload_mask(geometry)
    for i, slot in enumerate(used):
        got = arena.slot(slot).numpy()
        assert np.array_equal(got[payload], expected[i][payload]), f"chunk {i} in slot {slot}: stored bytes differ"
    for slot in set(range(num_slots)) - set(used):
        assert (arena.slot(slot).numpy() == SENTINEL).all(), f"slot {slot} was written though no chunk went there"

    rng = np.random.default_rng(case.seed)
    for rp in geometry.raw_planes:
        rp.raw.copy_(rp.raw.new_tensor(rng.integers(0, 256, rp.raw.numel(), dtype=np.uint8)))
    fresh = [rp.raw.clone() for rp in geometry.raw_planes]
    stored = np.stack([arena.slot(s).numpy() for s in used])
    expected_pages = oracle_load(geometry, case.slots, stored)

    backend.load(plan, case.slots, objects)

    for i, (rp, want) in enumerate(zip(geometry.raw_planes, expected_pages)):
        assert np.array_equal(rp.raw.numpy(), want), f"plane {i}: loaded bytes differ from the oracle"

    # negative control: one wrong byte, in the last chunk's slot, of a row the load really moves, must be seen
    stored_bad = stored.copy()
    flip = None
    for position in np.flatnonzero(payload)[::-1][:256]:
        stored_bad[-1, position] ^= 0xFF
        bad_pages = oracle_load(geometry, case.slots, stored_bad)
        if any(not np.array_equal(a, b) for a, b in zip(bad_pages, expected_pages)):
            flip = int(position)
            break
        stored_bad[-1, position] ^= 0xFF
    assume(flip is not None)  # every row of that chunk is a hole: no byte of it is ever loaded
    arena.slot(used[-1]).numpy()[flip] ^= 0xFF
    for rp, page in zip(geometry.raw_planes, fresh):
        rp.raw.copy_(page)
    backend.load(plan, case.slots, objects)
    assert any(not np.array_equal(rp.raw.numpy(), want) for rp, want in zip(geometry.raw_planes, expected_pages)), \
        "a flipped byte in an arena slot went unnoticed"
    for i, (rp, want) in enumerate(zip(geometry.raw_planes, bad_pages)):
        assert np.array_equal(rp.raw.numpy(), want), f"plane {i}: the flipped byte landed in the wrong place"


@pytest.mark.parametrize("name", ["torch", "emu-a2", "host"])
@settings(max_examples=25, deadline=None)
@given(case=cases(soc="a2", max_chunks=6), slots_per_segment=st.integers(1, 2), data=st.data())
def test_chunks_in_different_segments_round_trip_exactly(name: str, case: Case, slots_per_segment: int,
                                                         data: st.DataObject) -> None:
    assume(case.geometry.plan().object_bytes > 0)
    order = data.draw(st.permutations(list(range(2 * case.num_chunks + 1))))
    segmented_round_trip(BACKENDS[name](case.seed), case, slots_per_segment, list(order))


@settings(max_examples=15, deadline=None)
@given(case=cases(soc="310p", max_chunks=6), data=st.data())
def test_chunks_in_different_segments_round_trip_exactly_on_310p_rules(case: Case, data: st.DataObject) -> None:
    assume(case.geometry.plan().object_bytes > 0)
    order = data.draw(st.permutations(list(range(2 * case.num_chunks + 1))))
    segmented_round_trip(BACKENDS["emu-310p"](case.seed), case, 1, list(order))
