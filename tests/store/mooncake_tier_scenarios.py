"""Mooncake scenarios that run INSIDE a loopback-only network namespace (test_mooncake.py starts them there):
`python -m tests.store.mooncake_tier_scenarios <scenario>`. Each starts its own mooncake_master on 127.0.0.1, prints
one JSON line of findings last, and exits non-zero on any failed check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from lmcache_npu.store.routes import guard as executor_module
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Promote, Put, Tier
from lmcache_npu.store.envelope import verify
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.routes.build import make_executor
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.mooncake import MooncakeConfig, MooncakeTier
from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster, listening_addresses

CHUNK = 64 << 10


def _data(index: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, size, dtype=np.uint8)


def _names(prefix: str, count: int) -> list[str]:
    return [f"{'7' * 32}-{prefix}{i:06d}-r0" for i in range(count)]


def roundtrip() -> dict:
    count = 500
    with LocalMooncakeMaster() as master:
        tier = MooncakeTier(master.config(global_segment_bytes=count * CHUNK + (64 << 20), zero_copy=True,
                                          trusted_network=True))
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
                            global_segment_bytes=0, local_buffer_bytes=16 << 20, zero_copy=True, trusted_network=True)
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
        writer = MooncakeTier(master.config(global_segment_bytes=count * CHUNK + (64 << 20), zero_copy=True,
                                            trusted_network=True))
        arena = HostArena(count, CHUNK, pinned=False)
        writer.register(arena.base_address, arena.total_bytes)
        for slot in range(count):
            arena.slot_array(slot)[:] = _data(50_000 + slot)
        assert all(r.ok for r in writer.put(_names("sh", count), [arena.slot_view(s) for s in range(count)]))
        child = subprocess.run([sys.executable, "-m", "tests.store.mooncake_tier_scenarios", "reader", master.master,
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


def _interfaces() -> list[str]:
    """This process's network namespace's interfaces (/proc/self/net/dev lists those of the reader's namespace)."""
    with open("/proc/self/net/dev") as table:
        return sorted(line.split(":", 1)[0].strip() for line in table.read().splitlines()[2:] if ":" in line)


def loopback() -> dict:
    """Every TCP socket the master, its metadata server and the client (this process) listen on. The master's are
    returned for the test (loopback only); the client's are checked here: its transfer-engine ports listen on all
    interfaces whatever MC_TCP_BIND_ADDRESS and local_hostname say (docs/deployment.md §6), which is why this runs
    in a namespace whose only interface is lo."""
    assert _interfaces() == ["lo"], f"not a loopback-only network namespace: {_interfaces()}"
    assert listening_addresses(os.getpid()) == [], "this process listened before the client joined"
    with LocalMooncakeMaster() as master:
        config = master.config()
        assert config.local_hostname == "127.0.0.1" and os.environ.get("MC_TCP_BIND_ADDRESS") == "127.0.0.1"
        tier = MooncakeTier(config)  # a client joined: the master has whatever sockets serving needs
        time.sleep(0.5)
        listening = {str(pid): listening_addresses(pid) for pid in master.pids()}
        client = listening_addresses(os.getpid())
        tier.close()
    # a check that sees no client socket proves nothing; one that sees only loopback means Mooncake now honours the
    # bind address, and the docs (deployment §6, storage §5) should say so instead of asking for a firewall
    assert client, "the client listens on no TCP port"
    assert [a for a in client if a[0] not in ("0.0.0.0", "::", "127.0.0.1", "::1")] == [], client
    assert [a for a in client if a[0] in ("0.0.0.0", "::")], f"the client now binds loopback only: {client}"
    return {"listening": listening, "client_listening": {str(os.getpid()): client}, "interfaces": _interfaces()}


KEY_COUNT = 4


def _keys() -> list[ChunkKey]:
    return [ChunkKey("e" * 32, bytes([i]) * 32) for i in range(KEY_COUNT)]


def _executor(master: LocalMooncakeMaster, **overrides) -> StoreExecutor:
    return make_executor(0, HostArena(KEY_COUNT, CHUNK, pinned=False), remote=MooncakeTier(master.config(**overrides)),
                         io_threads=2)


def _run(executor: StoreExecutor, commands: list) -> list:
    executor.submit(commands)
    return sorted(executor.drain(60), key=lambda c: c.cmd_id)


def _promote_all(executor: StoreExecutor, first_id: int) -> list:
    for slot in range(KEY_COUNT):
        executor.arena.slot_array(slot)[:] = 0x5A  # a sentinel: a rejected chunk must leave no byte of its own
    return _run(executor, [Promote(first_id + i, key, i, Tier.REMOTE) for i, key in enumerate(_keys())])


def _forge(master: LocalMooncakeMaster, name: str, size: int) -> None:
    """Another client of the master: removes the object and puts other bytes of the same length (upsert)."""
    attacker = MooncakeTier(master.config(global_segment_bytes=0))  # no memory of its own: the object outlives it
    assert attacker._store.remove(name, True) == 0
    assert attacker.put([name], [memoryview(_data(777, size))])[0].ok
    assert attacker.counters["puts"] == 1
    attacker.close()


def envelope() -> dict:
    """Through executors on a real master: an overwritten object is rejected (and, with verification switched
    off, would have been loaded); a put over it replaces it; a put over a valid object writes nothing."""
    found: dict = {}
    with LocalMooncakeMaster() as master:
        writer = _executor(master, global_segment_bytes=64 << 20)
        for slot in range(KEY_COUNT):
            writer.arena.slot_array(slot)[:] = _data(slot)
        assert all(c.ok for c in _run(writer, [Put(i, k, i) for i, k in enumerate(_keys())]))
        reader = _executor(master, global_segment_bytes=0)
        assert all(c.ok for c in _promote_all(reader, 100))
        assert all(np.array_equal(reader.arena.slot_array(s), _data(s)) for s in range(KEY_COUNT))
        victim = _keys()[1].storage_name(0)
        _forge(master, victim, writer.arena.sealed_bytes)
        answers = _promote_all(reader, 200)
        found["after_forgery"] = [c.reason for c in answers]
        found["reader_rejected"] = reader.remote.counters["rejected"]
        # negative control: with verification switched off the forged bytes are delivered as a hit
        real_verify = executor_module.verify
        executor_module.verify = lambda *args: None
        try:
            control = _promote_all(reader, 300)
        finally:
            executor_module.verify = real_verify
        found["control_ok"] = all(c.ok for c in control)
        found["control_delivers_forged_bytes"] = bool(np.array_equal(reader.arena.slot_array(1),
                                                                     _data(777, CHUNK)))
        # a put over the forged object removes it and writes ours; the reader then gets the right bytes
        writer.arena.slot_array(1)[:] = _data(1)
        writer.forget_seal(1)
        assert all(c.ok for c in _run(writer, [Put(400, _keys()[1], 1)]))
        found["put_replaced_invalid"] = writer.remote.counters["put_replaced_invalid"]
        assert all(c.ok for c in _promote_all(reader, 500))
        found["repaired"] = bool(np.array_equal(reader.arena.slot_array(1), _data(1)))
        # another instance's valid object (other bytes: equally valid KV may differ by rounding) counts as stored
        other = _executor(master, global_segment_bytes=16 << 20)
        other.arena.slot_array(2)[:] = _data(9)
        puts_before = other.remote.counters["puts"]
        assert all(c.ok for c in _run(other, [Put(600, _keys()[2], 2)]))
        found["put_existing"] = other.remote.counters["put_existing"]
        found["other_wrote"] = other.remote.counters["puts"] - puts_before
        assert all(c.ok for c in _promote_all(reader, 700))
        found["first_copy_kept"] = bool(np.array_equal(reader.arena.slot_array(2), _data(2)))
        for executor in (other, reader, writer):
            executor.close()
    return found


def bounce() -> dict:
    """zero_copy false: only the bounce buffer is registered; round trips split over it are byte for byte, and a
    forged object is checked in the bounce buffer, never copied into the slot."""
    count, bounce_bytes = 40, 1 << 20
    with LocalMooncakeMaster() as master:
        tier = MooncakeTier(master.config(zero_copy=False, bounce_bytes=bounce_bytes,
                                          global_segment_bytes=count * CHUNK + (64 << 20)))
        arena = HostArena(count, CHUNK, pinned=False)
        executor = make_executor(0, arena, remote=tier, io_threads=2)
        registered = tier.registered()
        keys = [ChunkKey("b" * 32, i.to_bytes(4, "little") * 8) for i in range(count)]
        for slot in range(count):
            arena.slot_array(slot)[:] = _data(slot)
        assert all(c.ok for c in _run(executor, [Put(i, k, i) for i, k in enumerate(keys)]))
        for slot in range(count):
            arena.slot_array(slot)[:] = 0
        answers = _run(executor, [Promote(100 + i, k, i, Tier.REMOTE) for i, k in enumerate(keys)])
        assert all(c.ok for c in answers), [c.reason for c in answers if not c.ok][:3]
        wrong = [s for s in range(count) if not np.array_equal(arena.slot_array(s), _data(s))]
        _forge(master, keys[3].storage_name(0), arena.sealed_bytes)
        arena.slot_array(3)[:] = 0x5A
        (forged,) = _run(executor, [Promote(200, keys[3], 3, Tier.REMOTE)])
        found = {"registered": registered, "arena": [arena.base_address, arena.total_bytes],
                 "bounce_bytes": bounce_bytes, "wrong": wrong, "bounce_ops": tier.counters["bounce_ops"],
                 "zero_copy_ops": tier.counters["zero_copy_ops"], "forged": forged.reason,
                 "forged_slot_verifies": verify(arena.sealed_view(3), keys[3], 0, executor.sealer) is None}
        executor.close()
    return found


class CheckThenCopyTier(MooncakeTier):
    """The order issue 31 removed (the negative control of `bounce_race`): a get checked the object inside the bounce
    buffer, which transfer-engine peers can write, and then copied it into the slot."""

    def _bounce_get(self, names, buffers, checks, rejected):  # type: ignore[no-untyped-def]
        assert self._bounce is not None
        codes: list[int] = []
        base = int(self._bounce.ctypes.data)
        for group in self._bounce_groups(buffers):
            with self._bounce_lock:
                got = self._call("get", lambda s: list(s.batch_get_into(
                    [names[i] for i, _ in group], [base + o for _, o in group],
                    [buffers[i].nbytes for i, _ in group])), touches_memory=True)
                if got is None:
                    return None
                for (i, offset), code in zip(group, got):
                    if code == buffers[i].nbytes:
                        landed = memoryview(self._bounce[offset:offset + code])
                        why = checks[i](landed) if checks[i] is not None else None
                        if why is None:
                            buffers[i][:] = landed
                        else:
                            rejected[i] = why
                codes.extend(got)
        return codes


def peer_writer(metadata: str, segment: str, address: int, length: int, stop_file: str) -> dict:
    """Another transfer-engine client of the cluster: rewrites random 4 KiB pages of `segment`'s registered range
    [address, address + length) until `stop_file` exists (what any host reaching the ports can do)."""
    import os

    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
    page = np.full(4096, 0x99, dtype=np.uint8)
    assert engine.register_memory(page.ctypes.data, page.nbytes) == 0
    rng = np.random.default_rng(7)
    writes = 0
    print("ready", flush=True)
    while not os.path.exists(stop_file):
        offset = int(rng.integers(0, length // 4096)) * 4096
        if engine.transfer_sync_write(segment, page.ctypes.data, address + offset, 4096) == 0:
            writes += 1
    return {"writes": writes}


def bounce_race(order: str = "slot", gets: int = 2048) -> dict:
    """zero_copy false, a store secret, and a peer rewriting the bounce buffer in a loop while `gets` promotions run:
    every promotion that reports ok must leave a slot that verifies. `order` "bounce" runs the old check-then-copy
    order (the negative control). Each check is held 1 ms after it passed, the window a busy host gives a peer."""
    import os
    import tempfile

    from lmcache_npu.store.envelope import Sealer

    count, chunk = 32, 192 << 10
    with LocalMooncakeMaster() as master:
        kind = CheckThenCopyTier if order == "bounce" else MooncakeTier
        tier = kind(master.config(bounce_bytes=4 << 20, global_segment_bytes=count * 2 * chunk + (64 << 20)))
        arena = HostArena(count, chunk, pinned=False)
        executor = make_executor(0, arena, remote=tier, io_threads=2, sealer=Sealer(b"s" * 32))
        keys = [ChunkKey("a" * 32, i.to_bytes(4, "little") * 8) for i in range(count)]
        for slot in range(count):
            arena.slot_array(slot)[:] = _data(slot, chunk)
        assert all(c.ok for c in _run(executor, [Put(i, k, i) for i, k in enumerate(keys)]))
        (address, length), = tier.registered()
        stop_file = os.path.join(tempfile.mkdtemp(prefix="lmcache-race-"), "stop")
        peer = subprocess.Popen([sys.executable, "-m", "tests.store.mooncake_tier_scenarios", "peer_writer",
                                 master.metadata, tier._store.get_hostname(), str(address), str(length), stop_file],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready", peer.stderr.read()[-2000:]
        real_verify = executor_module.verify

        def held_verify(*args):  # type: ignore[no-untyped-def]
            why = real_verify(*args)
            time.sleep(0.001)  # between the check and whatever comes after it
            return why

        executor_module.verify = held_verify
        found = {"gets": 0, "ok": 0, "rejected": 0, "unverified_ok": 0}
        try:
            command_id = 1000
            while found["gets"] < gets:
                batch = [Promote(command_id + i, k, i, Tier.REMOTE) for i, k in enumerate(keys)]
                command_id += len(batch)
                for answer in _run(executor, batch):
                    found["gets"] += 1
                    slot = answer.cmd_id - (command_id - len(batch))
                    if answer.ok:
                        found["ok"] += 1
                        if real_verify(arena.sealed_view(slot), keys[slot], 0, executor.sealer) is not None:
                            found["unverified_ok"] += 1  # reported loadable, yet its bytes never verified
                    elif answer.reason.startswith("rejected"):
                        found["rejected"] += 1
        finally:
            executor_module.verify = real_verify
            open(stop_file, "w").close()
            out, err = peer.communicate(timeout=60)
        found["peer_writes"] = json.loads(out.strip().splitlines()[-1])["writes"] if out.strip() else -1
        executor.close()
    return found


SCENARIOS = {"roundtrip": roundtrip, "share": share, "master_killed": master_killed, "loopback": loopback,
             "envelope": envelope, "bounce": bounce, "bounce_race": bounce_race,
             "bounce_race_old_order": lambda: bounce_race("bounce", gets=512)}


def main(argv: list[str]) -> int:
    if argv[0] == "reader":
        print(json.dumps(reader(argv[1], argv[2], int(argv[3]))))
        return 0
    if argv[0] == "peer_writer":
        print(json.dumps(peer_writer(argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5])))
        return 0
    print(json.dumps(SCENARIOS[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
