"""What a peer may send wrong, and what it is told: keys of another namespace are refused naming both namespaces, a
malformed request (unknown verb, wrong types, wrong arity) gets an error reply and the connection keeps serving, a
first message that is no valid Attach is refused, and a geometry beyond `max_pools` is refused naming --max-pools
(the engine serves without the node cache); with max_pools=2 each geometry gets a pool of half the node's bytes."""

from __future__ import annotations

import re
import socket
from typing import Any, Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.node import wire
from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.node.messages import ONEWAY, Attach, Attached, PoolGeometry, Refused, Verb
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.commands import Completion
from lmcache_npu.store.index.contract import DiskState, LookupResult, SlotState
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.metrics import Metric

from .harness import NAMESPACE, OBJECT_BYTES, WEIGHTS, Node, geometry, keys_of, short_dir, store_config

OTHER = "1" * 32


def test_keys_of_another_namespace_are_refused_naming_both_and_the_client_keeps_working(start_node):
    node = start_node(store_config(4, 1))
    engine = node.engine("A", geometry(1))
    strict = node.client("A-strict", geometry(1), strict=True)  # the service's refusal raised, as tests want it
    foreign = keys_of(0, 1, namespace=OTHER)

    def calls(client: NodeCacheClient) -> tuple[Callable[[], Any], ...]:
        return (lambda: client.lookup("q", foreign), lambda: client.presence(foreign),
                lambda: client.prepare_store("q", [(0, foreign[0])]), lambda: client.location(foreign[0]))

    for call in calls(strict):
        with pytest.raises(ValueError, match=f"key of namespace '{OTHER}' sent to the pool of namespace '{NAMESPACE}'"):
            call()
    # an engine's client answers the same refusals as misses, counted (it never raises into vLLM's scheduler)
    assert [call() for call in calls(engine.client)] == [LookupResult(0, 0), [False], [],
                                                          (None, SlotState.FREE, DiskState.NONE)]
    assert engine.client.counters[Metric.NODE_CACHE_ERROR_REPLIES] == 4
    mixed = keys_of(0, 1) + foreign
    with pytest.raises(ValueError, match=f"keys of 2 namespaces in one call \\({NAMESPACE}, {OTHER}\\)"):
        engine.client.lookup("q", mixed)
    assert len(engine.store("w", keys_of(0, 1))) == 1  # control: its own namespace's keys are served
    assert engine.client.lookup("q", keys_of(0, 1)).ready_chunks == 1


class RawPeer:
    """A connection that speaks the wire format by hand (what a buggy or hostile engine could send)."""

    def __init__(self, path: str, first: Any) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        wire.send(self.sock, first)
        self.reply, fds = wire.receive_with_fds(self.sock)
        for fd in fds:
            wire.close_fd(fd)

    def ask(self, request: Any) -> Any:
        wire.send(self.sock, request)
        return wire.receive(self.sock)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peer(start_node) -> Iterator[RawPeer]:
    node = start_node(store_config(4, 1))
    raw = RawPeer(node.path, Attach("raw", geometry(1), weights=WEIGHTS))
    assert isinstance(raw.reply, Attached)
    yield raw
    raw.close()


HEALTHY = ("presence", NAMESPACE, [], False)
KEY = keys_of(0, 1)[0]
HASH = KEY.chunk_hash


@pytest.mark.parametrize("request_, error", [
    ("lookup", "a request is a tuple (verb, *arguments)"),
    ((), "a request is a tuple (verb, *arguments)"),
    ((3, "r"), "a request is a tuple (verb, *arguments)"),
    (("bogus",), "bogus: unknown verb 'bogus' (this service speaks adopt_disk, chunks, describe, drop_disk_copies, "
                 "events, location, lookup, occupancy, on_completions, prepare_load, prepare_store, "
                 "presence, release, sync)"),
    (("check_invariants",), "check_invariants: unknown verb 'check_invariants'"),  # a test's helper, not a verb
    (("lookup", 5, NAMESPACE, []), "lookup: a request id must be a string, got int"),
    (("lookup", "r", NAMESPACE, "keys"), "lookup: chunk hashes must be a list of bytes, got str"),
    (("lookup", "r", NAMESPACE, [HASH, "x", 3]), "lookup: chunk hashes must be a list of bytes, got a list of 3 "
                                                  "(bytes, int, str)"),
    (("lookup", "r", [KEY]), "lookup: "),  # the old shape: keys instead of a batch (too few arguments)
    (("lookup", "r", None, [HASH]), f"lookup: key of namespace None sent to the pool of namespace '{NAMESPACE}'"),
    (("presence", OTHER, [HASH], True), f"presence: key of namespace '{OTHER}' sent to the pool of namespace"),
    (("prepare_store", "r", NAMESPACE, [-1], [HASH]), "prepare_store: chunk numbers must be a list of ints >= 0, "
                                                       "one per hash (1), got a list of 1 (int)"),
    (("prepare_store", "r", NAMESPACE, [True], [HASH]), "prepare_store: chunk numbers must be a list of ints >= 0"),
    (("prepare_store", "r", NAMESPACE, [0, 1], [HASH]), "prepare_store: chunk numbers must be a list of ints >= 0, "
                                                         "one per hash (1), got a list of 2 (int)"),
    (("prepare_load", "r", NAMESPACE, [0], [HASH]), f"prepare_load: request 'r' chunk 0: key {HASH.hex()} is absent"),
    (("location", (NAMESPACE, HASH)), "location: a key must be a ChunkKey"),
    (("adopt_disk", [ChunkKey(NAMESPACE, "not bytes")]), "adopt_disk: a key must be a ChunkKey"),
    (("lookup",), "lookup: "),
    (("occupancy", 1), "occupancy: "),
], ids=lambda value: str(value)[:40] if isinstance(value, tuple) else None)
def test_a_malformed_request_gets_a_clear_error_and_the_connection_keeps_serving(peer, request_, error):
    reply = peer.ask(request_)
    assert reply[:2] == ("error", "ValueError") and reply[2].startswith(error), reply
    assert peer.ask(HEALTHY)[:2] == ("ok", [])


