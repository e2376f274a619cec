"""systemd's descriptor store keeps the host cache across a crash: a service that systemd runs stores every pool's
segment files and a sealed manifest (FDSTORE=1 datagrams on $NOTIFY_SOCKET, received here by a fake systemd), seals
each committed store behind it, and a new service process handed them through LISTEN_FDS adopts the pool on its
epoch: every chunk sealed before the SIGKILL is a hit with its bytes, a byte changed meanwhile is never served (the
negative control), a store still being written is not adopted. A missing or bad manifest, a missing segment, or a
configuration that lays the arena out otherwise is a clear error and a cold start, and systemd is told to let go."""

from __future__ import annotations

import array
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from lmcache_npu.node import service as service_module
from lmcache_npu.node.attachment import attach_worker_arena
from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.node.fd_store import PREFIX, inherited_pools, sealed_file
from lmcache_npu.store.envelope import Sealer, verify
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.metrics import Metric

from tests.store.fakes import chunk_payload

from .harness import OBJECT_BYTES, WAIT_S, WEIGHTS, Engine, Node, expected_bytes, geometry, keys_of, store_config, wait_for

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
SLOTS = 8


class FakeSystemd:
    """A notify socket as systemd keeps one: descriptors stored by name (FDSTORE=1), removed (FDSTOREREMOVE=1)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.fds: dict[str, int] = {}
        self.states: list[dict[str, str]] = []

    def receive(self, until: Callable[[], bool], what: str) -> None:
        """Takes datagrams until `until()` holds (bounded)."""
        self.sock.settimeout(0.05)

        def one() -> bool:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4))
            except socket.timeout:
                return until()
            fds = array.array("i")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            state = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.states.append(state)
            if state.get("FDSTORE") == "1":
                assert len(fds) == 1 and state["FDNAME"] not in self.fds, state
                self.fds[state["FDNAME"]] = fds[0]
            elif state.get("FDSTOREREMOVE") == "1":
                gone = self.fds.pop(state["FDNAME"], None)
                if gone is not None:
                    os.close(gone)
            return until()

        wait_for(one, what)

    def said(self, key: str) -> list[dict[str, str]]:
        return [state for state in self.states if key in state]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


@pytest.fixture
def fake_systemd(node_dir: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = FakeSystemd(node_dir)
    monkeypatch.setenv("NOTIFY_SOCKET", fake.path)
    yield fake
    fake.close()


class Child:
    """tests/node/systemd_child.py serving `path`, handed `passed` (name -> descriptor) as systemd hands them."""

    def __init__(self, directory: str, path: str, notify: str, passed: Optional[dict[str, int]] = None) -> None:
        self.ready = os.path.join(directory, f"ready-{len(os.listdir(directory))}.json")
        passed = passed or {}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": notify,
               "LMCN_PASSED_FDS": ",".join(map(str, passed.values())), "LMCN_PASSED_NAMES": ":".join(passed)}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.node.systemd_child", path, self.ready, str(SLOTS),
                                         str(WORLD)], cwd=ROOT, env=env, pass_fds=tuple(passed.values()),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: os.path.exists(self.ready) or self.process.poll() is not None, "the service process",
                 timeout_s=3 * WAIT_S)
        if self.process.poll() is not None:
            raise AssertionError(f"the service process exited {self.process.returncode}: "
                                 f"{self.process.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        with open(self.ready) as file:
            self.state = json.load(file)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stderr.close()  # type: ignore[union-attr]


def open_inodes(pid: int) -> set[int]:
    """Inodes of the node cache segment files process `pid` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:lmcache-npu-segment"):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    return inodes


