"""Who may reach the node cache: the socket is 0600 (0660 and the group's with `group`), a peer of another user is
refused by its `SO_PEERCRED` credentials, the service reads only its closed encoding (a pickle that would run
os.system, or make the service build hundreds of MiB from a few bytes, is refused before anything runs or is built;
a reply may name only allow-listed classes and no builtin; the protocol's values still round-trip), an announced
length beyond MAX_MESSAGE_BYTES and garbage are refused, and the shared segments are memory files in no
filesystem."""

from __future__ import annotations

import grp
import logging
import mmap
import os
import pickle
import re
import socket
import stat
import struct
import tracemalloc

import pytest

from lmcache_npu.node import service as service_module
from lmcache_npu.node import codec, wire
from lmcache_npu.node.client import NodeCacheUnavailable
from lmcache_npu.node.messages import Attach, Attached, PoolGeometry, Refused
from lmcache_npu.store.commands import Completion, Load, Store, Tier
from lmcache_npu.store.index.contract import ChunkView, DiskState, LookupResult, SlotState

from .harness import geometry, keys_of, store_config, wait_for


def test_the_socket_is_0600(start_node):
    node = start_node(store_config(2, 1))
    mode = os.stat(node.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_with_a_group_the_socket_is_0660_and_the_groups(start_node):
    group = grp.getgrgid(os.getgid())
    node = start_node(store_config(2, 1), group=group.gr_name)
    info = os.stat(node.path)
    assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == group.gr_gid


class ForeignUid:
    """The service module's `os` as another user's service would see it: every peer of ours is a stranger."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def getuid() -> int:
        return os.getuid() + 4242


def test_a_peer_of_another_user_is_refused_and_counted(start_node, monkeypatch, caplog):
    node = start_node(store_config(2, 1))
    monkeypatch.setattr(service_module, "os", ForeignUid())
    with caplog.at_level(logging.WARNING, logger="lmcache_npu.node.client"):
        assert node.client("stranger", geometry(1)).epoch is None  # it serves without the node cache
    assert "did not attach this engine" in caplog.text
    assert node.service.refused_peers == 1 and node.service.connections == 0
    assert 'lmcache_npu:node_refused_peers_total{engine="node"} 1' in node.service.metrics_text()
    monkeypatch.undo()  # control: the same peer, seen as the service's own user, attaches
    assert node.client("friend", geometry(1)).epoch is not None


def test_a_member_of_the_named_group_is_let_in_though_its_uid_differs(start_node, monkeypatch):
    node = start_node(store_config(2, 1), group=grp.getgrgid(os.getgid()).gr_name)
    monkeypatch.setattr(service_module, "os", ForeignUid())
    assert node.client("colleague", geometry(1)).epoch is not None and node.service.refused_peers == 0


class RunsOnLoad:
    """A pickle that calls `function(argument)` when it is loaded."""

    def __init__(self, function: object, argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple:
        return self.function, (self.argument,)


@pytest.mark.parametrize("function", [os.system, eval], ids=["os.system", "builtins.eval"])
def test_a_pickle_that_names_a_callable_outside_the_allow_list_is_refused_before_it_runs(function, node_dir):
    marker = os.path.join(node_dir, "ran")
    argument = f"touch {marker}" if function is os.system else f"open({marker!r}, 'w').close()"
    payload = pickle.dumps(RunsOnLoad(function, argument))
    with pytest.raises(wire.WireError, match="may not contain (posix.system|builtins.eval)"):
        wire.decode(payload)
    assert not os.path.exists(marker)
    pickle.loads(payload)  # control: an ordinary unpickler runs it
    assert os.path.exists(marker)


def test_a_hostile_first_message_costs_only_its_own_connection(start_node, node_dir):
    node = start_node(store_config(2, 1))
    marker = os.path.join(node_dir, "ran")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(node.path)
        payload = pickle.dumps(RunsOnLoad(os.system, f"touch {marker}"))
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        assert isinstance(wire.receive(sock), Refused)  # refused unread: a pickle is never decoded
        assert sock.recv(1) == b""  # and the service hung up
    assert not os.path.exists(marker)
    assert node.client("next", geometry(1)).lookup("q", keys_of(0, 1)) == LookupResult(0, 0)  # still serving


REQUESTS = [
    keys_of(0, 2), {"a": 1, "b": [1.5, (2, b"x")]}, frozenset({1, 2}), {3}, True, None, 2**70, -(2**63),
    ("lookup", "r", "0" * 32, [b"h" * 32, b"i" * 32]), ("lookup", "r", "0" * 32, [b"h", b"longer"]),
    ("prepare_store", "r", "0" * 32, [0, 1], [b"h" * 32, b"i" * 32]),
    ("on_completions", [(1, 0, True, ""), (2, 1, False, "device: x"), (3, 0, False, "device: x")]),
    ("describe", keys_of(0, 1)[0], ((1, 2), b"parent", b"\0" * 8, None, "lora")), (Tier.ARENA, SlotState.READY),
    Attach("e", geometry(2), 1, True), Attached("epoch", 4, 4096, 1 << 20, "off", 0, "arc"), Refused("why"),
]
REPLIES = [
    keys_of(0, 2), {"a": 1, "b": [1.5, (2, b"x")]}, frozenset({1, 2}), {3}, bytearray(b"ab"), True, None,
    Store(1, keys_of(0, 1)[0], 2, "r", 0), Load(2, keys_of(1, 1)[0], 3, "r", 1), Completion(1, 0, False, "device"),
    LookupResult(2, 1, (Tier.ARENA, Tier.DISK)), ChunkView(keys_of(0, 1)[0], 1, SlotState.READING, DiskState.PRESENT,
                                                           1, frozenset({"q"}), 0),
    Attach("e", geometry(2), 1, True), Attached("epoch", 4, 4096, 1 << 20, "off", 0, "arc"), Refused("why"),
    ("ok", {Tier.ARENA: (1, 4)}, {"lookups": 1}, [(keys_of(0, 1)[0], Tier.DISK, True)]),
]


@pytest.mark.parametrize("value", REQUESTS, ids=[type(v).__name__ for v in REQUESTS])
def test_negative_control_every_request_of_the_protocol_round_trips(value):
    assert wire.decode_request(wire.encode(value)[4:]) == value
    assert wire.decode(wire.encode(value)[4:]) == value  # an engine reads the service's Attached and Refused so


@pytest.mark.parametrize("value", REPLIES, ids=[type(v).__name__ for v in REPLIES])
def test_negative_control_every_reply_of_the_protocol_round_trips(value):
    assert wire.decode(wire.encode_reply(value)[4:]) == value


def _reduce_pickle(name: bytes, argument: int) -> bytes:
    """The review's R5: a pickle calling builtins.<name>(argument) (STACK_GLOBAL, then REDUCE of an allowed one)."""
    return (b"\x80\x04\x8c\x08builtins\x8c" + bytes([len(name)]) + name + b"\x93J" + struct.pack("<i", argument)
            + b"\x85R.")


BOMBS = {
    "REDUCE bytearray": _reduce_pickle(b"bytearray", 256 << 20),  # 32 B -> a 256 MiB zeroed bytearray
    "memo LONG_BINPUT": b"\x80\x05Nr" + struct.pack("<I", 1 << 24) + b".",  # 9 B -> a 256 MiB memo table, no class
    "codec count": codec.MAGIC + b"l" + struct.pack("=I", 1 << 30),  # a list of 2**30 items in 7 B
}


@pytest.mark.parametrize("payload", list(BOMBS.values()), ids=list(BOMBS))
def test_a_few_bytes_never_make_the_service_build_hundreds_of_mib(start_node, payload):
    assert len(payload) < 40
    node = start_node(store_config(2, 1))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(node.path)
            sock.sendall(struct.pack(">I", len(payload)) + payload)
            try:  # a pickle is answered with a Refused (built from nothing it sent), anything else hung up on
                answered = wire.receive(sock)
            except wire.WireError:
                answered = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"the service built {peak >> 20} MiB from {len(payload)} B"
    assert answered is None or (isinstance(answered, Refused) and "sent a pickle" in answered.reason)
    with pytest.raises(wire.WireError):
        wire.decode_request(payload)
    assert node.client("next", geometry(1)).lookup("q", keys_of(0, 1)) == LookupResult(0, 0)  # still serving


def test_negative_control_an_ordinary_unpickler_builds_the_bomb():
    tracemalloc.start()
    try:
        built = pickle.loads(BOMBS["REDUCE bytearray"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(built) == 256 << 20 and peak >= 256 << 20
    del built


def test_a_reply_may_name_no_builtin_callable():
    with pytest.raises(wire.WireError, match="may not contain builtins.bytearray"):
        wire.decode(_reduce_pickle(b"bytearray", 16))


def test_the_decoded_size_of_a_request_is_capped(monkeypatch):
    empty_sets = codec.MAGIC + b"l" + struct.pack("=I", 4096) + (b"e" + struct.pack("=I", 0)) * 4096  # 20 KiB
    assert len(wire.decode_request(empty_sets)) == 4096  # control: within the cap
    monkeypatch.setattr(codec, "MAX_DECODED_BYTES", 1 << 20)  # 4096 sets are about 1 MiB as CPython holds them
    with pytest.raises(wire.WireError, match="would decode to more than 1048576 B"):
        wire.decode_request(empty_sets)


def test_the_service_reads_no_pickle_and_tells_an_older_engine_why(start_node):
    node = start_node(store_config(2, 1))
    attach = pickle.dumps(Attach("pickled", geometry(1)), protocol=5)  # what an engine of the old wire sends
    with pytest.raises(wire.PickledRequest, match="an engine of an older lmcache-npu"):
        wire.decode_request(attach)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(node.path)
        sock.sendall(struct.pack(">I", len(attach)) + attach)
        reply = wire.receive(sock)  # a pickle, as the old engine reads it
        assert sock.recv(1) == b""
    assert isinstance(reply, Refused) and "upgrade the engine or the service" in reply.reason
    assert node.service.connections == 0 and not node.service.pools


def _receive(data: bytes) -> object:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(data)
        left.shutdown(socket.SHUT_WR)
        return wire.receive(right)


def test_an_announced_length_beyond_the_limit_is_refused_before_reading_it():
    with pytest.raises(wire.WireError, match=f"announced {wire.MAX_MESSAGE_BYTES + 1} B"):
        _receive(struct.pack(">I", wire.MAX_MESSAGE_BYTES + 1))
    assert _receive(wire.encode(("ok", 1))) == ("ok", 1)  # control: a well-formed message over the same path


@pytest.mark.parametrize("garbage", [b"\x00garbage\xff", b"\x80\x05K", pickle.dumps(PoolGeometry)[:-3]],
                         ids=["bytes", "truncated-pickle", "cut-class"])
def test_garbage_is_refused(garbage):
    with pytest.raises(wire.WireError, match="undecodable|may not contain"):
        _receive(struct.pack(">I", len(garbage)) + garbage)


def test_a_message_cut_short_is_refused():
    with pytest.raises(wire.WireError, match="mid-message"):
        _receive(wire.encode(("lookup", "r", keys_of(0, 4)))[:40])


def shared_files_of_this_process() -> set[str]:
    """Files under /dev/shm this process maps or holds open (other processes' entries there are not ours)."""
    with open("/proc/self/maps") as maps:
        mapped = {line.split(maxsplit=5)[-1].strip() for line in maps if "/dev/shm/" in line}
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone already
            continue
        if target.startswith("/dev/shm/"):
            held.add(target)
    return mapped | held


def test_the_segments_are_memory_files_in_no_filesystem(start_node):
    before = shared_files_of_this_process()
    node = start_node(store_config(4, 2))
    worker = node.worker("A", 1)
    assert shared_files_of_this_process() == before
    assert not [name for name in os.listdir("/dev/shm") if "lmcache" in name]
    fds = node.pool.arenas[1].segment_fds
    assert fds and all(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:lmcache-npu-segment-") for fd in fds)
    start = worker.arena.base_address
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if int(line.split("-")[0], 16) == start]
    assert len(mapped) == 1 and "/memfd:lmcache-npu-segment-0 (deleted)" in mapped[0]
    assert mapped[0].split()[1].startswith("rw-s")  # shared: the node's pages, not a private copy


def test_negative_control_a_segment_in_dev_shm_would_be_seen():
    path = f"/dev/shm/lmcache-npu-test-{os.getpid()}"
    with open(path, "w+b") as file:
        file.truncate(4096)
        view = mmap.mmap(file.fileno(), 4096)
        try:
            assert path in shared_files_of_this_process()
        finally:
            view.close()
            os.unlink(path)


def test_a_peer_that_says_nothing_is_hung_up_on(start_node, monkeypatch):
    monkeypatch.setattr(service_module, "FIRST_MESSAGE_S", 0.2, raising=False)
    node = start_node(store_config(2, 1))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(node.path)
        assert sock.recv(1) == b""  # hung up: the silent connection's thread is free again
    assert node.client("next", geometry(1)).lookup("q", keys_of(0, 1)) == LookupResult(0, 0)


def test_connections_beyond_the_cap_are_refused_and_counted(start_node, monkeypatch):
    monkeypatch.setattr(service_module, "MAX_CONNECTIONS", 3, raising=False)
    node = start_node(store_config(2, 1))
    first = node.client("A", geometry(1))
    idle = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(node.path)
        idle.append(sock)
    wait_for(lambda: len(node.service._open) == 3, "three open connections")
    crowded = node.client("B", geometry(1))  # the engine starts unattached and asks again in the background
    assert crowded.epoch is None
    crowded.close()
    assert node.service.refused_crowd >= 1
    assert re.search(r'lmcache_npu:node_refused_connections_total\{engine="node"\} [1-9]', node.service.metrics_text())
    for sock in idle:
        sock.close()
    wait_for(lambda: len(node.service._open) == 1, "the idle connections to be gone")
    assert node.client("C", geometry(1)).epoch is not None and first.lookup("q", keys_of(0, 1)).hit_chunks == 0
