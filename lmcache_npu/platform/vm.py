"""Anonymous memory from the host kernel: what it offers (its base page and transparent hugepage sizes, which differ
between kernels: 4 KiB and 2 MiB on x86_64, 64 KiB and 512 MiB on a 64 KiB-page aarch64 kernel; transparent and
explicit hugepages read from sysfs, the `hugepages` key's values) and the libc calls the arena's segments
(`store/segments.py`) are made of: a reserved address range that frees what was registered or allocated for it once
nothing views it, fixed mappings inside it, NUMA binding, and pre-faulting from a few threads."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .host_memory import HostAllocator, HostRegistrar

logger = logging.getLogger(__name__)

ACL_REGISTER_ALIGN_BYTES = 4096  # aclrtHostRegister wants 4 KiB-aligned addresses: ACL's rule, not the host's page
# arena slots are 4 KiB multiples on every host (what DMA and O_DIRECT readers need): slot sizes and numbers never
# depend on the kernel's page size, which decides only where segments start
SLOT_ALIGN_BYTES = 4096
THP_PMD_SIZE_PATH = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
THP_FALLBACK_BYTES = 2 << 20  # the PMD size of x86_64 and 4 KiB-page aarch64, for a kernel that does not say
HUGEPAGE_CHOICES = {"auto": 0, "off": 0, "2M": 2 << 20, "1G": 1 << 30}


def base_page_bytes() -> int:
    """The host kernel's base page: 4 KiB on x86_64; 4, 16 or 64 KiB on aarch64 as the kernel was built (Kunpeng
    hosts of Atlas A2/A3 may run 64 KiB kernels). mmap(MAP_FIXED) refuses an address that is not a multiple of it."""
    return mmap.PAGESIZE


def thp_pmd_bytes(path: str = THP_PMD_SIZE_PATH) -> int:
    """The transparent hugepage (PMD) size from sysfs: 2 MiB on x86_64 and 4 KiB-page aarch64, 512 MiB on 64 KiB-page
    aarch64; 2 MiB where the kernel does not say (no THP support, or an unreadable sysfs)."""
    try:
        with open(path, encoding="ascii") as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return THP_FALLBACK_BYTES
    return value if value > 0 and value & (value - 1) == 0 else THP_FALLBACK_BYTES


@dataclass(frozen=True)
class PageSizes:
    """The page sizes that decide where arena segments start and how far they are rounded: the base page (every
    fixed mapping starts on one) and the transparent hugepage size. `host()` reads this host's; a test may pass others
    (a 64 KiB base page maps for real on a 4 KiB-page host too: its multiples are 4 KiB multiples)."""

    base_bytes: int
    thp_bytes: int

    def __post_init__(self) -> None:
        for name, value in (("base_bytes", self.base_bytes), ("thp_bytes", self.thp_bytes)):
            if value < ACL_REGISTER_ALIGN_BYTES or value & (value - 1):
                raise ValueError(f"page sizes are powers of two of at least 4 KiB, got {name}={value}")
        if self.thp_bytes < self.base_bytes:
            raise ValueError(f"the THP size {self.thp_bytes} B is below the base page {self.base_bytes} B")

    @classmethod
    def host(cls) -> PageSizes:
        return cls(base_page_bytes(), thp_pmd_bytes())


PAGE_BYTES = base_page_bytes()  # this host's base page (not 4 KiB everywhere: see base_page_bytes)
THP_BYTES = thp_pmd_bytes()  # this host's THP size: segments start on it so THP can back them whole


def parse_hugepages(value: object) -> str:
    """The `hugepages` key: auto (transparent hugepages where the kernel offers them), off, 2M or 1G (MAP_HUGETLB)."""
    if not isinstance(value, str) or value not in HUGEPAGE_CHOICES:
        raise ValueError(f"hugepages must be one of {', '.join(HUGEPAGE_CHOICES)}, got {value!r}")
    return value


def _thp_setting(name: str) -> str:
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def transparent_hugepages_enabled() -> bool:
    """The kernel backs madvise(MADV_HUGEPAGE) ranges with transparent hugepages without stalling a fault on
    compaction: enabled 'always' or 'madvise', defrag 'defer' or 'never'. Where a madvised fault compacts
    synchronously (defrag 'always', 'madvise', 'defer+madvise'), pre-faulting a fragmented host ran 10x slower
    (0.13 vs 1.2 GB/s, docs/storage.md), so `hugepages: auto` leaves such kernels to their default."""
    return _thp_setting("enabled") in ("always", "madvise") and _thp_setting("defrag") in ("defer", "never")


def free_hugepages(page_bytes: int) -> Optional[int]:
    """Free explicit hugepages of `page_bytes` in the system pool (None where the kernel does not say)."""
    path = f"/sys/kernel/mm/hugepages/hugepages-{page_bytes // 1024}kB/free_hugepages"
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


# ---- the libc calls the arena's segments are made of -----------------------------------------------------------------

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED = 0x01, 0x02, 0x20, 0x10
_MAP_NORESERVE, _MAP_HUGETLB = 0x4000, 0x40000
_MAP_HUGE_SHIFT = 26
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
_MADV_POPULATE_WRITE = 23
_MPOL_PREFERRED, _MPOL_BIND = 1, 2
_MBIND_SYSCALL = {"x86_64": 237, "aarch64": 235}
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mmap(address: Optional[int], nbytes: int, prot: int, flags: int, fd: int = -1) -> int:
    result = _libc.mmap(address, nbytes, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def map_fixed(address: int, nbytes: int, hugetlb_bytes: int = 0) -> None:
    """Maps `nbytes` of anonymous private read-write memory at `address` (inside a reservation, on a base page), of
    explicit hugepages of `hugetlb_bytes` unless it is 0; nothing is touched. An OSError names the kernel's reason."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED
    if hugetlb_bytes:
        flags |= _MAP_HUGETLB | (hugetlb_bytes.bit_length() - 1) << _MAP_HUGE_SHIFT
    _mmap(address, nbytes, PROT_RW, flags)


