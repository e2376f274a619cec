"""The host-memory registration chain on the fake device: each failure moves to the next path, the facts leave out
what a host cannot do, a host where nothing works fails at start with every reason, and every path's slots feed
the transfer kernel asynchronously."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_npu.platform.ascend_host import AscendHostFacts
from lmcache_npu.platform.ascend_memory import npu_segment_pinning
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.envelope import ENVELOPE_BYTES

from ..ops.oracle import oracle_store, payload_mask, small_geometry
from .fake_npu import FakeNpu
from .test_npu_backend_fake import SLOTS, backend_for, on_device

A2_DRIVER_25 = AscendHostFacts(soc="Ascend910B1", driver_version=(25, 0), driver_version_text="25.0.rc1",
                               kernel_release="5.15.0-91-generic", memlock_bytes=None)
OBJECT = 8192 - ENVELOPE_BYTES  # one object and its trailer fill an 8 KiB slot
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000


def arena_on(fake: FakeNpu, facts: AscendHostFacts = A2_DRIVER_25, requested: str = "auto", slots: int = 6,
             object_bytes: int = OBJECT) -> HostArena:
    pinning = npu_segment_pinning(fake.runtime(), requested, facts)
    return HostArena(slots, object_bytes, segment_bytes=2 * 8192, pinning=pinning, hugepages="off")


def assert_slots_hold_their_own_bytes(arena: HostArena) -> None:
    rng = np.random.default_rng(arena.num_slots)
    expected = [rng.integers(0, 256, arena.sealed_bytes, dtype=np.uint8) for _ in range(arena.num_slots)]
    for slot, data in enumerate(expected):
        arena.sealed_array(slot)[:] = data
    for slot, data in enumerate(expected):
        assert np.array_equal(arena.sealed_array(slot), data), f"slot {slot} lost its bytes"
        assert arena.slot(slot).data_ptr() == arena.slot_address(slot)
    arena.slot_array(0)[0] ^= 0xFF  # negative control: the comparison sees one wrong byte
    assert not np.array_equal(arena.sealed_array(0), expected[0])


def test_a_host_that_registers_keeps_one_contiguous_registered_arena(fake_npu: FakeNpu) -> None:
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30)
    assert arena.contiguous and {s.pinned_by for s in arena.memory.segments} == {"aclrtHostRegister"}
    assert fake_npu.counter("registered") == 3 and fake_npu.counter("malloc_host_allocations") == 0
    assert arena.registration_ranges() == [(arena.base_address, arena.total_bytes)]
    assert_slots_hold_their_own_bytes(arena)
    arena.close()
    assert fake_npu.counter("registered") == 0, "close() left segments registered"


def test_a_refused_registration_moves_to_acl_allocated_segments(fake_npu: FakeNpu) -> None:
    fake_npu.set_errors(host_register=ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30)
    segments = arena.memory.segments
    assert {s.pinned_by for s in segments} == {"aclrtMallocHost"} and all(s.allocated for s in segments)
    assert fake_npu.counter("malloc_host_allocations") == 3 and fake_npu.counter("registered") == 0
    assert not arena.contiguous
    assert sorted(arena.registration_ranges()) == sorted((s.address, s.used_bytes) for s in segments)
    assert "aclrtHostRegister failed" in arena.memory.pinning.describe()  # type: ignore[union-attr]
    assert_slots_hold_their_own_bytes(arena)


def test_with_neither_acl_path_the_driver_registers_mlocked_segments(fake_npu: FakeNpu) -> None:
    fake_npu.set_errors(host_register=ACL_ERROR_RT_FEATURE_NOT_SUPPORT, malloc_host=207001)
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30)
    assert {s.pinned_by for s in arena.memory.segments} == {"halHostRegister"} and arena.contiguous
    assert int(fake_npu.hal.lmcache_fake_hal_count()) == 3
    assert_slots_hold_their_own_bytes(arena)
    arena.close()
    assert int(fake_npu.hal.lmcache_fake_hal_count()) == 0


def test_a_host_where_nothing_works_fails_at_start_naming_every_path(fake_npu: FakeNpu) -> None:
    fake_npu.set_errors(host_register=ACL_ERROR_RT_FEATURE_NOT_SUPPORT, malloc_host=207001)
    fake_npu.set_hal_error(3)
    with pytest.raises(MemoryError) as raised:
        arena_on(fake_npu)
    text = str(raised.value)
    for path in ("aclrtHostRegister", "aclrtMallocHost", "halHostRegister"):
        assert path in text, f"{path} is not named in {text!r}"


def test_the_facts_leave_out_what_a_host_cannot_do(fake_npu: FakeNpu) -> None:
    """A 5.10 kernel gets aclrtMallocHost alone: registering would succeed on the fake but must not be tried."""
    old_kernel = AscendHostFacts(soc="Ascend910B1", driver_version=(25, 0), driver_version_text="25.0",
                                 kernel_release="5.10.0-60.18.0.50.oe2203.aarch64", memlock_bytes=None)
    arena = arena_on(fake_npu, old_kernel)
    assert arena.wait_ready(30)
    assert fake_npu.counter("registered") == 0 and {s.pinned_by for s in arena.memory.segments} == {"aclrtMallocHost"}
    old_driver = AscendHostFacts(soc="Ascend910B1", driver_version=(24, 1), driver_version_text="24.1.rc2",
                                 kernel_release="5.15.0", memlock_bytes=None)
    pinning = npu_segment_pinning(fake_npu.runtime(), "auto", old_driver)
    assert [p.name for p in pinning.paths] == ["aclrtMallocHost", "halHostRegister"]
    on_310p = npu_segment_pinning(fake_npu.runtime(), "auto", AscendHostFacts("Ascend310P3", (25, 0), "25.0",
                                                                              "5.15.0", None))
    assert [p.name for p in on_310p.paths] == ["aclrtMallocHost"]


def test_a_requested_path_the_facts_rule_out_is_refused_naming_the_key(fake_npu: FakeNpu) -> None:
    old_kernel = AscendHostFacts(soc="Ascend910B1", driver_version=(25, 0), driver_version_text="25.0",
                                 kernel_release="5.10.0", memlock_bytes=None)
    with pytest.raises(MemoryError, match="npu_host_memory"):
        npu_segment_pinning(fake_npu.runtime(), "aclrtHostRegister", old_kernel)
    pinning = npu_segment_pinning(fake_npu.runtime(), "aclrtMallocHost", A2_DRIVER_25)
    assert [p.name for p in pinning.paths] == ["aclrtMallocHost"]


def test_a_later_segment_the_chosen_path_refuses_is_left_out(fake_npu: FakeNpu) -> None:
    pinning = npu_segment_pinning(fake_npu.runtime(), "aclrtMallocHost", A2_DRIVER_25)
    allocate = pinning.paths[0].allocate  # type: ignore[union-attr]
    calls = []

    def second_fails(nbytes: int) -> int:
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("out of page-locked memory")
        return allocate(nbytes)

    pinning.paths[0].allocate = second_fails  # type: ignore[union-attr]
    arena = HostArena(6, OBJECT, segment_bytes=2 * 8192, pinning=pinning, hugepages="off")
    assert arena.wait_ready(30)
    assert arena.usable_ranges() == ((0, 2), (4, 6))


@pytest.mark.parametrize("refuse", [(), ("host_register",), ("host_register", "malloc_host")])
def test_every_path_feeds_the_kernel_asynchronously(fake_npu: FakeNpu, refuse: tuple[str, ...]) -> None:
    """The S1 risk over each path: copies between arena slots and staging are never synchronous, and the bytes
    are the oracle's."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)  # its own small page-locked buffers first: the refusal is the arena's
    fake_npu.set_errors(**{name: ACL_ERROR_RT_FEATURE_NOT_SUPPORT for name in refuse})
    arena = arena_on(fake_npu, object_bytes=plan.object_bytes, slots=4)
    assert arena.wait_ready(30)
    assert arena.memory.segments[0].pinned_by == ("halHostRegister" if len(refuse) == 2 else
                                                  "aclrtMallocHost" if refuse else "aclrtHostRegister")
    objects = [arena.slot(1), arena.slot(2)]  # consecutive slots: one copy when they share a segment
    backend.store(plan, SLOTS, objects)
    got = np.stack([o.numpy() for o in objects])
    assert np.array_equal(got[:, payload_mask(geometry)], oracle_store(geometry, SLOTS, got)[:, payload_mask(geometry)])
    assert fake_npu.counter("pageable_async_copies") == 0