def test_a_crashed_service_is_found_again_through_systemds_descriptor_store(node_dir, fake_systemd):
    path = os.path.join(node_dir, "s")
    first = Child(node_dir, path, fake_systemd.path)
    geo = geometry(WORLD)
    client = NodeCacheClient(path, "A", geo, weights=WEIGHTS, connect_timeout_s=WAIT_S, retry_s=0.05)
    workers = [attach_worker_arena(path, "A", geo, rank, weights=WEIGHTS, pinned=False, lease=client.lease)
               for rank in range(WORLD)]
    try:
        engine = Engine(client, workers)
        keys = keys_of(0, 3)
        slots = {command.key: command.slot for command in engine.store("w", keys)}
        late = keys_of(7, 1)[0]
        (store,) = client.prepare_store("x", [(0, late)])  # handed out, being written at the crash
        epoch = client.epoch
        fake_systemd.receive(lambda: len(fake_systemd.fds) == 1 + WORLD and fake_systemd.said("READY"),
                             "the pool's descriptors and READY=1")
        assert set(fake_systemd.fds) == {f"{PREFIX}{epoch.replace('/', '.')}.{name}"
                                         for name in ("m", "r0.s0", "r1.s0")}

        def sealed() -> bool:
            return all(verify(worker.arena.sealed_view(slots[key]), key, rank, Sealer()) is None
                       for key in keys for rank, worker in enumerate(workers))

        wait_for(sealed, "every committed store to be sealed behind")
        for rank, worker in enumerate(workers):
            worker.arena.slot_array(store.slot)[:] = chunk_payload(late, rank, OBJECT_BYTES)  # landed, unsealed
        files = open_inodes(first.process.pid)
        first.kill()
        workers[1].arena.slot_array(slots[keys[2]])[5] ^= 0x01  # after the seal and the crash, before the restart

        second = Child(node_dir, path, fake_systemd.path, dict(fake_systemd.fds))
        (adopted,) = second.state["pools"]
        assert adopted["epoch"] == epoch and adopted["adopted"] == 2 and adopted["rejected"] == {"digest": 1}
        assert open_inodes(second.process.pid) == files  # the very files: no new pool
        wait_for(lambda: client.lookup("q", keys[:2]).ready_chunks == 2, "the client to attach to the same epoch")
        assert client.epoch == epoch and client.counters[Metric.NODE_CACHE_RECONNECTS] == 1
        assert client.lookup("q", keys).hit_chunks == 2  # the changed chunk is never served
        assert client.lookup("q2", [late]).hit_chunks == 0  # nor the store written at the crash
        seen = engine.read(client.prepare_load("q", list(enumerate(keys[:2]))))
        assert seen == {key: expected_bytes(key, WORLD) for key in keys[:2]}
        names = set(fake_systemd.fds)
        fake_systemd.receive(lambda: True, "nothing more")
        assert set(fake_systemd.fds) == names  # the adopted pool is not stored a second time
        second.kill()
    finally:
        client.close()
        for worker in workers:
            worker.close()
            worker.arena.close()


def made_pool(node_dir: str, fake: FakeSystemd, slots: int = SLOTS) -> tuple[Node, dict[str, int]]:
    """A service systemd runs (in this process), with a pool of two stored chunks, closed: what it kept."""
    node = Node(node_dir, store_config(slots, WORLD), socket_name="first")
    engine = node.engine("A")
    engine.store("w", keys_of(0, 2))
    fake.receive(lambda: len(fake.fds) == 1 + WORLD, "the pool's descriptors")
    assert node.pool.sealing is not None
    wait_for(node.pool.sealing.idle.is_set, "the stores to be sealed behind")
    node.close()
    return node, dict(fake.fds)


def test_a_service_systemd_ran_is_adopted_in_process_and_a_wrong_layout_starts_cold(node_dir, fake_systemd,
                                                                                   monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="lmcache_npu.node")
    _, kept = made_pool(node_dir, fake_systemd)
    monkeypatch.setattr(service_module, "passed_fds", lambda: {name: os.dup(fd) for name, fd in kept.items()})
    warm = Node(node_dir, store_config(SLOTS, WORLD), socket_name="warm")  # control: the same layout adopts
    try:
        assert warm.pool.rebuild is not None and warm.pool.rebuild.done.wait(WAIT_S)
        assert warm.pool.rebuild.report.adopted == 2
    finally:
        warm.close()
    cold = Node(node_dir, store_config(2 * SLOTS, WORLD), socket_name="cold")  # twice the slots: not this arena
    try:
        assert cold.service.pools == {} and "starts cold" in caplog.text
        fake_systemd.receive(lambda: not fake_systemd.fds, "systemd to be told to let the pool go")
        assert len(fake_systemd.said("FDSTOREREMOVE")) == len(kept)
    finally:
        cold.close()


