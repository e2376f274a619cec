"""Cost of the chunk envelope (issue 21): seal and verify per chunk for each candidate digest, against the time of
real Mooncake gets of the same chunk on this machine, both ways a get can go:

- memcpy get: the object lives in THIS process's global segment; the transfer engine serves it as a local memcpy
  (what `lmcache-npu store-bench` measures). No digest can cost under 5% of it: a verify pass reads every byte once,
  a memcpy reads and writes each once.
- TCP get: the object lives in ANOTHER process's segment (`mooncake_peer.py`: a child contributes the segment and puts
  the objects; this process contributes none), so the get crosses the transfer engine's TCP transport over loopback,
  as a get from another node's segment does in a deployment (minus the wire).

Each get is zero-copy into a registered arena slot, and the verify it is compared with runs right after it on the
bytes it wrote (the cache state a promotion verifies in). Then 8 chunks are promoted as one batch through
`StoreExecutor` (the real path: one batch get, then the io thread verifies each chunk) from the other process, with
verification timed in place and switched off, to see what share of a promotion's wall time verification is; and the
same 8 gets with verification overlapped by hand (chunk i verified on a second thread while chunk i+1 transfers) show
what overlap could buy on this machine.

    python -m lmcache_npu.tools.bench.studies.envelope_bench  # llama3-8b, deepseek-v3, deepseek-v4-flash, gpt-oss-120b
    python -m lmcache_npu.tools.bench.studies.envelope_bench --repeats 30 --json out.json

The last table compares the two orders a `zero_copy: false` get can check in (issue 31): in the slot after the copy
(what the tier does) or in the peer-writable bounce buffer before it (what it did).

Everything runs inside a loopback-only network namespace (as the Mooncake tests do) with `GLOG_minloglevel=2`; where
no namespace can be made it runs on the host's loopback (the local master binds 127.0.0.1 either way). The target is
verify <= 5% of a get of the same chunk. Times are medians over `--repeats` runs (`--batch-repeats` for the batch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.envelope import Sealer, seal, verify
from lmcache_npu.store.keys import ChunkKey

from .mooncake_peer import MooncakePeer, PeerObject

logger = logging.getLogger(__name__)

PRESETS = ("llama3-8b", "deepseek-v3", "deepseek-v4-flash", "gpt-oss-120b")
DIGESTS = (("xxh3-128", False), ("blake3", True), ("blake2b", True), ("sha256", True))
BATCH_DIGESTS = (("xxh3-128", False), ("blake3", True))  # the presets: no secret, and with one
BATCH = 8
SECRET = b"envelope-bench-secret-0123456789"
NAMESPACE = "ab" * 16
KEY = ChunkKey(NAMESPACE, bytes(range(32)))
INSIDE_FLAG = "--inside-netns"


def object_bytes_of(preset: str) -> int:
    from lmcache_npu.tools.presets import preset_layout

    layout, _ = preset_layout(preset, "ascend", None)
    return int(layout.plan.object_bytes)


def sealer_for(digest: str, keyed: bool) -> Sealer:
    return Sealer(SECRET if keyed else None, digest=digest)


def median_s(work: Callable[[], Any], repeats: int) -> float:
    work()  # warm: page faults and first-call costs out of the numbers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_get_verify(get: Callable[[], None], check: Callable[[], Optional[str]],
                      repeats: int) -> tuple[float, float, float]:
    """Median seconds of a get and of the verify that runs right after it on the bytes it wrote, and the median of
    each pair's verify/get ratio (robust to load that comes and goes on a shared machine: both halves of a pair see
    the same moment); one warm pair first. Raises if a verify fails: a number about bytes that did not arrive intact
    would be meaningless."""
    gets, verifies = [], []
    for run in range(repeats + 1):
        start = time.perf_counter()
        get()
        got = time.perf_counter()
        why = check()
        done = time.perf_counter()
        if why is not None:
            raise RuntimeError(f"a benchmark object did not verify after a get: {why}")
        if run:
            gets.append(got - start)
            verifies.append(done - got)
    ratios = [v / g for g, v in zip(gets, verifies)]
    return statistics.median(gets), statistics.median(verifies), statistics.median(ratios)


def _got_all(results: Sequence[Any], what: str) -> None:
    bad = [r.reason for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[:3]}")


def _key(preset: str, digest: str, index: int) -> ChunkKey:
    return ChunkKey(NAMESPACE, hashlib.sha256(f"{preset}/{digest}/{index}".encode()).digest())


# ---- same process: the memcpy get --------------------------------------------------------------------------------

def memcpy_gets(preset: str, size: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """digest -> (get s, verify-after-get s, median verify/get ratio) with the object in this process's own segment."""
    from lmcache_npu.store.mooncake import MooncakeTier
    from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

    found = {}
    with LocalMooncakeMaster() as master:
        arena = HostArena(2, size, pinned=False)
        # zero-copy (the bench alone in a loopback-only namespace: a trusted network) measures the get itself
        tier = MooncakeTier(master.config(global_segment_bytes=len(DIGESTS) * arena.slot_bytes * 2 + (64 << 20),
                                          timeout_s=120.0, zero_copy=True, trusted_network=True))
        try:
            if not tier.register(arena.base_address, arena.total_bytes):
                raise RuntimeError("the arena could not be registered with the same-process client")
            for index, (digest, keyed) in enumerate(DIGESTS):
                sealer, key = sealer_for(digest, keyed), _key(preset, digest, 0)
                arena.slot_array(0)[:] = np.random.default_rng(index).integers(0, 256, size, dtype=np.uint8)
                seal(arena.sealed_view(0), key, 0, sealer)
                name = key.storage_name(0)
                _got_all(tier.put([name], [arena.sealed_view(0)]), f"same-process put of {name}")
                target = [arena.sealed_view(1)]

                def get() -> None:
                    _got_all(tier.get_into([name], target), "same-process get")

                found[digest] = paired_get_verify(get, lambda: verify(target[0], key, 0, sealer), repeats)
                if not np.array_equal(arena.sealed_array(0), arena.sealed_array(1)):
                    raise RuntimeError("the same-process get returned other bytes than were put")
            if tier.counters["zero_copy_ops"] == 0:
                raise RuntimeError("the same-process gets were not zero-copy")
        finally:
            tier.close()
    return found