def create_shared(name: str, nbytes: int, hugetlb_bytes: int = 0) -> int:
    """A memory file of `nbytes` (memfd: in no filesystem, so only a process handed its descriptor can map it), of
    explicit hugepages of `hugetlb_bytes` unless it is 0; returns the descriptor (close-on-exec)."""
    flags = os.MFD_CLOEXEC
    if hugetlb_bytes:
        flags |= os.MFD_HUGETLB | (hugetlb_bytes.bit_length() - 1) << _MAP_HUGE_SHIFT
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def map_fixed_shared(address: int, nbytes: int, fd: int) -> None:
    """Maps the memory file `fd` (its first `nbytes`) read-write and shared at `address` (inside a reservation):
    every process that maps it sees the same pages. Refused unless the file holds exactly `nbytes`."""
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise OSError(errno.EINVAL, f"the shared segment holds {size} B, the arena expects {nbytes} B")
    _mmap(address, nbytes, PROT_RW, _MAP_SHARED | _MAP_FIXED, fd)


def unmap_to_reservation(address: int, nbytes: int) -> None:
    """Turns a mapped range back into reserved address space (PROT_NONE, nothing committed): its pages go back to
    the kernel while the range stays ours."""
    _mmap(address, nbytes, PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE)


def advise(address: int, nbytes: int, advice: int) -> None:
    """madvise(MADV_HUGEPAGE or MADV_NOHUGEPAGE); a hint only: a kernel that refuses it still maps the range."""
    _libc.madvise(ctypes.c_void_p(address), nbytes, advice)


def bind_to_node(address: int, nbytes: int, node: int, strict: bool) -> None:
    """mbind the range to `node` (strict: MPOL_BIND; else MPOL_PREFERRED, which falls back when the node is full);
    the policy sits on the mapping, so whichever thread faults a page places it there."""
    syscall = _MBIND_SYSCALL.get(platform.machine())
    if syscall is None:
        raise ValueError(f"numa_node is not supported on {platform.machine()}")
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    mode = _MPOL_BIND if strict else _MPOL_PREFERRED
    _check(_libc.syscall(syscall, ctypes.c_void_p(address), ctypes.c_ulong(nbytes), mode, mask,
                         ctypes.c_ulong(len(mask) * 64 + 1), 0), f"mbind to NUMA node {node}")


# ---- pre-faulting ----------------------------------------------------------------------------------------------------

