"""A service that answers wrongly never raises into vLLM's scheduler (issue 39, H6): for every verb an engine waits on,
an error reply (the service refused or failed, injected as a KeyError in the real verb) and a malformed reply (wrong
arity, a value of the wrong type, counters of the wrong type or below 0, no tuple at all: injected into the real
service's answer) give the same miss the client answers while the service is away, counted apart, and the connection
keeps serving (the control after each fault). Only a client made `strict` (tests of the service) raises."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from lmcache_npu.node import service as service_module
from lmcache_npu.node.client import NodeCacheClient, NodeCacheRefused
from lmcache_npu.node.messages import Verb
from lmcache_npu.node.pool import NodePool
from lmcache_npu.node.service import NodeCacheService
from lmcache_npu.store.commands import Tier
from lmcache_npu.store.index.contract import DiskState, LookupResult, SlotState
from lmcache_npu.store.metrics import Metric

from .harness import Engine, geometry, keys_of, store_config

WORLD = 1
KEYS = keys_of(0, 2)


def _prepare_load(client: NodeCacheClient) -> Any:
    """A promised hit's load: a miss here is a refusal (a ValueError the scheduler turns into a recompute)."""
    assert client.lookup("hit", KEYS[:1]).ready_chunks == 1
    try:
        return client.prepare_load("hit", [(0, KEYS[0])])
    except ValueError as exc:
        return f"refused: {exc}"
    finally:
        client.release("hit")


# verb -> (the call an engine makes, what it answers when the service cannot)
CALLS: dict[str, tuple[Callable[[NodeCacheClient], Any], Any]] = {
    "lookup": (lambda c: c.lookup("q", KEYS), LookupResult(0, 0)),
    "presence": (lambda c: c.presence(KEYS), [False, False]),
    "prepare_load": (_prepare_load, "refused"),
    "prepare_store": (lambda c: c.prepare_store("s", [(5, keys_of(5, 1)[0])]), []),
    "occupancy": (lambda c: c.occupancy(), {Tier.ARENA: (0, 4), Tier.DISK: (0, 0)}),
    "location": (lambda c: c.location(KEYS[0]), (None, SlotState.FREE, DiskState.NONE)),
    "chunks": (lambda c: c.chunks(), []),
    "sync": (lambda c: c.sync(), None),
    "adopt_disk": (lambda c: c.adopt_disk(KEYS), 0),
    "drop_disk_copies": (lambda c: c.drop_disk_copies(KEYS), None),
    "events": (lambda c: c.set_tier_listener(lambda key, tier, entered: None), None),
}
# a reply of the right verb in another shape: what another release of the service, or a bug, could send
MALFORMED: dict[str, Callable[[tuple], Any]] = {
    "arity": lambda reply: reply + ("one more",),
    "value": lambda reply: ("ok", "not this verb's value", *reply[2:]),
    "counters": lambda reply: (*reply[:2], {"lookups": "many"}, reply[3]),
    "counter back": lambda reply: (*reply[:2], {"lookups": -3}, reply[3]),  # the engine's counters never go back
    "no tuple": lambda reply: list(reply),
}


def _engine(start_node: Any, slots: int = 4) -> Engine:
    node = start_node(store_config(slots, WORLD))
    engine = node.engine("A", geometry(WORLD))
    engine.store("w", KEYS)
    engine.client.occupancy()  # cached for a second: later calls in the test ask the service again only if it expired
    engine.client._occupancy = None
    return engine


def _answered(engine: Engine, verb: str) -> None:
    """The control: with the fault gone, the same connection answers the verb and finds the stored chunks."""
    call, missing = CALLS[verb]
    engine.client._occupancy = None
    answer = call(engine.client)
    if verb in ("lookup", "presence", "prepare_load", "occupancy", "location", "chunks"):
        assert answer != missing and not (isinstance(answer, str) and answer.startswith(missing)), (verb, answer)
    assert engine.client.lookup("again", KEYS).ready_chunks == 2
    engine.client.release("again")
    assert engine.client.counters[Metric.NODE_CACHE_DISCONNECTS] == 0  # a bad reply is no reason to reattach


def _check_miss(verb: str, answer: Any) -> None:
    _, missing = CALLS[verb]
    if verb == "prepare_load":
        assert isinstance(answer, str) and answer.startswith("refused: ") and "gave no load" in answer, answer
    else:
        assert answer == missing, (verb, answer)


@pytest.mark.parametrize("verb", sorted(CALLS))
def test_an_error_reply_to_any_verb_is_a_counted_miss_and_the_connection_keeps_serving(start_node, monkeypatch,
                                                                                       verb: str) -> None:
    engine = _engine(start_node)

    def broken(*arguments: Any) -> Any:
        raise KeyError("injected: an index bug")  # the service answers ("error", ...) as for any failed check

    with monkeypatch.context() as patch:
        patch.setitem(service_module.VERBS, verb, broken)
        call, _ = CALLS[verb]
        _check_miss(verb, call(engine.client))
    assert engine.client.counters[Metric.NODE_CACHE_ERROR_REPLIES] == 1
    assert engine.client.counters[Metric.NODE_CACHE_MALFORMED_REPLIES] == 0
    _answered(engine, verb)


