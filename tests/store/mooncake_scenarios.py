"""Mooncake scenarios that run INSIDE a loopback-only network namespace (test_mooncake.py starts them there):
`python -m tests.store.mooncake_scenarios <scenario>`. Each starts its own mooncake_master on 127.0.0.1, prints
one JSON line of findings last, and exits non-zero on any failed check."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.mooncake import MooncakeConfig, MooncakeTier
from lmcache_npu.store.mooncake_local import LocalMooncakeMaster

CHUNK = 64 << 10


def _data(index: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, size, dtype=np.uint8)


def _names(prefix: str, count: int) -> list[str]:
    return [f"{'7' * 32}-{prefix}{i:06d}-r0" for i in range(count)]


def roundtrip() -> dict:
    count = 500
    with LocalMooncakeMaster() as master:
        tier = MooncakeTier(master.config(global_segment_bytes=count * CHUNK + (64 << 20)))
        arena = HostArena(count, CHUNK, pinned=False)
        assert tier.register(arena.base_address, arena.total_bytes), "arena registration failed"
        for slot in range(count):
            arena.slot_array(slot)[:] = _data(slot)
        names = _names("rt", count)
        start = time.perf_counter()
        results = tier.put(names, [arena.slot_view(s) for s in range(count)])
        put_s = time.perf_counter() - start
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert tier.exists(names[:10] + _names("absent", 5)) == [True] * 10 + [False] * 5
        for slot in range(count):
            arena.slot_array(slot)[:] = 0
        start = time.perf_counter()
        results = tier.get_into(names, [arena.slot_view(s) for s in range(count)])
        get_s = time.perf_counter() - start
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        wrong = [s for s in range(count) if not np.array_equal(arena.slot_array(s), _data(s))]
        assert not wrong, f"{len(wrong)} chunks differ"
        assert tier.counters["zero_copy_ops"] == 2 * count and tier.counters["copy_ops"] == 0
        # buffers outside the registered arena go through the copy path
        loose = [_data(10_000 + i) for i in range(20)]
        loose_names = _names("cp", 20)
        assert all(r.ok for r in tier.put(loose_names, [memoryview(b) for b in loose]))
        back = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(20)]
        assert all(r.ok for r in tier.get_into(loose_names, [memoryview(b) for b in back]))
        assert all(np.array_equal(a, b) for a, b in zip(loose, back))
        assert tier.counters["copy_ops"] == 40
        # a missing key is a miss; a buffer of the wrong size is a length error, never a partial read
        assert tier.get_into(_names("absent", 1), [arena.slot_view(0)])[0].reason == "miss"
        short = np.zeros(CHUNK // 2, dtype=np.uint8)
        assert tier.get_into(names[:1], [memoryview(short)])[0].reason == "corrupt: length"
        # a put of a name that exists is fine (same name, same bytes); delete makes names absent
        assert tier.put(names[:1], [arena.slot_view(0)])[0].ok
        fresh = _names("del", 3)
        tier.put(fresh, [arena.slot_view(s) for s in range(3)])
        tier.delete(fresh)
        assert tier.exists(fresh) == [False] * 3
        healthy = tier.healthy()
        tier.close()
    return {"chunks": count, "chunk_bytes": CHUNK, "put_gbps": round(count * CHUNK / put_s / 1e9, 3),
            "get_gbps": round(count * CHUNK / get_s / 1e9, 3), "healthy": healthy}


def reader(master: str, metadata: str, count: int) -> dict:
    """A second instance: its scheduler-side client (no memory contributed) sees the chunks, its worker reads them."""
    config = MooncakeConfig(master=master, metadata=metadata, local_hostname="127.0.0.1",
                            global_segment_bytes=0, local_buffer_bytes=16 << 20)
    scheduler = MooncakeTier(config)
    names = _names("sh", count)
    assert scheduler.exists(names) == [True] * count, "the second instance does not see the chunks"
    worker = MooncakeTier(config)
    arena = HostArena(count, CHUNK, pinned=False)
    worker.register(arena.base_address, arena.total_bytes)
    results = worker.get_into(names, [arena.slot_view(s) for s in range(count)])
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    wrong = [s for s in range(count) if not np.array_equal(arena.slot_array(s), _data(50_000 + s))]
    assert not wrong, f"{len(wrong)} chunks differ in the second instance"
    scheduler.close()
    worker.close()
    return {"read": count}


def share() -> dict:
    count = 100
    with LocalMooncakeMaster() as master:
        writer = MooncakeTier(master.config(global_segment_bytes=count * CHUNK + (64 << 20)))
        arena = HostArena(count, CHUNK, pinned=False)
        writer.register(arena.base_address, arena.total_bytes)
        for slot in range(count):
            arena.slot_array(slot)[:] = _data(50_000 + slot)
        assert all(r.ok for r in writer.put(_names("sh", count), [arena.slot_view(s) for s in range(count)]))
        child = subprocess.run([sys.executable, "-m", "tests.store.mooncake_scenarios", "reader", master.master,
                                master.metadata, str(count)], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stdout[-1500:] + child.stderr[-1500:]
        writer.close()
    return {"shared": count, "reader": json.loads(child.stdout.strip().splitlines()[-1])}


def master_killed() -> dict:
    """Kill the master mid-run: every call fails within about the timeout, as misses and counters."""
    with LocalMooncakeMaster() as master:
        tier = MooncakeTier(master.config(timeout_s=2.0, retry_after_s=30.0))
        arena = HostArena(40, CHUNK, pinned=False)
        tier.register(arena.base_address, arena.total_bytes)
        names = _names("mk", 40)
        assert all(r.ok for r in tier.put(names[:20], [arena.slot_view(s) for s in range(20)]))
        master.kill()
        timings = {}
        start = time.perf_counter()
        puts = tier.put(names[20:], [arena.slot_view(s) for s in range(20, 40)])
        timings["put_s"] = time.perf_counter() - start
        assert not any(r.ok for r in puts)
        start = time.perf_counter()
        gets = tier.get_into(names[:20], [arena.slot_view(s) for s in range(20)])
        timings["get_s"] = time.perf_counter() - start
        assert not any(r.ok for r in gets)
        start = time.perf_counter()
        present = tier.exists(names)
        timings["exists_s"] = time.perf_counter() - start
        assert present == [False] * 40
        assert not tier.healthy()
        assert max(timings.values()) < 2.0 + 1.5, timings
        counters = tier.counters.snapshot()
        assert counters.get("unhealthy_skips", 0) >= 1 and counters.get("unavailable", 0) >= 1, counters
        tier.delete(names)  # no exception either
        tier.close()
    return {"timings": {k: round(v, 2) for k, v in timings.items()}, "counters": counters}


SCENARIOS = {"roundtrip": roundtrip, "share": share, "master_killed": master_killed}


def main(argv: list[str]) -> int:
    if argv[0] == "reader":
        print(json.dumps(reader(argv[1], argv[2], int(argv[3]))))
        return 0
    print(json.dumps(SCENARIOS[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