@pytest.mark.parametrize("damage, why", [
    ("manifest not json", "not JSON"),
    ("no manifest", "no manifest"),
    ("a segment missing", "lacks 1 of its 1 segment"),
    ("another format", "manifest format"),
])
def test_a_bad_or_missing_manifest_or_segment_is_a_clear_error_and_the_pool_is_let_go(node_dir, fake_systemd, caplog,
                                                                                      damage, why):
    caplog.set_level(logging.ERROR, logger="lmcache_npu.node")
    _, kept = made_pool(node_dir, fake_systemd)
    passed = {name: os.dup(fd) for name, fd in kept.items()}
    manifest = next(name for name in passed if name.endswith(".m"))
    if damage == "manifest not json":
        os.close(passed[manifest])
        passed[manifest] = sealed_file("broken", b"{not json")
    elif damage == "no manifest":
        os.close(passed.pop(manifest))
    elif damage == "a segment missing":
        os.close(passed.pop(next(name for name in passed if name.endswith(".r1.s0"))))
    else:
        text = json.loads(os.pread(passed[manifest], 1 << 16, 0))
        os.close(passed[manifest])
        passed[manifest] = sealed_file("other", json.dumps({**text, "format": 99}).encode())
    store = service_module.SystemdFdStore()
    assert inherited_pools(dict(passed), store) == []
    assert "is not adopted" in caplog.text and why in caplog.text
    for fd in passed.values():  # every descriptor of that pool was closed
        with pytest.raises(OSError):
            os.fstat(fd)
    fake_systemd.receive(lambda: len(fake_systemd.said("FDSTOREREMOVE")) == len(passed), "the names to be removed")


def test_negative_control_an_intact_store_is_adopted(node_dir, fake_systemd):
    _, kept = made_pool(node_dir, fake_systemd)
    passed = {name: os.dup(fd) for name, fd in kept.items()}
    ((geometry_found, arena, _, names),) = inherited_pools(passed, service_module.SystemdFdStore())
    assert geometry_found == geometry(WORLD) and sorted(names) == sorted(kept) and arena.torn is None
    arena.close(range(WORLD))


@pytest.mark.parametrize("voided", [True, False], ids=["voided", "negative-control-not-voided"])
def test_a_slot_handed_to_a_store_names_no_chunk_until_it_is_sealed_again(node_dir, fake_systemd, monkeypatch,
                                                                          voided):
    if not voided:  # the check notices: without voiding at hand-out the evicted chunk's trailer would be believed
        monkeypatch.setattr(StoreExecutor, "unseal_slot", lambda executor, slot: None)
    node = Node(node_dir, store_config(2, WORLD), socket_name="first")
    engine = node.engine("A")
    evicted, kept_key = keys_of(0, 2)
    engine.store("w", [evicted, kept_key])
    fake_systemd.receive(lambda: len(fake_systemd.fds) == 1 + WORLD, "the pool's descriptors")
    wait_for(node.pool.sealing.idle.is_set, "the stores to be sealed behind")  # type: ignore[union-attr]
    engine.client.lookup("touch", [kept_key])  # the other one is the eviction policy's victim
    engine.client.release("touch")
    (store,) = engine.client.prepare_store("x", [(0, keys_of(5, 1)[0])])  # evicts it: its slot goes to a device
    assert node.pool.index.location(evicted)[0] is None and store.slot == 0
    node.close()  # "crashed" before the device wrote a byte: the slot holds the evicted chunk's bytes and trailer
    kept = dict(fake_systemd.fds)
    monkeypatch.setattr(service_module, "passed_fds", lambda: {name: os.dup(fd) for name, fd in kept.items()})
    successor = Node(node_dir, store_config(2, WORLD), socket_name="second")
    try:
        pool = successor.pool
        assert pool.rebuild is not None and pool.rebuild.done.wait(WAIT_S)
        adopted = {view.key for view in pool.index.chunks() if view.slot is not None}
        assert kept_key in adopted
        assert (evicted in adopted) is not voided  # a late write of the device would land in an adopted chunk
    finally:
        successor.close()