# ---- another process: the TCP get, and the executor's batch promotion ---------------------------------------------

def peer_objects(presets: Sequence[str], sizes: dict[str, int]) -> list[PeerObject]:
    """Per preset: one object per digest for the single gets, BATCH per batch digest (object 0 is shared)."""
    objects = []
    for preset in presets:
        for digest, keyed in DIGESTS:
            count = BATCH if (digest, keyed) in BATCH_DIGESTS else 1
            for index in range(count):
                key = _key(preset, digest, index)
                objects.append(PeerObject(NAMESPACE, key.chunk_hash.hex(), sizes[preset], len(objects), digest,
                                          keyed))
    return objects


def _remote_tier(master: Any) -> Any:
    from lmcache_npu.store.mooncake import MooncakeTier

    # no memory of our own: every object lives in the peer's segment, so every get crosses the TCP transport
    return MooncakeTier(master.config(global_segment_bytes=0, timeout_s=120.0, zero_copy=True, trusted_network=True))


def loopback_bytes() -> int:
    """Bytes the loopback interface has received (/proc/net/dev), 0 where it cannot be read."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tcp_gets(master: Any, preset: str, size: int, objects: Sequence[PeerObject],
             repeats: int) -> dict[str, Any]:
    """digest -> (get s, verify-after-get s, median verify/get ratio) with the object in the peer process's segment;
    "loopback" -> the bytes
    loopback carried per byte got (about 1: the gets really crossed TCP)."""
    by_name = {o.name: o for o in objects}
    found: dict[str, Any] = {}
    carried_before, got_bytes = loopback_bytes(), 0
    arena = HostArena(1, size, pinned=False)
    tier = _remote_tier(master)
    try:
        if not tier.register(arena.base_address, arena.total_bytes):
            raise RuntimeError("the arena could not be registered with the segment-less client")
        for digest, keyed in DIGESTS:
            sealer, key = sealer_for(digest, keyed), _key(preset, digest, 0)
            name, target = key.storage_name(0), [arena.sealed_view(0)]

            def get() -> None:
                _got_all(tier.get_into([name], target), "cross-process get")

            found[digest] = paired_get_verify(get, lambda: verify(target[0], key, 0, sealer), repeats)
            if not np.array_equal(arena.sealed_array(0), by_name[name].sealed(SECRET)):
                raise RuntimeError(f"the cross-process get of {name} returned other bytes than the peer put")
        if tier.counters["zero_copy_ops"] == 0:
            raise RuntimeError("the cross-process gets were not zero-copy")
        got_bytes = tier.counters["get_bytes"]
    finally:
        tier.close()
    found["loopback"] = (loopback_bytes() - carried_before) / max(got_bytes, 1)
    return found


class _VerifyClock:
    """Stands in for the executor's `verify`: times the real one (enabled) or accepts without reading (disabled),
    so one executor measures a promotion with and without verification."""

    def __init__(self) -> None:
        from lmcache_npu.store.routes import guard as guard_module

        self.module = guard_module
        self.real = guard_module.verify
        self.enabled = True
        self.spent: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Optional[str]:
        if not self.enabled:
            return None
        start = time.perf_counter()
        why = self.real(*args)
        with self._lock:
            self.spent.append(time.perf_counter() - start)
        return why

    def __enter__(self) -> "_VerifyClock":
        self.module.verify = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.verify = self.real


def executor_batch(master: Any, preset: str, size: int, digest: str, keyed: bool, objects: Sequence[PeerObject],
                   repeats: int) -> dict[str, Any]:
    """BATCH chunks promoted as one batch through StoreExecutor from the peer's segment: wall time with verification
    (and the time verification took inside it) and without."""
    from lmcache_npu.store.commands import Promote, Tier
    from lmcache_npu.store.routes.build import make_executor

    keys = [_key(preset, digest, i) for i in range(BATCH)]
    by_name = {o.name: o for o in objects}
    executor = make_executor(0, HostArena(BATCH, size, pinned=False), remote=_remote_tier(master), io_threads=4,
                             sealer=sealer_for(digest, keyed))
    walls: dict[bool, list[float]] = {True: [], False: []}
    verify_sums: list[float] = []
    next_id = 0
    try:
        with _VerifyClock() as clock:
            for run in range(repeats + 1):
                for enabled in ((True, False) if run % 2 else (False, True)):  # alternate: drift hits both alike
                    clock.enabled, clock.spent = enabled, []
                    commands = [Promote(next_id + i, k, i, Tier.REMOTE) for i, k in enumerate(keys)]
                    next_id += BATCH
                    start = time.perf_counter()
                    executor.submit(commands)
                    done = executor.drain(300)
                    wall = time.perf_counter() - start
                    _got_all(done, f"promotion of {BATCH} {preset} chunks")
                    if enabled and len(clock.spent) != BATCH:
                        raise RuntimeError(f"{len(clock.spent)} verifications for {BATCH} promotions")
                    if run:
                        walls[enabled].append(wall)
                        if enabled:
                            verify_sums.append(sum(clock.spent))
        wrong = [i for i, k in enumerate(keys)
                 if not np.array_equal(executor.arena.sealed_array(i), by_name[k.storage_name(0)].sealed(SECRET))]
        if wrong:
            raise RuntimeError(f"promoted slots {wrong} hold other bytes than the peer put")
    finally:
        executor.close()
    wall_on, wall_off = statistics.median(walls[True]), statistics.median(walls[False])
    verify_sum = statistics.median(verify_sums)
    return {"preset": preset, "object_bytes": size, "digest": digest, "mac": keyed, "chunks": BATCH,
            "wall_ms": round(wall_on * 1e3, 2), "wall_no_verify_ms": round(wall_off * 1e3, 2),
            "verify_in_wall_ms": round(verify_sum * 1e3, 2),
            "verify_share_pct": round(100 * verify_sum / wall_on, 1),
            "wall_difference_pct": round(100 * (wall_on - wall_off) / wall_on, 1),
            "promote_gbps": round(BATCH * size / wall_on / 1e9, 2)}


def overlap_probe(master: Any, preset: str, size: int, digest: str, keyed: bool, repeats: int) -> dict[str, Any]:
    """The same BATCH gets and verifications done by hand, three ways: one batch get then verify each (what the
    executor does); per-chunk gets with chunk i verified on a second thread while chunk i+1 transfers; one batch get
    then the verifications spread over two threads."""
    sealer = sealer_for(digest, keyed)
    keys = [_key(preset, digest, i) for i in range(BATCH)]
    names = [k.storage_name(0) for k in keys]
    arena = HostArena(BATCH, size, pinned=False)
    views = [arena.sealed_view(i) for i in range(BATCH)]
    tier = _remote_tier(master)

    def check_one(i: int) -> None:
        why = verify(views[i], keys[i], 0, sealer)
        if why is not None:
            raise RuntimeError(f"{names[i]} did not verify: {why}")

    def sequential() -> None:
        _got_all(tier.get_into(names, views), "batch get")
        for i in range(BATCH):
            check_one(i)

    def gets_only() -> None:
        _got_all(tier.get_into(names, views), "batch get")

    try:
        if not tier.register(arena.base_address, arena.total_bytes):
            raise RuntimeError("the arena could not be registered with the segment-less client")
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="envelope-bench-verify") as pool:
            def pipelined() -> None:
                pending = []
                for i in range(BATCH):
                    _got_all(tier.get_into([names[i]], [views[i]]), "single get")
                    pending.append(pool.submit(check_one, i))
                for future in pending:
                    future.result()

            def parallel_verify() -> None:
                _got_all(tier.get_into(names, views), "batch get")
                list(pool.map(check_one, range(BATCH)))

            ways = {"gets_only": gets_only, "sequential": sequential, "pipelined": pipelined,
                    "parallel_verify": parallel_verify}
            times: dict[str, list[float]] = {way: [] for way in ways}
            for run in range(repeats + 1):
                order = list(ways) if run % 2 else list(reversed(ways))
                for way in order:
                    start = time.perf_counter()
                    ways[way]()
                    if run:
                        times[way].append(time.perf_counter() - start)
    finally:
        tier.close()
    found: dict[str, Any] = {"preset": preset, "digest": digest, "mac": keyed}
    for way, values in times.items():
        found[f"{way}_ms"] = round(statistics.median(values) * 1e3, 2)
    return found


def digest_alone(preset: str, size: int, repeats: int) -> dict[str, Any]:
    """The payload digests alone on a chunk (the bulk of a verify): xxh3-128, BLAKE3 on one thread as the envelope
    runs it, and BLAKE3 hashing one chunk on every core (its `max_threads`), which the envelope could use."""
    import blake3
    import xxhash

    payload = memoryview(np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8))
    ways = {"xxh3_128": lambda: xxhash.xxh3_128_digest(payload),
            "blake3_1_thread": lambda: blake3.blake3(payload).digest(),
            "blake3_all_cores": lambda: blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest()}
    found: dict[str, Any] = {"preset": preset, "object_bytes": size}
    for way, work in ways.items():
        found[f"{way}_us"] = round(median_s(work, repeats) * 1e6, 1)
    return found


# ---- the whole measurement ----------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        from importlib.metadata import version

        mooncake = version("mooncake-transfer-engine-non-cuda")
    except Exception:  # another Mooncake build, or none: only a label
        mooncake = "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "mooncake": mooncake, "loadavg_1m": round(os.getloadavg()[0], 2)}


def bounce_orders(preset: str, size: int, repeats: int) -> dict[str, Any]:
    """What checking a get in its slot costs against the order issue 31 removed, with `zero_copy` off: (new) copy the
    bounce buffer's bytes into the slot, then verify the slot; (old) verify in the bounce buffer, then copy. Keyed
    blake3; medians of `repeats` interleaved pairs, the difference the median of the pairs' ratios."""
    sealer = sealer_for("blake3", True)
    bounce = np.random.default_rng(3).integers(0, 256, size + 256, dtype=np.uint8)
    seal(bounce, KEY, 0, sealer)
    slot = np.empty_like(bounce)

    def fresh() -> None:
        bounce[:64] ^= 0  # touch: the bytes a get just wrote are in cache as far as a write leaves them

    def new_order() -> None:
        fresh()
        slot[:] = bounce
        if verify(slot, KEY, 0, sealer) is not None:
            raise RuntimeError("the benchmark object did not verify")

    def old_order() -> None:
        fresh()
        if verify(bounce, KEY, 0, sealer) is not None:
            raise RuntimeError("the benchmark object did not verify")
        slot[:] = bounce

    new_times, old_times = [], []
    for run in range(repeats + 1):  # interleaved pairs: load that comes and goes hits both orders alike
        for order, times in ((new_order, new_times), (old_order, old_times)) if run % 2 else (
                (old_order, old_times), (new_order, new_times)):
            start = time.perf_counter()
            order()
            if run:
                times.append(time.perf_counter() - start)
    ratio = statistics.median(n / o for n, o in zip(new_times, old_times))
    return {"preset": preset, "object_bytes": size,
            "copy_then_verify_us": round(statistics.median(new_times) * 1e6, 1),
            "verify_then_copy_us": round(statistics.median(old_times) * 1e6, 1),
            "difference_pct": round(100 * (ratio - 1), 1)}


