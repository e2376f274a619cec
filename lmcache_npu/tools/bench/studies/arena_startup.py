"""Host-arena start-up: time to the first servable slot and to the full arena, pre-fault and registration GB/s, RSS.

Segmented arenas (store/segments.py: mmap segments, background pre-fault and per-segment registration) against the
old single allocation in the same table: `torch.zeros` (pageable), `torch.zeros` + one `cudaHostRegister`, and
`torch.zeros(pin_memory=True)` (the caching host allocator, which rounds up to a power of two) on CUDA. Pre-faulted
segmented rows come once per `--prefault-by` method: `write` (the default: pages of a segment not live yet are
written in parallel threads) and `populate` (the old MADV_POPULATE_WRITE), so both are compared in one run.

    PYTHONPATH=. python3 -m lmcache_npu.tools.bench.studies.arena_startup --sizes 8,32,64 [--prefault auto|on|off|both]
        [--prefault-by write,populate] [--threads N] [--write-methods] [--rounds R] [--json F]

`--write-methods` adds rows that fault a fresh range of each size in every way the pre-fault could (one byte a page,
memset, numpy fill, torch zero_, populate); `--threads` overrides the pre-fault's thread count (half the CPUs).

Pageable where no accelerator is present (or with --pageable): then the plain segmented row is a pageable arena
(every segment live at once, so pre-faulted by MADV_POPULATE_WRITE whatever the method), and "staged" rows register
each segment with a registrar that does nothing, so the segments go live one by one after their pre-fault as with a
device: what measures the pre-fault methods on a host without one. A size whose touched bytes would not fit in
MemAvailable is measured with pre-fault off (mapping only; pages fault on first use) and its single-allocation
rows are left out (torch.zeros touches every page): the table says so. Each row runs in a fresh child process, so
one row's cached or resident memory never flatters the next, and the RSS column is that process's peak.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from typing import Any, Optional

GIB = 1 << 30
SLOT_OBJECT_BYTES = (2 << 20) - 256  # one llama3-8b-sized chunk object (2 MiB slots with the envelope trailer)


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class _NoRegistration:
    """A registrar that registers nothing: segments still go live one by one after their pre-fault ("staged")."""

    name = "no registration"

    def bind_thread(self) -> None:
        """Nothing to select: there is no device."""

    def register(self, address: int, nbytes: int) -> int:
        return address

    def unregister(self, address: int, nbytes: int) -> None:
        """Nothing was registered."""


def _segmented(size: int, mode: str, prefault: bool, prefault_by: str, segment_bytes: int, hugepages: str,
               threads: Optional[int]) -> dict[str, Any]:
    """`mode`: "pinned" (the device's registrar), "staged" (no-op registration) or "pageable"."""
    import torch  # noqa: F401  (CUDA context set up before the clock starts, as an engine has it)

    from lmcache_npu.platform.host_memory import SegmentPinning
    from lmcache_npu.store.arena import device_pinning, slot_bytes_for, slots_for_capacity
    from lmcache_npu.store.segments import SegmentedMemory

    pinning: Any = None
    device_node = None
    if mode == "pinned":
        torch.cuda.init()
        pinning, device_node = device_pinning()
    elif mode == "staged":
        pinning = SegmentPinning([_NoRegistration()])
    began = time.perf_counter()
    # what HostArena does, with the pre-fault method (which HostArena leaves at its default) chosen
    memory = SegmentedMemory(slots_for_capacity(size, SLOT_OBJECT_BYTES), slot_bytes_for(SLOT_OBJECT_BYTES),
                             segment_bytes=segment_bytes, hugepages=hugepages, pinning=pinning,
                             preferred_node=device_node, prefault=prefault, prefault_by=prefault_by)
    if threads:
        memory._prefault_threads = threads  # the benchmark's override of the half-the-CPUs policy
    memory.start()
    if not memory.wait_first():
        raise MemoryError(f"no segment went live: {sorted({s.error for s in memory.segments})}")
    first = time.perf_counter() - began
    memory.wait_all()
    full = time.perf_counter() - began
    segments = memory.segments
    prefault_s = sum(s.prefault_s for s in segments)
    register_s = sum(s.register_s for s in segments) if mode == "pinned" else 0.0
    used = sum(s.used_bytes for s in segments)
    row = {"first_s": first, "full_s": full, "segments": f"{memory.segments_live}/{len(segments)}",
           "prefault_gbps": used / prefault_s / 1e9 if prefault_s else None,
           "register_gbps": used / register_s / 1e9 if register_s else None,
           "prefaulted_by": sorted({s.prefaulted_by for s in segments if s.prefaulted_by}),
           "rss_gib": _peak_rss() / GIB, "thp": memory.transparent}
    memory.close()
    return row


def _single(size: int, how: str) -> dict[str, Any]:
    import torch

    if how != "torch.zeros":
        torch.cuda.init()
    began = time.perf_counter()
    register_s = None
    if how == "torch.zeros pin_memory":
        buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
    else:
        buffer = torch.zeros(size, dtype=torch.uint8)
        if how == "torch.zeros + cudaHostRegister":
            start = time.perf_counter()
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0x01 | 0x02))
            register_s = time.perf_counter() - start
            if error:
                raise MemoryError(f"cudaHostRegister of {size / GIB:.0f} GiB failed (CUDA error {error})")
    full = time.perf_counter() - began
    row = {"first_s": full, "full_s": full, "segments": "1 allocation",
           "prefault_gbps": size / (full - (register_s or 0)) / 1e9,
           "register_gbps": size / register_s / 1e9 if register_s else None, "rss_gib": _peak_rss() / GIB,
           "thp": None}
    if register_s is not None:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    return row


