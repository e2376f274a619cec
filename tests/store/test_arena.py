"""The host arena: page-aligned slots, views that share its bytes (one segment here; test_segments.py covers
many), bounds and NUMA checks."""

import pytest
import torch

from lmcache_npu.platform.numa import numa_nodes
from lmcache_npu.store.arena import SLOT_ALIGN_BYTES, HostArena, slots_for_capacity


def test_slots_are_page_aligned_views_of_one_allocation():
    arena = HostArena(5, 10_000, pinned=False)
    assert arena.slot_bytes == 12_288 and arena.total_bytes == 5 * 12_288
    assert arena.base_address % SLOT_ALIGN_BYTES == 0
    for slot in range(5):
        assert arena.slot_address(slot) == arena.base_address + slot * arena.slot_bytes
        assert arena.slot(slot).data_ptr() == arena.slot_address(slot)
        assert arena.slot(slot).numel() == len(arena.slot_view(slot)) == 10_000
    arena.slot_view(3)[:4] = b"\x01\x02\x03\x04"
    assert arena.slot(3)[:4].tolist() == [1, 2, 3, 4]
    arena.slot(2).fill_(7)
    assert bytes(arena.slot_view(2)[-2:]) == b"\x07\x07" and not arena.slot(3)[4:].any() and not arena.slot(1).any()


def test_out_of_range_slots_are_refused():
    arena = HostArena(2, 64, pinned=False)
    for bad in (-1, 2):
        with pytest.raises(IndexError, match=f"arena slot {bad} is out of range \\(the arena has 2 slots\\)"):
            arena.slot(bad)
        with pytest.raises(IndexError):
            arena.slot_view(bad)


def test_capacity_in_bytes_becomes_slots():
    assert slots_for_capacity(10 * 8192, 5000) == 10
    # a 4096 B object plus its envelope trailer needs two pages
    assert HostArena.for_capacity(3 * 8192 + 100, 4096, pinned=False).num_slots == 3
    assert HostArena.for_capacity(3 * 8192 - 1, 4096, pinned=False).num_slots == 2
    with pytest.raises(ValueError, match="cpu_bytes 100 is smaller than one chunk slot"):
        slots_for_capacity(100, 5000)
    with pytest.raises(ValueError, match="at least one slot"):
        HostArena(0, 10)


@pytest.mark.skipif(not numa_nodes(), reason="this kernel exposes no NUMA nodes")
def test_numa_binding_allocates_on_a_real_node_and_refuses_a_missing_one():
    node = numa_nodes()[0]
    arena = HostArena(2, 4096, pinned=False, numa_node=node)
    assert arena.numa_node == node and not arena.slot(1).any()
    with pytest.raises(ValueError, match=f"numa_node {max(numa_nodes()) + 1} is not a NUMA node of this host"):
        HostArena(2, 4096, pinned=False, numa_node=max(numa_nodes()) + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without an accelerator")
def test_pinning_without_an_accelerator_is_a_clear_memory_error():
    with pytest.raises(MemoryError, match="could not allocate a .* GiB host arena \\(pinned\\)"):
        HostArena(1, 4096, pinned=True)


def test_the_sealed_view_is_the_object_then_its_trailer_and_the_kernels_see_only_the_object():
    from lmcache_npu.store.envelope import ENVELOPE_BYTES

    arena = HostArena(3, 4096 - ENVELOPE_BYTES + 1, pinned=False)  # one byte more than a page with the trailer
    assert arena.slot_bytes == 8192 and arena.sealed_bytes == 4097
    sealed = arena.sealed_view(1)
    sealed[:] = bytes(range(256)) * 16 + b"\xff"
    assert arena.slot(1).numel() == 4096 - ENVELOPE_BYTES + 1
    assert bytes(arena.slot_view(1)) == bytes(sealed[:arena.object_bytes])
    assert arena.sealed_array(1)[-1] == 0xFF and not arena.slot(0).any() and not arena.slot(2).any()
    assert arena.sealed_array(1).ctypes.data == arena.slot_address(1)
