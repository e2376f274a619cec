"""The host arena on a CUDA machine: page-locked with cudaHostRegister (exact size, not the caching host
allocator's power-of-two rounding), and the CUDA transfer kernels store into and load from its slots directly."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import get_backend
from lmcache_npu.store.arena import HostArena, slot_bytes_for

from ..ops.strategies import Case, cases
from .cuda_marks import CUDA_KERNELS
from .reference import cuda_reference

pytestmark = CUDA_KERNELS


def test_arena_is_registered_exactly_and_unregistered_when_dropped():
    arena = HostArena(3, 5_000_000)  # pinned by default with a GPU present; 3 x 5,001,216 B, not a power of two
    assert arena.pinned and arena.total_bytes == 3 * 5_001_216
    from lmcache_npu import _cuda

    assert _cuda.host_mapped(arena.base_address, arena.total_bytes)  # torch's is_pinned() only knows its own
    assert not _cuda.host_mapped(torch.zeros(4096, dtype=torch.uint8).data_ptr(), 4096)
    device = torch.arange(5_000_000, device="cuda", dtype=torch.int64).to(torch.uint8)
    arena.slot(1).copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(arena.slot(1).cuda(), device)
    del arena
    gc.collect()
    # unregistered on release: the allocator likely hands the same range back, and registering it again works
    again = HostArena(3, 5_000_000)
    assert _cuda.host_mapped(again.base_address, again.total_bytes)


def test_close_unregisters_at_once_and_keeps_the_slots_readable():
    from lmcache_npu import _cuda

    arena = HostArena(2, 1 << 20)
    arena.slot(0).fill_(7)
    assert _cuda.host_mapped(arena.base_address, arena.total_bytes)
    arena.close()
    assert not _cuda.host_mapped(arena.base_address, arena.total_bytes), "close() left the arena registered"
    assert int(arena.slot(0).sum()) == 7 << 20
    arena.close()  # once only: a second close (or the collection) does nothing


@settings(max_examples=60, deadline=None)
@given(case=cases(soc="a2", max_chunks=8), path=st.sampled_from(["mapped", "staging"]))
def test_cuda_kernels_move_chunks_straight_into_arena_slots(case: Case, path: str):
    geometry = case.geometry
    ref = cuda_reference(case)
    cpu_plan, cuda_plan, expected, cpu_pages, torch_backend = (ref.cpu_plan, ref.cuda_plan, ref.expected,
                                                               ref.cpu_pages, ref.torch_backend)
    arena = HostArena(case.num_chunks, cuda_plan.object_bytes)
    objects = [arena.slot(i) for i in range(case.num_chunks)]
    backend = get_backend("cuda", path=path)
    backend.store(cuda_plan, case.slots, objects)
    torch.cuda.synchronize()
    for i, obj in enumerate(objects):
        assert torch.equal(obj, expected[i]), f"chunk {i}: arena slot bytes differ from the torch backend"
    for rp, page in zip(geometry.raw_planes, cpu_pages):  # load back into zeroed pages on both sides
        rp.raw.zero_()
        page.zero_()
    backend.load(cuda_plan, case.slots, objects)
    torch_backend.load(cpu_plan, case.slots, expected)
    torch.cuda.synchronize()
    for i, (rp, page) in enumerate(zip(geometry.raw_planes, cpu_pages)):
        assert torch.equal(rp.raw.cpu(), page), f"plane {i}: pages loaded from the arena differ"


def test_every_segment_is_registered_on_its_own_and_unregistered_at_close():
    from lmcache_npu import _cuda

    arena = HostArena(5, 5_000_000, segment_bytes=2 * 5_001_216, hugepages="off")  # segments of 2, 2 and 1 slots
    assert arena.wait_ready(60) and arena.usable_ranges() == ((0, 5),)
    segments = arena.memory.segments
    assert len(segments) == 3 and all(s.registered for s in segments)
    for segment in segments:
        assert _cuda.host_mapped(segment.address, segment.mapped_bytes), f"segment {segment.index} not registered"
    assert arena.segment_stats()["segments_live"] == 3
    arena.close()
    assert not any(_cuda.host_mapped(s.address, s.mapped_bytes) for s in segments), "close() left a segment registered"


@settings(max_examples=40, deadline=None)
@given(case=cases(soc="a2", max_chunks=6), path=st.sampled_from(["mapped", "staging"]), data=st.data())
def test_cuda_kernels_move_chunks_into_slots_of_different_segments(case: Case, path: str, data: st.DataObject):
    """One transfer's chunk objects in different, separately registered segments (one slot per segment, in a
    drawn order), against the torch backend; then one flipped byte in a slot must change what loads."""
    geometry = case.geometry
    ref = cuda_reference(case)
    cpu_plan, cuda_plan, expected, cpu_pages, torch_backend = (ref.cpu_plan, ref.cuda_plan, ref.expected,
                                                               ref.cpu_pages, ref.torch_backend)
    num_slots = 2 * case.num_chunks + 1
    arena = HostArena(num_slots, cuda_plan.object_bytes, segment_bytes=slot_bytes_for(cuda_plan.object_bytes),
                      hugepages="off")  # one slot per segment
    assert arena.wait_ready(60) and arena.usable_ranges() == ((0, num_slots),)
    order = data.draw(st.permutations(list(range(num_slots))))[:case.num_chunks]
    objects = [arena.slot(s) for s in order]
    backend = get_backend("cuda", path=path)
    backend.store(cuda_plan, case.slots, objects)
    torch.cuda.synchronize()
    for i, obj in enumerate(objects):
        assert torch.equal(obj, expected[i]), f"chunk {i} in segment {order[i]}: stored bytes differ"
    for rp, page in zip(geometry.raw_planes, cpu_pages):
        rp.raw.zero_()
        page.zero_()
    backend.load(cuda_plan, case.slots, objects)
    torch_backend.load(cpu_plan, case.slots, expected)
    torch.cuda.synchronize()
    for i, (rp, page) in enumerate(zip(geometry.raw_planes, cpu_pages)):
        assert torch.equal(rp.raw.cpu(), page), f"plane {i}: pages loaded from the segments differ"
    # negative control: flip every byte of the last chunk; the loaded pages must differ unless it moves no row
    objects[-1].bitwise_not_()
    for rp in geometry.raw_planes:
        rp.raw.zero_()
    backend.load(cuda_plan, case.slots, objects)
    torch.cuda.synchronize()
    if any(s is not None and (s[-1] >= 0).any() for s in case.slots):
        assert any(not torch.equal(rp.raw.cpu(), page) for rp, page in zip(geometry.raw_planes, cpu_pages)), \
            "a corrupted arena segment went unnoticed"
    arena.close()