WRITE_METHODS = ("byte per page", "memset", "numpy fill", "torch zero_", "populate")


def _write_method(size: int, method: str, hugepages: str, threads: Optional[int]) -> dict[str, Any]:
    """Faults a fresh anonymous range of `size` in one way, in the pre-fault's threads and pieces (torch zero_: one
    call on torch's own OpenMP pool): which way of faulting pages is fastest on this host."""
    import ctypes
    import mmap

    import numpy as np
    import torch

    from lmcache_npu.platform import vm

    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages in ("auto", "off"):
        region.madvise(mmap.MADV_HUGEPAGE if hugepages == "auto" and vm.transparent_hugepages_enabled()
                       else mmap.MADV_NOHUGEPAGE)
    view = (ctypes.c_uint8 * size).from_buffer(region)
    address = ctypes.addressof(view)
    threads = threads or vm.prefault_threads()
    piece = -(size // threads) % vm.THP_BYTES + size // threads

    def in_pieces(fill: Any) -> None:
        workers = [threading.Thread(target=fill, args=(begin, min(piece, size - begin)))
                   for begin in range(0, size, piece)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    began = time.perf_counter()
    if method in ("byte per page", "populate"):
        vm.prefault(address, size, threads=threads, write=method == "byte per page")
    elif method == "memset":
        in_pieces(lambda begin, n: ctypes.memset(address + begin, 0, n))  # ctypes releases the GIL
    elif method == "numpy fill":
        array = np.frombuffer(view, dtype=np.uint8)
        in_pieces(lambda begin, n: array[begin:begin + n].fill(0))
    else:
        torch.frombuffer(view, dtype=torch.uint8).zero_()
    elapsed = time.perf_counter() - began
    name = f"torch {torch.get_num_threads()} OpenMP threads" if method == "torch zero_" else f"{threads} threads"
    # the range is left mapped: views of it are still exported, and the child process ends right after this row
    return {"first_s": elapsed, "full_s": elapsed, "segments": name, "prefault_gbps": size / elapsed / 1e9,
            "register_gbps": None, "rss_gib": _peak_rss() / GIB, "thp": None}


def _child(queue: Any, kind: str, args: tuple) -> None:
    try:
        runs = {"segmented": _segmented, "single": _single, "write method": _write_method}
        queue.put(runs[kind](*args))
    except BaseException as exc:  # the parent prints the failure in the row
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _run(kind: str, args: tuple) -> dict[str, Any]:
    context = mp.get_context("spawn")  # a fresh process: no memory kept from the row before
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, kind, args))
    child.start()
    child.join()
    return queue.get() if not queue.empty() else {"error": f"the child exited with {child.exitcode} (killed?)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,32,64", help="arena sizes in GiB, comma-separated")
    parser.add_argument("--prefault", choices=("auto", "on", "off", "both"), default="auto",
                        help="auto: on where the arena fits in the available memory, off otherwise; both: a row each")
    parser.add_argument("--available-gib", type=float, default=None,
                        help="host memory the arenas may use (default: MemAvailable; VMs that grow memory on use "
                             "under-report it)")
    parser.add_argument("--prefault-by", default="write,populate",
                        help="pre-fault methods of the segmented rows, comma-separated: write (the default in the "
                             "code), populate (the old MADV_POPULATE_WRITE)")
    parser.add_argument("--write-methods", action="store_true",
                        help="also fault a fresh range of each size every way (" + ", ".join(WRITE_METHODS) + ") in "
                             "the pre-fault's threads: which is fastest on this host")
    parser.add_argument("--threads", type=int, default=None,
                        help="pre-fault threads (default: the code's own count, half the CPUs, at most 8)")
    parser.add_argument("--segment-bytes", type=int, default=2 * GIB)
    parser.add_argument("--hugepages", default="auto")
    parser.add_argument("--pageable", action="store_true", help="no registration even with a GPU present")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times (a VM that backs memory on first touch charges the first "
                             "row of a size for it: compare the later rounds)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    from lmcache_npu.store.segments import PREFAULT_BY

    methods = [m for m in args.prefault_by.split(",") if m]
    if not methods or not set(methods) <= set(PREFAULT_BY):
        parser.error(f"--prefault-by takes {', '.join(PREFAULT_BY)} (comma-separated), got {args.prefault_by!r}")
    import torch

    pinned = torch.cuda.is_available() and not args.pageable
    rows: list[dict[str, Any]] = []
    for round_number, size_gib in ((r, float(s)) for r in range(1, args.rounds + 1) for s in args.sizes.split(",")):
        size = int(size_gib * GIB)
        available = args.available_gib * GIB if args.available_gib else _mem_available()
        fits = size < 0.8 * available
        prefaults = {"on": [True], "off": [False], "auto": [fits], "both": [True, False] if fits else [False]}
        note = "" if fits else f"does not fit in {available / GIB:.0f} GiB available"
        modes = ["pinned"] if pinned else ["pageable", "staged"]
        plans: list[tuple[str, str, tuple]] = []
        for mode in modes:
            label = {"pinned": "segments + cudaHostRegister", "pageable": "segments pageable",
                     "staged": "segments staged (no registration)"}[mode]
            for prefault in prefaults[args.prefault]:
                # a pageable arena's segments are live at once: populated whatever the method, so one row
                for method in (methods if prefault and mode != "pageable" else methods[:1]):
                    name = f"{label}, prefault {f'by {method}' if prefault else 'off'}"
                    if mode == "pageable" and prefault:
                        name = f"{label}, prefault on"
                    plans.append(("segmented", name, (size, mode, prefault, method, args.segment_bytes,
                                                      args.hugepages, args.threads)))
        if fits:
            singles = ["torch.zeros + cudaHostRegister", "torch.zeros pin_memory"] if pinned else ["torch.zeros"]
            plans += [("single", how, (size, how)) for how in singles]
        if fits and args.write_methods:
            plans += [("write method", f"fresh range, {method}", (size, method, args.hugepages, args.threads))
                      for method in WRITE_METHODS]
        for kind, name, call in plans:
            result = _run(kind, call)
            rows.append({"round": round_number, "size_gib": size_gib, "arena": name, "note": note, **result})
            _write_json(args.json, pinned, rows)  # after every row: a run cut short keeps what it measured
    header = (f"{'rnd':>3} {'GiB':>5} {'arena':56} {'first slot s':>12} {'full s':>8} {'prefault GB/s':>13} "
              f"{'register GB/s':>13} {'peak RSS GiB':>12} {'segments':>12}  note")
    print(header)
    print("-" * len(header))

    def cell(value: Optional[float], width: int, digits: int = 2) -> str:
        return f"{value:>{width}.{digits}f}" if isinstance(value, float) else f"{'-':>{width}}"

    for row in rows:
        if "error" in row:
            print(f"{row['round']:>3} {row['size_gib']:>5.0f} {row['arena']:56} {row['error']}")
            continue
        print(f"{row['round']:>3} {row['size_gib']:>5.0f} {row['arena']:56} {cell(row['first_s'], 12, 3)} "
              f"{cell(row['full_s'], 8)} "
              f"{cell(row['prefault_gbps'], 13)} {cell(row['register_gbps'], 13)} {cell(row['rss_gib'], 12)} "
              f"{row['segments']:>12}  {row['note']}")


def _write_json(path: Optional[str], pinned: bool, rows: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"host": os.uname().nodename, "pinned": pinned, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