def measure(presets: Sequence[str], repeats: int, batch_repeats: int) -> dict[str, Any]:
    """Every number of the report (run where a local master can start: inside the loopback namespace)."""
    from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

    info = machine()
    sizes = {preset: object_bytes_of(preset) for preset in presets}
    memcpy = {preset: memcpy_gets(preset, sizes[preset], repeats) for preset in presets}
    objects = peer_objects(presets, sizes)
    tcp: dict[str, dict[str, Any]] = {}
    batches, probes = [], []
    with LocalMooncakeMaster() as master:
        with MooncakePeer(master.master, master.metadata, objects, SECRET) as peer:
            for preset in presets:
                tcp[preset] = tcp_gets(master, preset, sizes[preset], objects, repeats)
                for digest, keyed in BATCH_DIGESTS:
                    batches.append(executor_batch(master, preset, sizes[preset], digest, keyed, objects,
                                                  batch_repeats))
                    probes.append(overlap_probe(master, preset, sizes[preset], digest, keyed, batch_repeats))
            peer_put_s = peer.put_s
    rows = []
    for preset in presets:
        size = sizes[preset]
        chunk = np.random.default_rng(1).integers(0, 256, size + 256, dtype=np.uint8)
        for digest, keyed in DIGESTS:
            sealer = sealer_for(digest, keyed)
            seal_s = median_s(lambda: seal(chunk, KEY, 0, sealer), repeats)
            verify_hot_s = median_s(lambda: verify(chunk, KEY, 0, sealer), repeats)
            memcpy_get_s, verify_memcpy_s, memcpy_ratio = memcpy[preset][digest]
            tcp_get_s, verify_tcp_s, tcp_ratio = tcp[preset][digest]
            rows.append({"preset": preset, "object_bytes": size, "digest": digest, "mac": keyed,
                         "loopback_bytes_per_tcp_get_byte": round(tcp[preset]["loopback"], 3),
                         "seal_us": round(seal_s * 1e6, 1), "verify_hot_us": round(verify_hot_s * 1e6, 1),
                         "verify_after_memcpy_get_us": round(verify_memcpy_s * 1e6, 1),
                         "verify_after_tcp_get_us": round(verify_tcp_s * 1e6, 1),
                         "verify_us_per_gib": round(verify_tcp_s * 1e6 * 2**30 / size, 1),
                         "verify_gbps": round(size / verify_tcp_s / 1e9, 2),
                         "memcpy_get_us": round(memcpy_get_s * 1e6, 1),
                         "verify_pct_of_memcpy_get": round(100 * memcpy_ratio, 1),
                         "verify_pct_of_memcpy_get_medians": round(100 * verify_memcpy_s / memcpy_get_s, 1),
                         "tcp_get_us": round(tcp_get_s * 1e6, 1),
                         "tcp_get_gbps": round(size / tcp_get_s / 1e9, 2),
                         "verify_pct_of_tcp_get": round(100 * tcp_ratio, 1),
                         "verify_pct_of_tcp_get_medians": round(100 * verify_tcp_s / tcp_get_s, 1)})
    digests = [digest_alone(preset, sizes[preset], repeats) for preset in presets]
    orders = [bounce_orders(preset, sizes[preset], repeats) for preset in presets]
    info["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return {"machine": info, "repeats": repeats, "batch_repeats": batch_repeats, "peer_put_s": round(peer_put_s, 2),
            "rows": rows, "batches": batches, "overlap": probes, "digests": digests, "orders": orders}