def prefault_threads(cpus: Optional[frozenset[int]] = None) -> int:
    """Threads that fault one segment's pages in together: page faults scale with cores (the H100 host: torch.zeros'
    16 threads about 18-20 GB/s), but half the CPUs we may use (`cpus`, default this process's) stay free for the
    engine starting beside us."""
    count = len(cpus) if cpus else len(os.sched_getaffinity(0))
    return max(1, min(8, count // 2))


def prefault(address: int, nbytes: int, *, threads: int = 1, write: bool = False, piece_align: int = THP_BYTES,
             cpus: Optional[frozenset[int]] = None) -> None:
    """Faults every page of the range in now (zero-filled, placed by the mapping's NUMA policy), the range cut in
    `threads` pieces of whole `piece_align` pages faulted in parallel, each by a thread of its own bound to `cpus`
    (the node's CPUs, so the pages are first touched from their node) when given.

    `write`: nothing uses the range yet, so each page is faulted by writing a zero into it (user-mode faults, which
    scale with threads where MADV_POPULATE_WRITE did not: 2.5-3 GB/s in 8 threads on the H100 host); otherwise
    MADV_POPULATE_WRITE, which never changes a byte. The pieces run on fresh threads even when there is one, so the
    CPU binding never sticks to the caller."""
    piece = nbytes if threads <= 1 or nbytes < threads * piece_align else \
        -(nbytes // threads) % piece_align + nbytes // threads
    errors: list[BaseException] = []

    def run(begin: int) -> None:
        try:
            if cpus:
                _bind_thread(cpus)
            length = min(piece, nbytes - begin)
            if write:
                write_range(address + begin, length)
            else:
                populate_range(address + begin, length)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(begin,), name="lmcache-arena-prefault", daemon=True)
               for begin in range(0, nbytes, piece)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def _bind_thread(cpus: frozenset[int]) -> None:
    """Runs the calling thread on `cpus` only (pid 0: this thread, not the process)."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # placement still follows the mapping's policy: only the faults' locality is lost
        logger.debug("host arena: could not bind a pre-fault thread to CPUs %s: %s", sorted(cpus), exc)


def write_range(address: int, nbytes: int) -> None:
    """Writes a zero into every page (one byte each: the kernel zero-fills the page it faults in, so the rest needs
    no second pass, and a transparent hugepage faults in whole on its first byte); numpy releases the GIL."""
    pages = (ctypes.c_uint8 * nbytes).from_address(address)
    np.frombuffer(pages, dtype=np.uint8)[::PAGE_BYTES] = 0


def populate_range(address: int, nbytes: int) -> None:
    """MADV_POPULATE_WRITE in one call (5.14+); a kernel without it is an OSError (EINVAL)."""
    if _libc.madvise(ctypes.c_void_p(address), nbytes, _MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # the kernel has the call and refused (no memory): touching would only get us killed
        raise OSError(err, f"MADV_POPULATE_WRITE: {os.strerror(err)}")
    raise OSError(errno.EINVAL, "this kernel has no MADV_POPULATE_WRITE (5.14+)")


# ---- the reservation -------------------------------------------------------------------------------------------------

class Reservation:
    """A reserved address range (PROT_NONE, `align`-aligned), and every piece of memory registered or allocated for
    it: when nothing views it any more, the registrations are undone, allocated pieces freed and the range unmapped."""

    def __init__(self, nbytes: int, align: int) -> None:
        self.raw_bytes = nbytes + align
        self.raw_address = _mmap(None, self.raw_bytes, PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        self.address = -self.raw_address % align + self.raw_address
        self._registered: dict[int, tuple[HostRegistrar, int]] = {}  # address -> (who registered it, bytes)
        self._allocated: dict[int, HostAllocator] = {}  # address -> who allocated it
        self._lock = threading.Lock()
        weakref.finalize(self, _release, self.raw_address, self.raw_bytes, self._registered, self._allocated,
                         self._lock)

    def add_registered(self, address: int, nbytes: int, registrar: HostRegistrar) -> None:
        """`registrar` registered [address, address + nbytes): it is unregistered before the range goes."""
        with self._lock:
            self._registered[address] = (registrar, nbytes)

    def add_allocated(self, address: int, allocator: HostAllocator) -> None:
        """`allocator` allocated memory at `address` in place of a piece of this range: it is freed with the range."""
        with self._lock:
            self._allocated[address] = allocator

    def unregister_all(self) -> None:
        _unregister(self._registered, self._lock)


def _unregister(registered: dict[int, tuple[HostRegistrar, int]], lock: threading.Lock) -> None:
    with lock:
        items = list(registered.items())
        registered.clear()
    for address, (registrar, nbytes) in items:
        try:
            registrar.unregister(address, nbytes)
        except Exception as exc:  # a failed unregister must not keep the memory (or the interpreter exit) hostage
            logger.warning("host arena: %s unregister of the segment at 0x%x failed: %s", registrar.name, address, exc)


def _release(raw_address: int, raw_bytes: int, registered: dict[int, tuple[HostRegistrar, int]],
             allocated: dict[int, HostAllocator], lock: threading.Lock) -> None:
    _unregister(registered, lock)  # the device must forget the pages before they go back to the kernel
    with lock:
        items = list(allocated.items())
        allocated.clear()
    for address, allocator in items:
        try:
            allocator.free(address)
        except Exception as exc:  # at interpreter exit the device runtime may be gone already
            logger.debug("host arena: %s free of the segment at 0x%x failed: %s", allocator.name, address, exc)
    _libc.munmap(ctypes.c_void_p(raw_address), raw_bytes)