@pytest.mark.parametrize("verb", sorted(verb.value for verb in ONEWAY))
def test_a_malformed_one_way_request_is_dropped_without_a_reply_and_the_connection_keeps_serving(peer, verb):
    wire.send(peer.sock, (verb, 12))
    wire.send(peer.sock, (verb, [KEY] if verb == "on_completions" else 5))  # a key for an answer: refused
    assert peer.ask(HEALTHY)[:2] == ("ok", [])  # the next reply is this request's: nothing answered the two above


VERBS = [*(verb.value for verb in Verb), "check_invariants", "bogus"]  # check_invariants: unknown here too
plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**70) | st.text(max_size=4) | st.binary(max_size=4)
    | st.sampled_from([KEY, HASH, NAMESPACE, OTHER, keys_of(1, 1, OTHER)[0], ChunkKey(NAMESPACE, 7),
                      (1, 0, True, ""), [(1, 0, True, ""), (2, 1, False, "x")]]),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=2),
    max_leaves=8)


@given(st.lists(st.tuples(st.sampled_from(VERBS), st.lists(plain, max_size=3)), min_size=1, max_size=6))
def test_any_sequence_of_requests_of_plain_values_leaves_the_connection_serving(requests):
    directory = short_dir()
    node = Node(directory, store_config(4, 1))
    try:
        raw = RawPeer(node.path, Attach("fuzz", geometry(1), weights=WEIGHTS))
        for verb, arguments in requests:
            wire.send(raw.sock, (verb, *arguments))
            if verb not in ONEWAY:
                assert wire.receive(raw.sock)[0] in ("ok", "error")
            assert raw.ask(HEALTHY)[:2] == ("ok", [])
        raw.close()
    finally:
        node.close()


@pytest.mark.parametrize("first, reason", [
    (("lookup", "r", []), "the first message must be an Attach"),
    (Attach("e", "geometry"), "the first message must be an Attach"),  # type: ignore[arg-type]
    (Attach("e", PoolGeometry("xyz", b"f", 1, OBJECT_BYTES, 256), weights=WEIGHTS),
     "namespace must be 32 hex characters"),
    (Attach("e", PoolGeometry(NAMESPACE, "f", 1, OBJECT_BYTES, 256), weights=WEIGHTS),
     "layout fingerprint must be bytes"),
    (Attach("e", PoolGeometry(NAMESPACE, b"f", 0, OBJECT_BYTES, 256), weights=WEIGHTS),
     "world must be an integer >= 1, got 0"),
    (Attach("e", PoolGeometry(NAMESPACE, b"f", 1, True, 256), weights=WEIGHTS),
     "object_bytes must be an integer >= 1, got True"),
    (Attach("e", geometry(1), 3, weights=WEIGHTS), "rank 3 is not a rank of this pool (1 ranks)"),
])
def test_a_first_message_that_is_no_valid_attach_is_refused_with_the_reason(start_node, first, reason):
    node = start_node(store_config(4, 1))
    raw = RawPeer(node.path, first)
    assert isinstance(raw.reply, Refused) and reason in raw.reply.reason
    raw.close()
    assert node.client("next", geometry(1)).epoch is not None  # the service goes on


def test_a_second_geometry_beyond_max_pools_is_refused_naming_the_option(start_node, caplog):
    node = start_node(store_config(4, 1), max_pools=1)
    node.client("A", geometry(1))
    refused = node.client("B", geometry(1, namespace=OTHER))  # starts all the same, without the node cache
    assert refused.epoch is None and refused.counters[Metric.NODE_CACHE_REFUSED] == 1
    assert refused.lookup("q", keys_of(0, 1, namespace=OTHER)).hit_chunks == 0
    assert re.search(r"refused this engine: .*\(--max-pools 1\).*larger --max-pools", caplog.text)
    assert len(node.service.pools) == 1


def test_max_pools_two_gives_two_pools_of_half_the_bytes(start_node):
    store = store_config(4, 2, pools=2)
    node = start_node(store, max_pools=2)
    first, second = geometry(2), geometry(2, object_bytes=2 * OBJECT_BYTES, namespace=OTHER)
    clients = [node.client("A", first), node.client("B", second)]
    assert len(node.service.pools) == 2
    for client, geo in zip(clients, (first, second)):
        pool = node.service.pools[geo]
        assert client.num_slots == store.capacity.cpu_bytes // 2 // (2 * slot_bytes_for(geo.object_bytes))
        assert sum(arena.num_slots * arena.slot_bytes for arena in pool.arenas) <= store.capacity.cpu_bytes // 2
    assert clients[0].num_slots == 4 and clients[1].num_slots == 2
    third = node.client("C", geometry(2, namespace="2" * 32))
    assert third.epoch is None and third.counters[Metric.NODE_CACHE_REFUSED] == 1 and len(node.service.pools) == 2