@pytest.mark.parametrize("shape", sorted(MALFORMED))
@pytest.mark.parametrize("verb", sorted(CALLS))
def test_a_malformed_reply_to_any_verb_is_a_counted_miss_and_the_connection_keeps_serving(start_node, monkeypatch,
                                                                                          verb: str,
                                                                                          shape: str) -> None:
    engine = _engine(start_node)
    answer = NodeCacheService._answer

    def malformed(self: NodeCacheService, pool: Any, lease: Any, request: Any) -> Any:
        reply = answer(self, pool, lease, request)
        return MALFORMED[shape](reply) if request[0] == verb and reply is not None else reply

    with monkeypatch.context() as patch:
        patch.setattr(NodeCacheService, "_answer", malformed)
        call, _ = CALLS[verb]
        _check_miss(verb, call(engine.client))
    assert engine.client.counters[Metric.NODE_CACHE_MALFORMED_REPLIES] == 1
    assert engine.client.counters[Metric.NODE_CACHE_ERROR_REPLIES] == 0
    _answered(engine, verb)


def test_moves_naming_chunks_or_slots_the_engine_never_asked_for_are_malformed(start_node, monkeypatch) -> None:
    """A store's (command id, slot, chunk number, hash) must name a hash asked for and a slot of the pool: anything
    else would be a KeyError in the client or a write beyond the arena."""
    engine = _engine(start_node, slots=8)  # room for the stores the client dropped (their slots stay being written)
    answer = NodeCacheService._answer
    wrong = {"hash": lambda move: (*move[:3], b"another chunk"), "slot": lambda move: (move[0], 8, *move[2:])}
    for number, (what, change) in enumerate(wrong.items(), start=10):
        with monkeypatch.context() as patch:
            patch.setattr(NodeCacheService, "_answer", lambda self, pool, lease, request: (
                lambda reply: ("ok", [change(m) for m in reply[1]], *reply[2:]) if request[0] == "prepare_store"
                else reply)(answer(self, pool, lease, request)))
            assert engine.client.prepare_store(what, [(number, keys_of(number, 1)[0])]) == [], what
    assert engine.client.counters[Metric.NODE_CACHE_MALFORMED_REPLIES] == 2
    assert len(engine.client.prepare_store("fine", [(8, keys_of(8, 1)[0])])) == 1  # control: the true reply is taken


def test_a_strict_client_raises_what_the_service_answered(start_node, monkeypatch) -> None:
    node = start_node(store_config(4, WORLD))
    strict = node.client("strict", geometry(WORLD), strict=True)
    engine = node.engine("A", geometry(WORLD))

    def broken(*arguments: Any) -> Any:
        raise KeyError("injected")

    monkeypatch.setitem(service_module.VERBS, Verb.LOOKUP, broken)
    with pytest.raises(ValueError, match="lookup: it answered an error: lookup: 'injected'"):
        strict.lookup("q", KEYS)
    assert engine.client.lookup("q", KEYS) == LookupResult(0, 0)  # control: the same fault, an engine's miss


def test_occupancy_without_a_tier_and_a_malformed_attached_are_refused(start_node, monkeypatch) -> None:
    """The gauges read both tiers of an occupancy, and an Attached's sizes build the engine's arena and gauges: one
    missing or of the wrong type is malformed (before, a KeyError in vLLM's stats or a TypeError at start-up)."""
    engine = _engine(start_node)
    answer = NodeCacheService._answer
    with monkeypatch.context() as patch:
        patch.setattr(NodeCacheService, "_answer", lambda self, pool, lease, request: (
            lambda reply: ("ok", {Tier.ARENA: reply[1][Tier.ARENA]}, *reply[2:]) if request[0] == "occupancy"
            else reply)(answer(self, pool, lease, request)))
        assert engine.client.occupancy() == CALLS["occupancy"][1]
    assert engine.client.counters[Metric.NODE_CACHE_MALFORMED_REPLIES] == 1
    node = start_node(store_config(4, WORLD))
    attached = NodePool.attached
    monkeypatch.setattr(NodePool, "attached", lambda pool: dataclasses.replace(attached(pool), num_slots="4"))
    refused = node.client("B", geometry(WORLD))  # an engine starts anyway: unattached, the refusal counted and said
    assert refused.epoch is None and refused.counters[Metric.NODE_CACHE_REFUSED] >= 1
    assert "malformed Attached" in refused._refusal
    monkeypatch.undo()
    assert node.client("C", geometry(WORLD)).num_slots == 4  # the control: the true Attached is taken