ACL_HOST_REG_PINNED, ACL_HOST_REG_MAPPED = 0x10000000, 0x2


def test_segments_are_page_locked_with_register_v2_and_the_runtime_agrees(fake_npu: FakeNpu) -> None:
    """F3: aclrtHostRegisterV2(PINNED | MAPPED) is the call that page-locks a range we own; MAPPED alone maps it."""
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30)
    first = arena.memory.segments[0]
    assert first.pinned_by == "aclrtHostRegister"
    assert fake_npu.registered_flags(first.address) == ACL_HOST_REG_PINNED | ACL_HOST_REG_MAPPED
    assert fake_npu.native.pointer_attributes(first.address)["location"] == "host"
    assert first.device_address == first.address  # the fake maps host memory at the same address


def test_a_toolkit_without_v2_registers_with_v1(fake_npu: FakeNpu) -> None:
    fake_npu.set_host_register_v2_error(ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30)
    first = arena.memory.segments[0]
    assert first.pinned_by == "aclrtHostRegister" and fake_npu.registered_flags(first.address) == -1
    assert fake_npu.counter("registered") == 3


@pytest.mark.parametrize("location", ["unregistered", "device"])
def test_a_registration_the_runtime_does_not_see_as_page_locked_moves_to_the_next_path(
        fake_npu: FakeNpu, location: str) -> None:
    """F3: V1's MAPPED registration that ACL reports as pageable would make every staging copy synchronous; the chain
    moves on to aclrtMallocHost, and no copy of a transfer over the arena runs synchronously."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    fake_npu.set_host_register_v2_error(ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    fake_npu.set_pointer_host_location(location)
    arena = arena_on(fake_npu, object_bytes=plan.object_bytes, slots=4)
    assert arena.wait_ready(30)
    assert {s.pinned_by for s in arena.memory.segments} == {"aclrtMallocHost"}
    assert fake_npu.counter("registered") == 0, "the refused registration was left behind"
    assert f"reports the segment as '{location}' memory" in arena.memory.pinning.describe()  # type: ignore[union-attr]
    backend.store(plan, SLOTS, [arena.slot(1), arena.slot(2)])
    assert fake_npu.counter("pageable_async_copies") == 0


def test_without_the_check_a_pageable_registration_makes_copies_synchronous(fake_npu: FakeNpu,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the test above: the same host without the attribute check keeps the registration, and
    the fake sees the transfer's copies run synchronously."""
    from lmcache_npu.platform import ascend_memory

    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    fake_npu.set_host_register_v2_error(ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    fake_npu.set_pointer_host_location("unregistered")
    monkeypatch.setattr(ascend_memory, "require_page_locked", lambda *args: None)
    arena = arena_on(fake_npu, object_bytes=plan.object_bytes, slots=4)
    assert arena.wait_ready(30) and arena.memory.segments[0].pinned_by == "aclrtHostRegister"
    backend.store(plan, SLOTS, [arena.slot(1), arena.slot(2)])
    assert fake_npu.counter("pageable_async_copies") > 0


def test_asking_for_a_registration_the_runtime_reports_pageable_fails_at_start(fake_npu: FakeNpu) -> None:
    fake_npu.set_host_register_v2_error(ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    fake_npu.set_pointer_host_location("unregistered")
    with pytest.raises(MemoryError, match="aclrtHostRegister.*'unregistered'"):
        arena_on(fake_npu, requested="aclrtHostRegister")


def test_the_driver_registers_for_its_logical_device_and_unregisters_with_the_type(
        fake_npu: FakeNpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """F4: with renumbered devices (ASCEND_RT_VISIBLE_DEVICES=4,5) user device 0 is the driver's logical 4; the
    fake driver refuses an unregistration for another device than the registration's."""
    fake_npu.set_errors(host_register=ACL_ERROR_RT_FEATURE_NOT_SUPPORT, malloc_host=207001)
    fake_npu.set_logic_device(offset=4)
    arena = arena_on(fake_npu)
    assert arena.wait_ready(30) and arena.memory.segments[0].pinned_by == "halHostRegister"
    assert fake_npu.hal_last_device() == 4
    calls = fake_npu.hal_unregister_ex_calls()
    arena.close()
    assert int(fake_npu.hal.lmcache_fake_hal_count()) == 0, "close() left segments registered with the driver"
    assert fake_npu.hal_last_device(unregister=True) == 4 and fake_npu.hal_unregister_ex_calls() == calls + 3


def test_without_aclrt_logic_ids_the_visible_devices_list_maps_the_id(fake_npu: FakeNpu,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_npu.set_logic_device(error=ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "5,7")
    assert fake_npu.native.logical_device(0) == 5 and fake_npu.native.logical_device(1) == 7
    assert fake_npu.native.logical_device(2) == 2  # past the list: the id as it is
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    assert fake_npu.native.logical_device(1) == 1
    fake_npu.set_logic_device(offset=2)
    assert fake_npu.native.logical_device(1) == 3  # ACL's answer first