# ---- output -------------------------------------------------------------------------------------------------------

def _pct(value: float) -> str:
    return f"{value:.1f}" + (" ✓" if value <= 5.0 else "")


def render(report: dict[str, Any]) -> list[Table]:
    rows = Table(title="chunk envelope: verify (right after the get, on its bytes) vs a Mooncake get of the same "
                       "chunk, same-process memcpy and cross-process TCP (medians; % = median of per-pair ratios; ✓ = within 5%)")
    for column in ("preset", "object MiB", "digest", "MAC", "seal µs", "verify µs", "verify µs/GiB", "verify GB/s",
                   "memcpy get µs", "% of memcpy get", "TCP get µs", "TCP GB/s", "% of TCP get"):
        rows.add_column(column, justify="left" if column in ("preset", "digest", "MAC") else "right")
    for r in report["rows"]:
        rows.add_row(r["preset"], f"{r['object_bytes'] / 2**20:.2f}", r["digest"], "yes" if r["mac"] else "no",
                     f"{r['seal_us']:.0f}", f"{r['verify_after_tcp_get_us']:.0f}", f"{r['verify_us_per_gib']:.0f}",
                     f"{r['verify_gbps']:.2f}", f"{r['memcpy_get_us']:.0f}", _pct(r["verify_pct_of_memcpy_get"]),
                     f"{r['tcp_get_us']:.0f}", f"{r['tcp_get_gbps']:.2f}", _pct(r["verify_pct_of_tcp_get"]))
    batches = Table(title=f"{BATCH} chunks promoted as one batch through StoreExecutor from another process's "
                          f"segment (medians)")
    for column in ("preset", "digest", "MAC", "wall ms", "wall ms, no verify", "verify ms in wall",
                   "verify % of wall", "wall difference %", "GB/s"):
        batches.add_column(column, justify="left" if column in ("preset", "digest", "MAC") else "right")
    for b in report["batches"]:
        batches.add_row(b["preset"], b["digest"], "yes" if b["mac"] else "no", f"{b['wall_ms']:.1f}",
                        f"{b['wall_no_verify_ms']:.1f}", f"{b['verify_in_wall_ms']:.1f}",
                        f"{b['verify_share_pct']:.1f}", f"{b['wall_difference_pct']:.1f}", f"{b['promote_gbps']:.2f}")
    overlap = Table(title=f"can verification overlap the transfer? the same {BATCH} gets by hand (medians, ms)")
    for column in ("preset", "digest", "gets only", "batch get, then verify (the executor's way)",
                   "per-chunk get, verify on a 2nd thread", "batch get, verify on 2 threads"):
        overlap.add_column(column, justify="left" if column in ("preset", "digest") else "right")
    for p in report["overlap"]:
        overlap.add_row(p["preset"], p["digest"], f"{p['gets_only_ms']:.1f}", f"{p['sequential_ms']:.1f}",
                        f"{p['pipelined_ms']:.1f}", f"{p['parallel_verify_ms']:.1f}")
    digests = Table(title=f"the payload digest alone on one chunk, hot (medians, µs; {os.cpu_count()} cores here)")
    for column in ("preset", "object MiB", "xxh3-128", "blake3, 1 thread (the envelope's)", "blake3, all cores"):
        digests.add_column(column, justify="left" if column == "preset" else "right")
    for d in report["digests"]:
        digests.add_row(d["preset"], f"{d['object_bytes'] / 2**20:.2f}", f"{d['xxh3_128_us']:.0f}",
                        f"{d['blake3_1_thread_us']:.0f}", f"{d['blake3_all_cores_us']:.0f}")
    orders = Table(title="zero_copy off: a get checked in its slot (copy, then verify) against the old order (verify in "
                         "the bounce buffer, then copy), keyed blake3 (medians, µs)")
    for column in ("preset", "object MiB", "copy, then verify the slot", "verify the bounce buffer, then copy",
                   "difference %"):
        orders.add_column(column, justify="left" if column == "preset" else "right")
    for o in report.get("orders", []):
        orders.add_row(o["preset"], f"{o['object_bytes'] / 2**20:.2f}", f"{o['copy_then_verify_us']:.0f}",
                       f"{o['verify_then_copy_us']:.0f}", f"{o['difference_pct']:+.1f}")
    return [rows, batches, overlap, digests, orders]


