"""Arena segments: whole slots per segment, exact (page-rounded, never power-of-two) mappings, background
registration one segment at a time, failed segments left out of the usable ranges, and the index honouring them."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.platform.host_memory import SegmentPinning
from lmcache_npu.store.arena import SLOT_ALIGN_BYTES, HostArena
from lmcache_npu.store.envelope import ENVELOPE_BYTES
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.platform import vm
from lmcache_npu.store import segments as segments_module
from lmcache_npu.platform.numa import numa_nodes, parse_cpulist
from lmcache_npu.platform.vm import PAGE_BYTES, free_hugepages, parse_hugepages
from lmcache_npu.store.segments import SegmentedMemory, SegmentState, plan_segments


class FakeRegistrar:
    """Records every call; refuses the segments in `refuse`; holds segments from `hold_from` on until released."""

    name = "fake-register"

    def __init__(self, refuse: frozenset[int] = frozenset(), hold_from: int = 10**9) -> None:
        self.refuse, self.hold_from = refuse, hold_from
        self.release = threading.Event()
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.thread_bound = False
        self._calls = 0

    def bind_thread(self) -> None:
        self.thread_bound = True

    def register(self, address: int, nbytes: int) -> int:
        index, self._calls = self._calls, self._calls + 1
        if index >= self.hold_from:
            assert self.release.wait(30), "the test never released the held segments"
        if index in self.refuse:
            raise MemoryError(f"segment {index} refused by the fake")
        self.registered.append((address, nbytes))
        return address + 1  # a device address other than the host's, as ACL gives

    def unregister(self, address: int, nbytes: int) -> None:
        self.unregistered.append(address)


OBJECT = 8192 - ENVELOPE_BYTES  # one object and its trailer fill an 8 KiB slot exactly


def _key(i: int) -> ChunkKey:
    return ChunkKey("ns", i.to_bytes(16, "little"))


@settings(max_examples=40, deadline=None)
@given(num_slots=st.integers(1, 40), object_bytes=st.integers(1, 3 * PAGE_BYTES),
       segment_pages=st.integers(1, 12), hugepages=st.sampled_from(["auto", "off"]))
def test_segments_hold_whole_slots_and_every_slot_keeps_its_own_bytes(num_slots: int, object_bytes: int,
                                                                     segment_pages: int, hugepages: str) -> None:
    arena = HostArena(num_slots, object_bytes, pinned=False, segment_bytes=segment_pages * PAGE_BYTES,
                      hugepages=hugepages)
    memory = arena.memory
    covered = []
    for segment in memory.segments:
        first, end = segment.slot_range
        covered.extend(range(first, end))
        assert segment.address % PAGE_BYTES == 0 and segment.mapped_bytes % PAGE_BYTES == 0
        assert segment.used_bytes == segment.num_slots * arena.slot_bytes <= segment.mapped_bytes
        for slot in range(first, end):  # no slot straddles: it starts and ends inside its segment
            assert segment.address <= arena.slot_address(slot)
            assert arena.slot_address(slot) + arena.slot_bytes <= segment.address + segment.used_bytes
    assert covered == list(range(num_slots))
    assert memory.span_bytes == arena.total_bytes >= num_slots * arena.slot_bytes
    assert memory.segments[-1].mapped_bytes == memory.segments[-1].used_bytes  # the last: page-rounded, no more
    rng = np.random.default_rng(num_slots * 7919 + object_bytes)
    expected = [rng.integers(0, 256, arena.sealed_bytes, dtype=np.uint8) for _ in range(num_slots)]
    for slot in range(num_slots):
        arena.sealed_array(slot)[:] = expected[slot]
    for slot in range(num_slots):
        assert np.array_equal(arena.sealed_array(slot), expected[slot]), f"slot {slot} lost its bytes"
        assert np.array_equal(arena.slot(slot).numpy(), expected[slot][:object_bytes])
        assert arena.slot(slot).data_ptr() == arena.slot_address(slot)
    # negative control: one wrong byte in the last slot is seen by the same comparison
    arena.slot_array(num_slots - 1)[-1] ^= 0xFF
    assert not np.array_equal(arena.sealed_array(num_slots - 1), expected[num_slots - 1])


def test_a_segment_is_sized_exactly_not_rounded_to_a_power_of_two() -> None:
    arena = HostArena(3, 5_000_000, pinned=False, segment_bytes=64 << 20)  # 3 x 5,001,216 B in one segment
    assert len(arena.memory.segments) == 1 and arena.total_bytes == -(-3 * 5_001_216 // PAGE_BYTES) * PAGE_BYTES
    assert arena.base_address % SLOT_ALIGN_BYTES == 0


def test_registration_runs_in_the_background_and_the_first_segment_serves_at_once() -> None:
    fake = FakeRegistrar(hold_from=1)
    arena = HostArena(6, OBJECT, segment_bytes=2 * 8192, pinning=SegmentPinning([fake]), hugepages="off")
    try:
        assert arena.pinned and fake.thread_bound
        assert arena.ready_slots == 2 and arena.usable_ranges() == ((0, 2),)
        assert arena.segment_stats() == {"arena_bytes": 6 * 8192, "arena_live_bytes": 2 * 8192, "segments_live": 1,
                                         "segments_total": 3}
        fake.release.set()
        assert arena.wait_ready(30)
        assert arena.usable_ranges() == ((0, 6),) and arena.ready_slots == 6
        assert fake.registered == [(s.address, s.mapped_bytes) for s in arena.memory.segments]
        assert [s.device_address for s in arena.memory.segments] == [s.address + 1 for s in arena.memory.segments]
    finally:
        fake.release.set()
    arena.close()
    assert sorted(fake.unregistered) == sorted(s.address for s in arena.memory.segments)
    arena.slot(5).fill_(3)  # still mapped after close: only the registration is gone
    assert int(arena.slot(5).sum()) == 3 * OBJECT
    arena.close()
    assert len(fake.unregistered) == 3, "a second close unregistered again"


def test_a_segment_that_cannot_be_registered_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeRegistrar(refuse=frozenset({1}))
    with caplog.at_level(logging.WARNING, logger="lmcache_npu.store.segments"):
        arena = HostArena(7, OBJECT, segment_bytes=2 * 8192, pinning=SegmentPinning([fake]), hugepages="off")
        assert arena.wait_ready(30)
    assert [s.state for s in arena.memory.segments] == [SegmentState.LIVE, SegmentState.FAILED, SegmentState.LIVE,
                                                        SegmentState.LIVE]
    assert arena.usable_ranges() == ((0, 2), (4, 7)) and arena.ready_slots == 2
    assert arena.segment_stats()["segments_live"] == 3 and arena.segment_stats()["arena_live_bytes"] == 5 * 8192
    assert "segment 1 (slots 2-3" in caplog.text and "refused by the fake" in caplog.text
    # the index fed these ranges never hands out slots 2 and 3, however many chunks come
    index = ChunkIndex(arena.num_slots)
    index.limit_slots(arena.usable_ranges())
    stores = index.prepare_store("r", [(i, _key(i)) for i in range(7)])
    assert sorted(s.slot for s in stores) == [0, 1, 4, 5, 6]
    index.check_invariants()
    arena.close()


def test_an_arena_no_segment_of_which_registers_is_a_clear_memory_error() -> None:
    with pytest.raises(MemoryError, match="no segment could be made DMA-able .*refused by the fake"):
        HostArena(2, OBJECT, segment_bytes=8192, pinning=SegmentPinning([FakeRegistrar(refuse=frozenset({0, 1}))]),
                  hugepages="off")


def test_hugepage_settings_are_checked_and_name_the_key() -> None:
    assert parse_hugepages("1G") == "1G"
    with pytest.raises(ValueError, match="hugepages must be one of auto, off, 2M, 1G, got '4K'"):
        parse_hugepages("4K")
    free = free_hugepages(2 << 20)
    if free is None:
        pytest.skip("this kernel exposes no 2 MiB hugepage pool")
    needed_slots = (free + 1) * (2 << 20) // 8192 + 1  # one page more than the pool holds
    with pytest.raises(MemoryError, match="hugepages: 2M needs .* free 2M pages"):
        SegmentedMemory(needed_slots, 8192, hugepages="2M")


@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(1, 30), data=st.data())
def test_the_index_hands_out_only_usable_slots_as_the_usable_set_grows(num_slots: int, data: st.DataObject) -> None:
    index = ChunkIndex(num_slots)
    usable: set[int] = set()
    stored = 0
    for step in range(data.draw(st.integers(1, 4))):
        grow = data.draw(st.sets(st.integers(0, num_slots - 1)))
        usable |= grow
        ranges = [(s, s + 1) for s in sorted(usable)]
        index.limit_slots(ranges)
        assert index.usable_slots == len(usable)
        keys = [(i, _key(1000 * step + i)) for i in range(num_slots)]
        stores = index.prepare_store(f"r{step}", keys)
        assert {s.slot for s in stores} <= usable, "a slot outside the usable set was handed out"
        stored += len(stores)
        index.check_invariants()
    assert stored == len(usable), "a usable slot was never handed out"
    with pytest.raises(ValueError, match=r"usable slot range \[0, 99\) is outside the index's"):
        ChunkIndex(3).limit_slots([(0, 99)])


# ---- background pre-fault ------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _resident_pages(address: int, nbytes: int) -> int:
    """How many of the range's pages (the host's base pages) are in memory now (mincore)."""
    vector = (ctypes.c_ubyte * (-(-nbytes // PAGE_BYTES)))()
    assert _libc.mincore(ctypes.c_void_p(address), nbytes, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vector)


def _staged(num_slots: int, registrar: FakeRegistrar, **options: object) -> SegmentedMemory:
    """8 KiB slots in 8 MiB segments, base pages, pre-faulted by 3 threads (2 MiB pieces: 2 per full segment, whatever
    this host's THP size)."""
    memory = SegmentedMemory(num_slots, 8192, segment_bytes=8 << 20, hugepages="off",
                             pinning=SegmentPinning([registrar]), pages=vm.PageSizes(PAGE_BYTES, 2 << 20),
                             **options)  # type: ignore[arg-type]
    memory._prefault_threads = 3  # this 2-core host would otherwise run one thread
    return memory


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every (address, bytes) vm.write_range pre-faults, in order; the writes still happen."""
    written: list[tuple[int, int]] = []
    write_range = vm.write_range

    def record(address: int, nbytes: int) -> None:
        written.append((address, nbytes))
        write_range(address, nbytes)

    monkeypatch.setattr(vm, "write_range", record)
    return written


def test_segments_not_yet_live_are_faulted_by_parallel_writes_and_every_page_is_resident(
        monkeypatch: pytest.MonkeyPatch) -> None:
    written = _record_writes(monkeypatch)
    memory = _staged(2500, FakeRegistrar())  # 1024 slots a segment: 8, 8 and 3.5 MiB
    assert all(_resident_pages(s.address, s.used_bytes) == 0 for s in memory.segments), "mapping touched pages"
    memory.start()
    assert memory.wait_all(30)
    for segment in memory.segments:
        assert segment.state is SegmentState.LIVE and segment.prefaulted_by == "write"
        assert _resident_pages(segment.address, segment.used_bytes) == segment.used_bytes // PAGE_BYTES
        pieces = sorted((a, n) for a, n in written if segment.address <= a < segment.address + segment.used_bytes)
        assert len(pieces) == (2 if segment.used_bytes == 8 << 20 else 1), pieces  # in parallel pieces
        assert pieces[0][0] == segment.address and sum(n for _, n in pieces) == segment.used_bytes
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:])), "the pieces overlap or leave a gap"
    data = np.frombuffer(memory.buffer(), dtype=np.uint8)
    assert not data.any(), "pre-faulting left a non-zero byte"
    memory.close()
    # negative control: without pre-fault nothing is resident, so the residency check above can fail
    idle = _staged(2500, FakeRegistrar(), prefault=False)
    idle.start()
    assert idle.wait_all(30)
    assert sum(_resident_pages(s.address, s.used_bytes) for s in idle.segments) == 0
    assert all(s.prefaulted_by == "" for s in idle.segments)
    idle.close()


def _mark_pages(memory: SegmentedMemory, stride: int) -> np.ndarray:
    """Writes a non-zero byte at the start of every `stride`-th page (a write-based pre-fault would zero it)."""
    data = np.frombuffer(memory.buffer(), dtype=np.uint8)
    marks = np.arange(1, data.size // (stride * PAGE_BYTES) + 1, dtype=np.uint64) % 251 + 1
    data[::stride * PAGE_BYTES][:marks.size] = marks
    return marks.astype(np.uint8)


def test_a_live_segment_is_populated_and_never_written() -> None:
    memory = SegmentedMemory(2500, 8192, segment_bytes=8 << 20, hugepages="off", prefault=True)  # pageable: live
    memory._prefault_threads = 3
    marks = _mark_pages(memory, 7)  # in use before the pre-fault runs, as a pageable arena's slots may be
    memory.start()
    assert memory.wait_all(30)
    data = np.frombuffer(memory.buffer(), dtype=np.uint8)
    assert np.array_equal(data[::7 * PAGE_BYTES][:marks.size], marks), "the pre-fault wrote into a live segment"
    for segment in memory.segments:
        assert segment.prefaulted_by == "populate"
        assert _resident_pages(segment.address, segment.used_bytes) == segment.used_bytes // PAGE_BYTES
    memory.close()
    # negative control: a write-based pre-fault of the same kind of range destroys the marks, and the check sees it
    victim = SegmentedMemory(2500, 8192, segment_bytes=8 << 20, hugepages="off", prefault=False)
    marks = _mark_pages(victim, 7)
    for segment in victim.segments:
        vm.prefault(segment.address, segment.used_bytes, threads=3, write=True)
    victim_data = np.frombuffer(victim.buffer(), dtype=np.uint8)
    assert not np.array_equal(victim_data[::7 * PAGE_BYTES][:marks.size], marks)


def test_prefault_by_populate_keeps_the_old_method_and_bad_methods_are_refused() -> None:
    memory = _staged(1100, FakeRegistrar(), prefault_by="populate")
    memory.start()
    assert memory.wait_all(30)
    assert [s.prefaulted_by for s in memory.segments] == ["populate", "populate"]
    assert all(_resident_pages(s.address, s.used_bytes) == s.used_bytes // PAGE_BYTES for s in memory.segments)
    memory.close()
    with pytest.raises(ValueError, match="prefault_by must be one of write, populate, got 'memset'"):
        SegmentedMemory(2, 8192, prefault_by="memset")


@pytest.mark.skipif(not numa_nodes() or len(os.sched_getaffinity(0)) < 2, reason="needs a NUMA node and 2 CPUs")
def test_pages_are_first_touched_by_threads_bound_to_the_numa_node(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    node_cpu = frozenset({min(allowed)})  # a node of one CPU, so a binding differs from the process's CPUs
    monkeypatch.setattr(segments_module, "node_cpus", lambda node: node_cpu)
    seen: list[frozenset[int]] = []
    write_range = vm.write_range

    def record(address: int, nbytes: int) -> None:
        seen.append(frozenset(os.sched_getaffinity(0)))
        write_range(address, nbytes)

    monkeypatch.setattr(vm, "write_range", record)
    registrar = FakeRegistrar()
    register = registrar.register
    registering_on: list[frozenset[int]] = []

    def register_and_record(address: int, nbytes: int) -> int:
        registering_on.append(frozenset(os.sched_getaffinity(0)))
        return register(address, nbytes)

    registrar.register = register_and_record  # type: ignore[method-assign]
    memory = _staged(2100, registrar, numa_node=numa_nodes()[0])
    memory._prefault_threads = 2
    memory.start()
    assert memory.wait_all(30)
    assert len(seen) >= 3 and set(seen) == {node_cpu}, seen
    assert set(registering_on) == {allowed}, "the binding leaked into the background thread"
    assert frozenset(os.sched_getaffinity(0)) == allowed, "the binding leaked into the test's thread"
    memory.close()
    # negative control: with no node set the same record shows the process's CPUs, not the node's
    seen.clear()
    free = _staged(2100, FakeRegistrar())
    free.start()
    assert free.wait_all(30)
    assert seen and set(seen) == {allowed}
    free.close()


@settings(max_examples=80, deadline=None)
@given(pages=st.integers(1, 40 * 512), threads=st.integers(1, 9), align_pages=st.sampled_from([1, 512, 1024]))
def test_prefault_pieces_cover_the_range_exactly_on_aligned_boundaries(pages: int, threads: int,
                                                                       align_pages: int) -> None:
    pieces: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(address: int, nbytes: int) -> None:
        with lock:
            pieces.append((address, nbytes))

    original = vm.write_range
    vm.write_range = record  # nothing is mapped: the pieces are only recorded
    try:
        base = 1 << 40
        vm.prefault(base, pages * PAGE_BYTES, threads=threads, write=True, piece_align=align_pages * PAGE_BYTES)
    finally:
        vm.write_range = original
    pieces.sort()
    assert pieces[0][0] == base and all(n > 0 for _, n in pieces)
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:])), "the pieces overlap or leave a gap"
    assert pieces[-1][0] + pieces[-1][1] == base + pages * PAGE_BYTES
    assert len(pieces) <= threads
    assert all((a - base) % (align_pages * PAGE_BYTES) == 0 for a, _ in pieces), "a piece splits a page"


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpulist_round_trips_through_its_kernel_text(cpus: set[int]) -> None:
    ordered, parts = sorted(cpus), []
    run_start = previous = ordered[0]
    for cpu in ordered[1:] + [-1]:
        if cpu != previous + 1:
            parts.append(str(run_start) if run_start == previous else f"{run_start}-{previous}")
            run_start = cpu
        previous = cpu
    assert parse_cpulist(",".join(parts) + "\n") == frozenset(cpus)
    assert parse_cpulist(",".join(parts)) != frozenset(cpus | {301})  # negative control: one CPU more is seen
    with pytest.raises(ValueError, match="a cpulist is comma-separated .* got '5-2'"):
        parse_cpulist("5-2")


@pytest.mark.skipif((free_hugepages(2 << 20) or 0) < 8, reason="needs 8 free 2 MiB hugepages")
def test_explicit_hugepages_are_populated_never_write_faulted() -> None:
    memory = SegmentedMemory(1024, 8192, segment_bytes=4 << 20, hugepages="2M",
                             pinning=SegmentPinning([FakeRegistrar()]))
    memory.start()
    assert memory.wait_all(30)
    assert [s.prefaulted_by for s in memory.segments] == ["populate", "populate"]
    assert all(s.state is SegmentState.LIVE for s in memory.segments)
    memory.close()


def test_a_slot_first_used_in_inference_mode_stays_writable_outside_it() -> None:
    """Segment views are made on first use, which may be a model step inside vLLM's inference mode; the io threads
    write the same slots outside it (a tensor made in inference mode would refuse them)."""
    import torch

    arena = HostArena(2, OBJECT, pinned=False, hugepages="off")
    with torch.inference_mode():
        first = arena.slot(0)
    arena.slot(0).fill_(7)
    assert int(first[0]) == 7
    with torch.inference_mode():  # negative control: what the arena must not hand out
        inference = torch.from_numpy(np.zeros(4, dtype=np.uint8))
    with pytest.raises(RuntimeError, match="inference tensor"):
        inference.fill_(1)


class FakeAllocator:
    """A path that hands out memory of its own (aclrtMallocHost's shape); counts its allocations."""

    name = "fake-malloc-host"

    def __init__(self) -> None:
        self.allocated = 0

    def bind_thread(self) -> None:
        pass

    def allocate(self, nbytes: int) -> int:
        self.allocated += 1
        raise AssertionError("a shared arena must never take a segment's memory from an allocator")

    def free(self, address: int) -> None:
        raise AssertionError("nothing was allocated")


def test_a_shared_arena_takes_no_allocator_path_and_registers_the_shared_pages_instead() -> None:
    """The node cache's segments are memory files other processes map: a path that replaces a segment's memory
    (aclrtMallocHost) would give this process pages nobody else sees, so only registration is tried; the bytes a
    second mapping writes are the ones this one reads."""
    owner = HostArena(4, OBJECT, segment_bytes=2 * 8192, pinned=False, share=True, hugepages="off")
    allocator, registrar = FakeAllocator(), FakeRegistrar()
    worker = HostArena(4, OBJECT, segment_bytes=2 * 8192, pinning=SegmentPinning([allocator, registrar]),
                       hugepages="off", shared_fds=owner.segment_fds, prefault=False)
    assert worker.wait_ready(30) and worker.usable_ranges() == ((0, 4),)
    assert allocator.allocated == 0 and len(registrar.registered) == 2  # both segments registered, none allocated
    assert all(s.pinned_by == "fake-register" for s in worker.memory.segments)
    owner.slot(3)[:] = 0x5A
    assert bool((worker.slot(3) == 0x5A).all()) and not bool((worker.slot(2) == 0x5A).any())
    worker.close()
    owner.close()


def test_mapping_another_processes_segments_never_writes_their_bytes() -> None:
    """An attached mapping is pre-faulted (and registered) without a write: the service's chunks stay as they are.
    The control: the write pre-fault an unshared arena uses on a fresh segment does change such bytes."""
    owner = HostArena(2, OBJECT, segment_bytes=8192, pinned=False, share=True, hugepages="off")
    for slot in range(2):
        owner.slot(slot)[:] = 0xA5
    worker = HostArena(2, OBJECT, segment_bytes=8192, pinning=SegmentPinning([FakeRegistrar()]), hugepages="off",
                       shared_fds=owner.segment_fds)
    assert worker.wait_ready(30)
    assert all(s.prefaulted_by in ("", "populate") for s in worker.memory.segments)
    assert bool((owner.slot(0) == 0xA5).all()) and bool((owner.slot(1) == 0xA5).all())
    segment = owner.memory.segments[0]
    vm.write_range(segment.address, segment.used_bytes)  # what a write pre-fault does to a segment's pages
    assert not bool((owner.slot(0) == 0xA5).all())
    worker.close()
    owner.close()


def test_a_shared_segment_file_of_another_size_is_refused_before_mapping() -> None:
    owner = HostArena(2, OBJECT, segment_bytes=8192, pinned=False, share=True, hugepages="off")
    with pytest.raises(ValueError, match="2 segment files, this layout needs 1"):
        HostArena(2, OBJECT, segment_bytes=2 * 8192, pinned=False, shared_fds=owner.segment_fds, hugepages="off")
    with pytest.raises(MemoryError, match="holds 8192 B, the arena expects 16384 B"):
        HostArena(2, 2 * 8192 - ENVELOPE_BYTES, segment_bytes=2 * 8192, pinned=False,
                  shared_fds=owner.segment_fds, hugepages="off")
    owner.close()


# ---- the host's page sizes (64 KiB base pages on some aarch64 kernels) ----------------------------------------------

KIB64 = 64 << 10
AARCH64_64K = vm.PageSizes(KIB64, 512 << 20)  # a Kunpeng host's kernel built with 64 KiB pages


def test_page_sizes_come_from_the_host_and_the_thp_size_from_sysfs_else_2_mib(tmp_path: Path) -> None:
    assert vm.base_page_bytes() == mmap.PAGESIZE == os.sysconf("SC_PAGE_SIZE") == PAGE_BYTES
    assert vm.PageSizes.host() == vm.PageSizes(PAGE_BYTES, vm.thp_pmd_bytes())
    pmd = tmp_path / "hpage_pmd_size"
    pmd.write_text("536870912\n")
    assert vm.thp_pmd_bytes(str(pmd)) == 512 << 20
    for text in ("", "lots\n", "0\n", "3000\n"):  # unreadable or not a power of two: the x86_64 size
        pmd.write_text(text)
        assert vm.thp_pmd_bytes(str(pmd)) == 2 << 20, text
    assert vm.thp_pmd_bytes(str(tmp_path / "absent")) == 2 << 20
    with pytest.raises(ValueError, match="powers of two of at least 4 KiB, got base_bytes=2048"):
        vm.PageSizes(2048, 2 << 20)


def _kernel_with_64k_pages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Makes the segments' map_fixed answer as a 64 KiB-page kernel does: EINVAL for an address off a 64 KiB page
    (this host's kernel accepts 4 KiB ones); the addresses it mapped."""
    real, mapped = segments_module.map_fixed, []

    def map_fixed(address: int, nbytes: int, hugetlb_bytes: int = 0) -> None:
        if address % KIB64:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        mapped.append(address)
        real(address, nbytes, hugetlb_bytes)

    monkeypatch.setattr(segments_module, "map_fixed", map_fixed)
    return mapped


@settings(max_examples=25, deadline=None)
@given(slot_pages=st.integers(1, 8).map(lambda k: 2 * k - 1), per_segment=st.integers(1, 15),
       hugepages=st.sampled_from(["auto", "off"]), data=st.data())
def test_with_64k_base_pages_every_segment_starts_on_a_page_and_keeps_its_bytes(
        slot_pages: int, per_segment: int, hugepages: str, data: st.DataObject) -> None:
    slot_bytes = slot_pages * SLOT_ALIGN_BYTES  # an odd number of 4 KiB pages: no segment ends on a 64 KiB page
    num_slots = data.draw(st.integers(per_segment + 1, 5 * per_segment), label="num_slots")  # two segments or more
    with pytest.MonkeyPatch.context() as patch:
        mapped = _kernel_with_64k_pages(patch)
        memory = SegmentedMemory(num_slots, slot_bytes, segment_bytes=per_segment * slot_bytes, hugepages=hugepages,
                                 prefault=False, pages=AARCH64_64K)
    assert len(memory.segments) >= 2 and mapped == [s.address for s in memory.segments]
    for segment in memory.segments:
        assert segment.address % KIB64 == 0 and segment.mapped_bytes % KIB64 == 0
        assert segment.used_bytes == segment.num_slots * slot_bytes <= segment.mapped_bytes
    memory.start()
    assert memory.wait_all(30)
    rng = np.random.default_rng(num_slots * 131 + slot_pages)
    expected = [rng.integers(0, 256, s.used_bytes, dtype=np.uint8) for s in memory.segments]
    for segment, values in zip(memory.segments, expected):
        memory.segment_view(segment.index)[:] = values
    for segment, values in zip(memory.segments, expected):
        assert np.array_equal(memory.segment_view(segment.index), values), f"segment {segment.index} lost its bytes"
    memory.close()
    # negative control: the old 4 KiB alignment puts a later segment off a 64 KiB page, and that kernel refuses it
    old = plan_segments(num_slots, slot_bytes, per_segment, 4096, 4096)
    assert not all(segment.address % KIB64 == 0 for segment in old)
    with pytest.MonkeyPatch.context() as patch:
        _kernel_with_64k_pages(patch)
        with pytest.raises(MemoryError, match="could not map arena segment .*Invalid argument"):
            SegmentedMemory(num_slots, slot_bytes, segment_bytes=per_segment * slot_bytes, hugepages="off",
                            prefault=False, pages=vm.PageSizes(4096, 2 << 20))


def test_slots_stay_4_kib_multiples_whatever_the_base_page() -> None:
    memory = SegmentedMemory(2, 3 * SLOT_ALIGN_BYTES, segment_bytes=3 * SLOT_ALIGN_BYTES, prefault=False,
                             pages=AARCH64_64K)  # 12 KiB slots: not a multiple of the 64 KiB page, still accepted
    assert memory.slot_address(1) - memory.slot_address(0) == KIB64
    with pytest.raises(ValueError, match="slot_bytes a multiple of 4096, got 2 x 2048 B"):
        SegmentedMemory(2, 2048, pages=AARCH64_64K)


def test_segments_pad_to_a_thp_boundary_only_when_they_hold_a_whole_thp(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 512 MiB THPs a small segment padded to one would map (and register) up to 512 MiB it never uses."""
    monkeypatch.setattr(segments_module, "transparent_hugepages_enabled", lambda: True)
    pages = vm.PageSizes(KIB64, 1 << 20)  # a 1 MiB THP keeps the mappings small
    slot = 3 * SLOT_ALIGN_BYTES
    whole = SegmentedMemory(3 * 100, slot, segment_bytes=100 * slot, prefault=False, pages=pages)  # 1200 KiB each
    assert whole.transparent and all(s.address % (1 << 20) == 0 for s in whole.segments)
    assert [s.mapped_bytes for s in whole.segments] == [2 << 20, 2 << 20, 1216 << 10]  # the last: 64 KiB pages
    small = SegmentedMemory(3 * 10, slot, segment_bytes=10 * slot, prefault=False, pages=pages)  # 120 KiB each
    assert [s.mapped_bytes for s in small.segments] == [128 << 10] * 3  # base pages only
    assert any(s.address % (1 << 20) for s in small.segments)  # the control: not on THP boundaries


def test_512_mib_thps_still_prefault_in_parallel_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces stay 2 MiB-aligned with 512 MiB THPs: aligned to the THP, an 8 MiB segment would be one thread's."""
    written = _record_writes(monkeypatch)
    memory = SegmentedMemory(1024, 8192, segment_bytes=8 << 20, hugepages="off", pages=AARCH64_64K,
                             pinning=SegmentPinning([FakeRegistrar()]))
    memory._prefault_threads = 3
    memory.start()
    assert memory.wait_all(30)
    assert [s.prefaulted_by for s in memory.segments] == ["write"] and len(written) == 2
    assert all((a - memory.base_address) % (2 << 20) == 0 for a, _ in written)
    memory.close()
    written.clear()  # the control: pieces aligned to the 512 MiB THP leave one piece
    vm.prefault(memory.base_address, 8 << 20, threads=3, write=True, piece_align=512 << 20)
    assert len(written) == 1
