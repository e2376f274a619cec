"""store/index/slots.py alone: the lowest free slot first, quarantine that outlasts a dead writer's late DMA, and the
usable set (`limit`) that withholds slots of segments not live on every rank."""

from __future__ import annotations

import pytest

from lmcache_npu.store.index import slots as slots_module
from lmcache_npu.store.index.slots import QUARANTINE_S, SlotTable
from lmcache_npu.store.policies import LruPolicy


class Clock:
    """Stands in for the `time` module slots.py reads: the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(slots_module, "time", fake)
    return fake


def table(num_slots: int = 4) -> SlotTable:
    return SlotTable(num_slots, LruPolicy(num_slots))


def test_free_slots_are_handed_out_lowest_first_until_none_is_left() -> None:
    slots = table(3)
    assert [slots.pop_free() for _ in range(4)] == [0, 1, 2, None]
    assert slots.free_count == 0 and slots.held == 3


def test_a_slot_given_back_is_free_again_and_comes_back_before_higher_ones() -> None:
    slots = table(3)
    first, second = slots.pop_free(), slots.pop_free()
    slots.occupy(first, "a")
    slots.vacate(first)
    slots.give_back(first)
    assert (first, second) == (0, 1) and slots.pop_free() == 0


def test_a_quarantined_slot_is_not_handed_out_before_its_time(clock: Clock) -> None:
    slots = table(1)
    slot = slots.pop_free()
    with slots.quarantining():
        slots.give_back(slot)
    assert slots.quarantined == 1 and slots.free_count == 0
    clock.now += QUARANTINE_S * 0.99
    assert slots.pop_free() is None  # a dead engine's late DMA may still land in it
    clock.now += QUARANTINE_S * 0.02
    assert slots.free_count == 1  # rested: it counts as free as soon as it may be handed out
    assert slots.pop_free() == slot and slots.quarantined == 0


def test_negative_control_a_slot_given_back_outside_quarantine_is_free_at_once(clock: Clock) -> None:
    slots = table(1)
    slot = slots.pop_free()
    slots.give_back(slot)
    assert slots.quarantined == 0 and slots.pop_free() == slot


def test_slots_outside_the_usable_set_are_withheld_and_come_back_when_it_grows() -> None:
    slots = table(4)
    slots.limit([(0, 1), (3, 4)])
    assert slots.usable_count == 2 and slots.free_count == 2
    assert [slots.pop_free(), slots.pop_free(), slots.pop_free()] == [0, 3, None]
    slots.limit(4)
    assert slots.free_count == 2 and slots.pop_free() == 1


def test_a_slot_given_back_into_an_unusable_segment_is_withheld() -> None:
    slots = table(2)
    slot = slots.pop_free()
    slots.limit([(1, 2)])
    slots.give_back(slot)
    assert slots.pop_free() == 1 and slots.pop_free() is None
    assert slots.held == 1  # slot 1; slot 0 is withheld, neither free nor held


def test_a_usable_range_outside_the_table_is_refused() -> None:
    with pytest.raises(ValueError, match=r"usable slot range \[2, 5\) is outside the index's 4 slots"):
        table(4).limit([(2, 5)])


def test_the_invariant_check_sees_a_slot_the_index_says_is_owned_by_another_key() -> None:
    slots = table(2)
    slot = slots.pop_free()
    slots.occupy(slot, "a")
    slots.check_invariants({slot: "a"})
    with pytest.raises(AssertionError, match="owned by 'a', the index says 'b'"):
        slots.check_invariants({slot: "b"})