def _run_inside_netns(argv: Sequence[str]) -> dict[str, Any]:
    """Runs this script again inside a loopback-only network namespace and returns its report."""
    from lmcache_npu.tools.mooncake_local import run_in_loopback_netns

    env = dict(os.environ, GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", __spec__.name, *argv, INSIDE_FLAG], env=env,
                                 timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement inside the network namespace failed ({done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    parser.add_argument("--repeats", type=int, default=15, help="timed gets and verifies per number (median)")
    parser.add_argument("--batch-repeats", type=int, default=10,
                        help="timed batch promotions per number, each with and without verification (median)")
    parser.add_argument("--json", type=Path,
                        help="write the report (machine, rows, batches, overlap, digests) as JSON")
    parser.add_argument(INSIDE_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    if args.repeats < 1 or args.batch_repeats < 1:
        parser.error("--repeats and --batch-repeats must be at least 1")
    if args.inside_netns:  # the namespace's half: measure, answer one JSON line
        print(json.dumps(measure(presets, args.repeats, args.batch_repeats)))
        return 0
    from lmcache_npu.tools.mooncake_local import netns_available

    ok, why = netns_available()
    forwarded = [f"--presets={','.join(presets)}", f"--repeats={args.repeats}",
                 f"--batch-repeats={args.batch_repeats}"]
    if ok:
        report = _run_inside_netns(forwarded)
        report["machine"]["network"] = "loopback-only network namespace"
    else:
        logger.warning("no loopback-only network namespace (%s): measuring on the host's loopback", why)
        os.environ.setdefault("GLOG_minloglevel", "2")
        report = measure(presets, args.repeats, args.batch_repeats)
        report["machine"]["network"] = "host loopback"
    m = report["machine"]
    console = Console(width=220)
    console.print(f"machine: {m['cpu']}, {m['cores']} cores (shared: other jobs may run; load {m['loadavg_1m']} "
                  f"at start, {m['loadavg_1m_end']} at end), Python {m['python']}, Linux {m['kernel']}, "
                  f"Mooncake {m['mooncake']}, {m['network']}; medians over {report['repeats']} gets / "
                  f"{report['batch_repeats']} batches; loopback carried "
                  f"{min(r['loopback_bytes_per_tcp_get_byte'] for r in report['rows']):.2f}-"
                  f"{max(r['loopback_bytes_per_tcp_get_byte'] for r in report['rows']):.2f} bytes per TCP-get byte")
    for table in render(report):
        console.print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
