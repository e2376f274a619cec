"""Arena segments (DESIGN §7, tier L1): the host arena's memory as separately mapped, separately registered pieces.

One virtual address range is reserved (PROT_NONE, nothing committed) and every segment is an anonymous private mmap
fixed inside it, so the arena is one address range (what Mooncake registers) made of pieces the device registers one
by one. A segment holds whole slots (a slot never straddles two), its length is rounded only to its page size (no
power-of-two rounding), and its pages may be transparent or explicit hugepages and bound to a NUMA node. Slots are
4 KiB multiples on every host; where segments start (and so how far each is rounded) is the host kernel's business:
its base page (64 KiB on some aarch64 kernels) or, for transparent hugepages, its THP size (`vm.PageSizes`).

Mapping is synchronous and cheap (nothing is touched); pre-faulting and pinning (device registration, or the device
runtime's own allocation where registering our memory cannot work: `platform/host_memory.py`) run on one background
thread, segment after segment, so the engine serves from the first segment while the rest are prepared. A segment
that is not live yet is pre-faulted by writing into its pages from several threads (bound to the arena's NUMA node's
CPUs), a live one (pageable arenas) by MADV_POPULATE_WRITE, which never changes its bytes. A segment
that cannot be pinned is left out with a warning: the arena shrinks, and the usable slots are the union of the
live segments' slot ranges (`usable_ranges`), not necessarily a prefix. The libc calls underneath (reservation,
fixed mappings, mbind, the pre-fault threads) are `platform/vm.py`'s; this module is the segments' state machine.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Sequence

import numpy as np

from ..checks import check_int
from ..platform.host_memory import HostAllocator, HostMemoryPath, HostRegistrar, SegmentPinning, allocates
from ..platform.numa import node_cpus, numa_nodes
from ..platform.vm import (HUGEPAGE_CHOICES, MADV_HUGEPAGE, MADV_NOHUGEPAGE, SLOT_ALIGN_BYTES, PageSizes, Reservation,
                           advise, bind_to_node, create_shared, free_hugepages, map_fixed, map_fixed_shared,
                           parse_hugepages, prefault, prefault_threads, transparent_hugepages_enabled,
                           unmap_to_reservation)

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 2 << 30
PREFAULT_BY = ("write", "populate")


class SegmentState(str, Enum):
    MAPPED = "mapped"  # address space and (for hugetlb) pages reserved, nothing touched yet
    LIVE = "live"  # its slots may be handed out: registered (or pageable), pre-faulted when asked
    FAILED = "failed"  # registration failed: its slots are never handed out


@dataclass
class Segment:
    """`num_slots` slots from `first_slot` at `address`; `mapped_bytes` is the whole mapping (page-rounded)."""

    index: int
    first_slot: int
    num_slots: int
    address: int
    used_bytes: int
    mapped_bytes: int
    state: SegmentState = SegmentState.MAPPED
    registered: bool = False
    allocated: bool = False  # its memory came from a HostAllocator (aclrtMallocHost), not from our mapping
    pinned_by: str = ""  # the path that made it DMA-able
    device_address: Optional[int] = None
    error: str = ""
    prefault_s: float = 0.0  # how long touching its pages took (benchmarks report GB/s from these)
    prefaulted_by: str = ""  # "write" or "populate": how its pages were faulted in ("" when they were not)
    register_s: float = 0.0  # how long the device registration (or allocation) took

    @property
    def slot_range(self) -> tuple[int, int]:
        return self.first_slot, self.first_slot + self.num_slots


def plan_segments(num_slots: int, slot_bytes: int, slots_per_segment: int, align: int,
                  last_align: int) -> list[Segment]:
    """The segments of `num_slots` slots, `address` an offset from the arena's base: every segment but the last is
    rounded up to `align`, so the next one starts on it (mmap(MAP_FIXED) needs at least the base page), the last
    only to `last_align` (its page size)."""
    segments: list[Segment] = []
    offset = 0
    for first in range(0, num_slots, slots_per_segment):
        count = min(slots_per_segment, num_slots - first)
        used = count * slot_bytes
        mapped = -used % (last_align if first + count == num_slots else align) + used
        segments.append(Segment(len(segments), first, count, offset, used, mapped))
        offset += mapped
    return segments


@dataclass(frozen=True)
class _LiveView:
    """What is live, as of the last segment state change: slot ranges, bytes, segment count."""

    ranges: tuple[tuple[int, int], ...]
    live_bytes: int
    segments_live: int


class SegmentedMemory:
    """`num_slots` slots of `slot_bytes` in segments of at most `segment_bytes` (at least one slot each).

    `pinning` (None: pageable) makes each segment DMA-able: its paths are tried in order on the first segment and
    the first that works is kept (a path that allocates, aclrtMallocHost, replaces the segment's mapping with the
    device runtime's memory: such segments are not one address range, see `contiguous`); `numa_node` binds the pages
    (strict), or
    `preferred_node` prefers a node (the device's, found automatically); `prefault` touches every used page in the
    background before the segment goes live, from threads bound to that node's CPUs. `prefault_by`: "write" faults a
    segment that is not live yet by writing into its pages in parallel (fast) and a live one (pageable arenas, whose
    slots serve at once) with MADV_POPULATE_WRITE, which never changes a byte; "populate" uses MADV_POPULATE_WRITE
    for every segment (what benchmarks compare against). Explicit hugepages (`2M`, `1G`) are always populated: a
    hugetlb write fault that finds no free page on the bound node kills the process with SIGBUS, where populating
    returns the error and the segment is left out. `pages` (this host's by default) are the base page every segment
    starts on and the transparent hugepage size. `start()` begins the background preparation."""

    def __init__(self, num_slots: int, slot_bytes: int, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 hugepages: str = "auto", pinning: Optional[SegmentPinning] = None,
                 numa_node: Optional[int] = None, preferred_node: Optional[int] = None,
                 prefault: bool = True, prefault_by: str = "write", share: bool = False,
                 shared_fds: Optional[Sequence[int]] = None, pages: Optional[PageSizes] = None) -> None:
        if prefault_by not in PREFAULT_BY:
            raise ValueError(f"prefault_by must be one of {', '.join(PREFAULT_BY)}, got {prefault_by!r}")
        if num_slots < 1 or slot_bytes < 1 or slot_bytes % SLOT_ALIGN_BYTES:
            raise ValueError(f"segments need num_slots >= 1 and slot_bytes a multiple of {SLOT_ALIGN_BYTES}, got "
                             f"{num_slots} x {slot_bytes} B")
        check_int("arena_segment_bytes", segment_bytes, lo=1)
        self.hugepages = parse_hugepages(hugepages)
        if numa_node is not None and numa_node not in numa_nodes():
            raise ValueError(f"numa_node {numa_node} is not a NUMA node of this host (nodes: "
                             f"{numa_nodes() or 'none exposed'})")
        if preferred_node is not None and preferred_node not in numa_nodes():
            preferred_node = None  # a hint from the device's firmware, not the operator's: no placement then
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slots_per_segment = max(1, segment_bytes // slot_bytes)
        if segment_bytes < slot_bytes:
            logger.warning("arena_segment_bytes %d is smaller than one slot (%d B): one slot per segment",
                           segment_bytes, slot_bytes)
        self.pages = pages or PageSizes.host()
        self.hugetlb_bytes = HUGEPAGE_CHOICES[self.hugepages]  # explicit hugepages (MAP_HUGETLB); 0: base pages
        self.page_bytes = self.hugetlb_bytes or self.pages.base_bytes
        self.transparent = self.hugepages == "auto" and transparent_hugepages_enabled()
        # padding to a THP boundary pays only when a segment holds a whole THP (512 MiB on 64 KiB-page aarch64)
        thp_align = self.transparent and self.slots_per_segment * slot_bytes >= self.pages.thp_bytes
        align = self.page_bytes if self.hugetlb_bytes else (self.pages.thp_bytes if thp_align else self.page_bytes)
        self.pinning = pinning
        self.numa_node = numa_node
        self.preferred_node = None if numa_node is not None else preferred_node
        self.prefault = prefault
        self.prefault_by = prefault_by
        node = numa_node if numa_node is not None else self.preferred_node
        # pages are first touched from their node: local faults, and the node's CPUs rather than the engine's
        self.prefault_cpus = node_cpus(node) if node is not None else frozenset()
        if node is not None and not self.prefault_cpus:
            logger.info("host arena: NUMA node %d has no CPU this process may use: pre-fault threads are not bound "
                        "(the pages are still placed on it by the memory policy)", node)
        self._prefault_threads = prefault_threads(self.prefault_cpus or None)
        # threads fault whole THPs, but pieces of at most 2 MiB: a range under threads x 512 MiB (64 KiB-page aarch64)
        # would otherwise be faulted by one thread; two threads meeting in one THP only wait for each other
        self._piece_align = max(self.page_bytes, min(self.pages.thp_bytes, 2 << 20))
        # shared: every segment is a memory file other processes map too (`share` creates them, `shared_fds` maps
        # another process's); an attached process never writes a byte it did not mean to (pre-faults only populate)
        self.shared = share or shared_fds is not None
        self.attached = shared_fds is not None
        self.segment_fds: list[int] = []
        self.segments = plan_segments(num_slots, slot_bytes, self.slots_per_segment, align, self.page_bytes)
        self.span_bytes = sum(segment.mapped_bytes for segment in self.segments)
        self._check_hugepage_pool()
        self._reservation = Reservation(self.span_bytes, max(align, self.page_bytes))
        self.base_address = self._reservation.address
        if shared_fds is not None and len(shared_fds) != len(self.segments):
            raise ValueError(f"the shared arena has {len(shared_fds)} segment files, this layout needs "
                             f"{len(self.segments)} (slot size, segment size or hugepages differ)")
        for segment in self.segments:
            segment.address += self.base_address
            if share:
                self.segment_fds.append(create_shared(f"lmcache-npu-segment-{segment.index}", segment.mapped_bytes,
                                                      self.hugetlb_bytes))
            elif shared_fds is not None:
                self.segment_fds.append(shared_fds[segment.index])
            self._map(segment)
        self._state_lock = threading.Condition()
        self._live = _LiveView((), 0, 0)  # replaced whole (one reference swap) whenever a segment changes state
        self._stop = threading.Event()
        self._live_listeners: list[Callable[[int, int], None]] = []
        self._bound: set[int] = set()  # ids of the paths whose bind_thread ran on the background thread
        self._thread: Optional[threading.Thread] = None
        self._settled = 0  # segments the background thread has finished with
        self.started_at: Optional[float] = None
        self.first_live_at: Optional[float] = None
        self.all_settled_at: Optional[float] = None

    # ---- set-up -------------------------------------------------------------------------------------------------

    def _check_hugepage_pool(self) -> None:
        if not self.hugetlb_bytes or self.attached:  # another process's files hold their pages already
            return
        needed = self.span_bytes // self.page_bytes
        free = free_hugepages(self.page_bytes)
        if free is not None and free < needed:
            raise MemoryError(f"hugepages: {self.hugepages} needs {needed} free {self.hugepages} pages for a "
                              f"{self.span_bytes / 2**30:.2f} GiB arena, the pool has {free} (raise "
                              f"/sys/kernel/mm/hugepages/hugepages-{self.page_bytes // 1024}kB/nr_hugepages, or set "
                              f"hugepages: auto)")

    def _map(self, segment: Segment) -> None:
        try:
            if self.shared:
                map_fixed_shared(segment.address, segment.mapped_bytes, self.segment_fds[segment.index])
            else:
                map_fixed(segment.address, segment.mapped_bytes, self.hugetlb_bytes)
        except OSError as exc:
            key = f"hugepages: {self.hugepages}: " if self.hugetlb_bytes else ""
            raise MemoryError(f"{key}could not map arena segment {segment.index} ({segment.mapped_bytes / 2**30:.2f} "
                              f"GiB): {exc.strerror}") from exc
        if not self.hugetlb_bytes:
            advice = MADV_HUGEPAGE if self.transparent else (MADV_NOHUGEPAGE if self.hugepages == "off" else None)
            if advice is not None:
                advise(segment.address, segment.mapped_bytes, advice)
        node = self.numa_node if self.numa_node is not None else self.preferred_node
        if node is not None and not self.attached:  # a shared file's policy is its creator's to set
            bind_to_node(segment.address, segment.mapped_bytes, node, strict=self.numa_node is not None)

    # ---- background preparation ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Begins pre-faulting and registering the segments on a background thread (once)."""
        if self.started_at is not None:
            return
        self.started_at = time.perf_counter()
        if self.pinning is None:
            with self._state_lock:  # pageable: a page faults in on first use anyway, so every slot is usable at once
                for segment in self.segments:
                    segment.state = SegmentState.LIVE
                self._refresh_live()
                self.first_live_at = self.started_at
                if not self.prefault:
                    self.all_settled_at = self.started_at
                    return
        self._thread = threading.Thread(target=self._prepare_all, name="lmcache-arena-segments", daemon=True)
        self._thread.start()

    def _prepare_all(self) -> None:
        for segment in self.segments:
            if self._stop.is_set():
                self._settle(segment, "the arena was closed before this segment was prepared")
                continue
            self._settle(segment, self._prepare(segment))

    def _prepare(self, segment: Segment) -> str:
        """Pre-faults and pins one segment; the reason it cannot be used, or "" when it can."""
        if self.pinning is None:
            return self._prefault_once(segment)
        errors = []
        for path in self.pinning.candidates():
            error = self._pin(segment, path)
            if not error:
                self.pinning.settle(path)
                return ""
            self.pinning.failed(path, error)
            errors.append(f"{path.name}: {error}")
        return "; ".join(errors)

    def _prefault_once(self, segment: Segment) -> str:
        if not self.prefault or segment.prefaulted_by:
            return ""
        began = time.perf_counter()
        try:
            segment.prefaulted_by = self._prefault_segment(segment)
        except Exception as exc:
            return f"pre-faulting failed: {exc}"
        segment.prefault_s = time.perf_counter() - began
        return ""

    def _bind(self, path: HostMemoryPath) -> str:
        if id(path) in self._bound:
            return ""
        try:
            path.bind_thread()
        except Exception as exc:
            return f"could not select the device ({exc})"
        self._bound.add(id(path))
        return ""

    def _pin(self, segment: Segment, path: HostMemoryPath) -> str:
        """Makes `segment` DMA-able through `path`: registers our mapping, or takes the path's own memory."""
        error = self._bind(path)
        if error:
            return error
        began = time.perf_counter()
        if allocates(path) and self.shared:
            return "it allocates memory of its own, which the other processes of a shared arena cannot map"
        if allocates(path):
            assert isinstance(path, HostAllocator)
            try:
                address = path.allocate(segment.mapped_bytes)
            except Exception as exc:
                return f"allocation failed: {exc}"
            self._adopt(segment, address, path)
        else:
            assert isinstance(path, HostRegistrar)
            error = self._prefault_once(segment)
            if error:
                return error
            try:
                segment.device_address = path.register(segment.address, segment.mapped_bytes)
            except Exception as exc:
                return f"registration failed: {exc}"
            self._reservation.add_registered(segment.address, segment.mapped_bytes, path)
            segment.registered = True
        segment.register_s = time.perf_counter() - began
        segment.pinned_by = path.name
        return ""

    def _adopt(self, segment: Segment, address: int, allocator: HostAllocator) -> None:
        """`segment` now lives at `address` (the allocator's memory); our mapping for it goes back to a reservation,
        so pages an earlier path faulted in there are returned to the kernel."""
        unmap_to_reservation(segment.address, segment.mapped_bytes)
        self._reservation.add_allocated(address, allocator)
        segment.address = address
        segment.allocated = True
        segment.prefaulted_by = ""

    def _prefault_segment(self, segment: Segment) -> str:
        """Faults the segment's used pages in; how ("write" or "populate")."""
        # a live segment's bytes may be in use, and an attached one's are another process's: never write them
        unused = segment.state is not SegmentState.LIVE and not self.attached

        def fault(write: bool) -> None:
            prefault(segment.address, segment.used_bytes, threads=self._prefault_threads, write=write,
                      piece_align=self._piece_align, cpus=self.prefault_cpus or None)

        if unused and self.prefault_by == "write" and not self.hugetlb_bytes:
            fault(write=True)
            return "write"
        try:
            fault(write=False)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not unused:
                raise
            # a kernel before 5.14 has no MADV_POPULATE_WRITE; an unused segment can still be faulted by writing
            fault(write=True)
            return "write"
        return "populate"

    def _settle(self, segment: Segment, error: str) -> None:
        if not error and segment.allocated:
            self._announce(segment)  # before its slots can be handed out
        with self._state_lock:
            if self.pinning is not None:  # pageable segments went live at start: a failed pre-fault only warns
                segment.state = SegmentState.FAILED if error else SegmentState.LIVE
                self._refresh_live()
            segment.error = error
            now = time.perf_counter()
            if not error and self.first_live_at is None:
                self.first_live_at = now
            self._settled += 1
            if self._settled == len(self.segments):
                self.all_settled_at = now
            self._state_lock.notify_all()
        if error and self.pinning is None:
            logger.warning("host arena: pre-faulting segment %d failed (its pages fault in on first use): %s",
                           segment.index, error)
        elif error:
            logger.warning("host arena: segment %d (slots %d-%d, %.2f GiB) is left out: %s", segment.index,
                           segment.first_slot, segment.first_slot + segment.num_slots - 1,
                           segment.used_bytes / 2**30, error)

    def wait_first(self, timeout: Optional[float] = None) -> bool:
        """Blocks until a segment is live or every one has settled; True when some segment is live."""
        with self._state_lock:
            self._state_lock.wait_for(lambda: self.first_live_at is not None or self.all_settled_at is not None,
                                      timeout)
            return self.first_live_at is not None

    def wait_all(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every segment is live or failed; True when they all have."""
        with self._state_lock:
            return self._state_lock.wait_for(lambda: self.all_settled_at is not None, timeout)

    # ---- state --------------------------------------------------------------------------------------------------

    def _refresh_live(self) -> None:
        """Recomputes what is live (called under the state lock whenever a segment's state changes): the workers
        read it every step, and segments change state only while the arena is being prepared."""
        ranges: list[list[int]] = []
        live_bytes = 0
        for segment in self.segments:
            if segment.state is not SegmentState.LIVE:
                continue
            live_bytes += segment.used_bytes
            begin, end = segment.slot_range
            if ranges and ranges[-1][1] == begin:
                ranges[-1][1] = end
            else:
                ranges.append([begin, end])
        self._live = _LiveView(tuple((b, e) for b, e in ranges), live_bytes,
                               sum(s.state is SegmentState.LIVE for s in self.segments))

    def usable_ranges(self) -> tuple[tuple[int, int], ...]:
        """[first, end) slot ranges of the live segments, in order, adjacent ones merged."""
        return self._live.ranges

    @property
    def ready_slots(self) -> int:
        """How many leading slots are usable (the prefix before the first segment not live)."""
        ranges = self._live.ranges
        return ranges[0][1] if ranges and ranges[0][0] == 0 else 0

    @property
    def live_bytes(self) -> int:
        return self._live.live_bytes

    @property
    def segments_live(self) -> int:
        return self._live.segments_live

    @property
    def contiguous(self) -> bool:
        """Whether every slot lies in the one reserved range [base_address, base_address + span_bytes): false once
        the segments' memory comes from an allocator (aclrtMallocHost), each segment then an address of its own."""
        return not any(segment.allocated for segment in self.segments)

    def slot_address(self, slot: int) -> int:
        """Where `slot` starts (its segment's address, which an allocator may have set while preparing it)."""
        segment, within = divmod(slot, self.slots_per_segment)
        return self.segments[segment].address + within * self.slot_bytes

    def segment_view(self, index: int) -> np.ndarray:
        """Segment `index`'s used bytes as a uint8 array that keeps the memory alive while anything views it. Only a
        live segment's address is final: asking for another one is an error."""
        segment = self.segments[index]
        if segment.state is not SegmentState.LIVE:
            raise IndexError(f"arena segment {index} is {segment.state.value}: its slots are not in use")
        array = (ctypes.c_uint8 * segment.used_bytes).from_address(segment.address)
        array._keepalive = self._reservation  # type: ignore[attr-defined]  # freed or unmapped after the last view
        return np.frombuffer(array, dtype=np.uint8)

    def buffer(self) -> ctypes.Array:
        """The whole reserved range as a ctypes byte array that keeps the memory mapped while anything views it (a
        contiguous arena only)."""
        if not self.contiguous:
            raise ValueError("the arena's segments were allocated one by one (aclrtMallocHost): it has no single "
                             "range; use segment_view() or registration_ranges()")
        array = (ctypes.c_uint8 * self.span_bytes).from_address(self.base_address)
        array._keepalive = self._reservation  # type: ignore[attr-defined]  # munmap only after the last view
        return array

    def registration_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) a remote transfer engine registers to reach every slot that is or will be live: the one
        reserved range, or each live allocated segment (later ones are announced to `add_live_listener`)."""
        if self.contiguous:
            return [(self.base_address, self.span_bytes)]
        return [(s.address, s.used_bytes) for s in self.segments if s.state is SegmentState.LIVE]

    def add_live_listener(self, listener: Callable[[int, int], None]) -> None:
        """`listener(address, bytes)` runs for every allocated segment that goes live from now on, before its slots
        can be handed out (contiguous arenas never call it: `registration_ranges` covers them up front)."""
        self._live_listeners.append(listener)

    def _announce(self, segment: Segment) -> None:
        for listener in list(self._live_listeners):
            try:
                listener(segment.address, segment.used_bytes)
            except Exception as exc:  # a listener is an optimisation (zero-copy); the segment serves regardless
                logger.warning("host arena: a listener for segment %d failed: %s", segment.index, exc)

    def close_segment_files(self) -> None:
        """Closes this process's descriptors of the shared segment files (the mappings stay: they hold the files)."""
        fds, self.segment_fds = self.segment_fds, []
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """Stops the background preparation and unregisters every registered segment now (the memory stays mapped,
        and allocated segments allocated, until the last view of it goes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._reservation.unregister_all()
        for segment in self.segments:
            segment.registered = False
