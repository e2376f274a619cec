"""What a warm restart takes into the index (`index/adoption.py`): held slots are never handed out until settled, a
verified slot becomes a ready chunk exactly as a completed store makes one, a chunk stored again meanwhile keeps its
new slot (the held one is freed), freed slots may rest first, a chunk pinned for sealing is never evicted, and the
envelope's trailer names what a slot holds (`sealed_names`) while `unseal` voids it."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_npu.store.commands import Completion
from lmcache_npu.store.envelope import ENVELOPE_BYTES, Sealer, seal, sealed_names, unseal, verify
from lmcache_npu.store.index import slots as slots_module
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.index.contract import DiskState, SlotState

from .fakes import make_key


def stored(index: ChunkIndex, request: str, keys: list) -> list:
    stores = index.prepare_store(request, list(enumerate(keys)))
    index.take_commands()
    index.on_completions([Completion(command.cmd_id, 0, True) for command in stores])
    return stores


def test_held_slots_are_never_handed_out_and_an_adopted_one_is_a_ready_chunk():
    index = ChunkIndex(4)
    assert index.hold_slots([0, 1, 2]) == [0, 1, 2] and index.held_slots == 3
    (store,) = index.prepare_store("r", [(0, make_key(9))])
    assert store.slot == 3 and index.prepare_store("r", [(1, make_key(10))]) == []  # only held ones are left
    index.check_invariants()
    heard = []
    index.set_tier_listener(lambda key, tier, entered: heard.append((key, entered)))
    assert index.adopt_slot(0, make_key(1))
    assert index.location(make_key(1)) == (0, SlotState.READY, DiskState.NONE) and heard == [(make_key(1), True)]
    assert index.lookup("q", [make_key(1)]).ready_chunks == 1
    index.check_invariants()


def test_a_chunk_stored_again_meanwhile_keeps_its_slot_and_the_held_one_is_freed():
    index = ChunkIndex(3)
    index.hold_slots([0])
    (store,) = stored(index, "r", [make_key(1)])
    assert not index.adopt_slot(0, make_key(1))
    assert index.location(make_key(1))[0] == store.slot and index.free_slots == 2
    index.check_invariants()


def test_freed_held_slots_may_rest_first(monkeypatch):
    monkeypatch.setattr(slots_module, "QUARANTINE_S", 60.0)
    index = ChunkIndex(2)
    index.hold_slots([0, 1])
    index.free_held([0], rest=True)
    index.free_held([1])
    assert index.free_slots == 1 and index.held_slots == 0
    index.check_invariants()
    with pytest.raises(ValueError, match="not held"):
        index.free_held([1])


def test_a_chunk_pinned_for_sealing_is_never_evicted():
    index = ChunkIndex(1)
    (store,) = stored(index, "r", [make_key(1)])
    assert index.pin_for_sealing(make_key(1), store.slot)
    assert not index.pin_for_sealing(make_key(1), store.slot + 1)  # another slot: not that copy
    assert index.prepare_store("s", [(0, make_key(2))]) == []  # its only slot is pinned
    assert index.location(make_key(1))[1] is SlotState.READY  # not reported as read
    index.unpin_sealed(make_key(1))
    assert len(index.prepare_store("s", [(0, make_key(2))])) == 1  # evictable again
    index.check_invariants()


def test_the_pending_slots_and_the_high_water_mark_name_what_a_successor_must_avoid():
    index = ChunkIndex(4, first_cmd_id=100)
    stores = index.prepare_store("r", [(0, make_key(1)), (1, make_key(2))])
    assert index.pending_slots() == {command.slot for command in stores}
    assert index.next_command_id == 102 and all(command.cmd_id < 102 for command in stores)


def test_a_trailer_names_its_chunk_and_unseal_voids_it():
    key, sealer = make_key(3), Sealer()
    slots = np.zeros((3, 4096 + ENVELOPE_BYTES), np.uint8)
    slots[:, :4096] = 7
    seal(memoryview(slots[0]), key, 0, sealer)
    seal(memoryview(slots[1]), key, 1, sealer)
    names = sealed_names(slots[:, 4096:])
    assert names == [(key.namespace, key.chunk_hash, 0), (key.namespace, key.chunk_hash, 1), None]
    assert verify(memoryview(slots[0]), key, 0, sealer) is None
    unseal(memoryview(slots[0]))
    assert sealed_names(slots[:, 4096:])[0] is None and verify(memoryview(slots[0]), key, 0, sealer) == "magic"
    with pytest.raises(ValueError, match="uint8 array"):
        sealed_names(slots[:, 4096:].astype(np.int16))
