"""The node cache's verbs are one `Verb` enum: each verb that mirrors a method of the manager the service serves
(`ChunkIndex`: the contract's verbs and defaults, its view, its restart adoption) bears that method's name, the verbs the client sends are exactly those the service serves (negative controls: a misspelt verb, a table
missing one), the closed encoding carries a verb as its plain string, and `check_invariants` is a test's helper
(harness.py), never a verb a peer may ask."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from enum import StrEnum

import pytest

from lmcache_npu.node import client as client_module
from lmcache_npu.node import codec
from lmcache_npu.node.messages import ONEWAY, Verb
from lmcache_npu.node.verbs import VERBS
from lmcache_npu.store.index.chunk_index import ChunkIndex

from .harness import check_invariants, geometry, keys_of, store_config

# the node cache's own verbs: no manager method of that name (describe feeds routers, events is
# set_tier_listener's switch)
OWN_VERBS = frozenset({Verb.DESCRIBE, Verb.EVENTS})


def misnamed(verbs: Iterable[str], manager: type, own: frozenset[str]) -> list[str]:
    """Verbs that break the naming rule: not one of `own` yet no method of `manager`, or one of `own` that is."""
    return sorted(verb for verb in verbs if (verb in own) == callable(getattr(manager, verb, None)))


def verbs_named(source: str) -> set[Verb]:
    """Every `Verb.NAME` a module's source names: the verbs its code sends."""
    return {Verb[node.attr] for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Verb"}


def uncovered(sent: Iterable[str], served: Iterable[str]) -> dict[str, list[str]]:
    """What one side has and the other lacks (empty lists: the two tables agree)."""
    sent, served = set(sent), set(served)
    return {"sent, never served": sorted(sent - served), "served, never sent": sorted(served - sent)}


def test_a_verb_that_mirrors_a_manager_method_bears_its_name() -> None:
    assert misnamed(Verb, ChunkIndex, OWN_VERBS) == []
    assert len(set(Verb) - OWN_VERBS) >= 10  # the rule checked something: lookup, prepare_load, ... are mirrors


def test_negative_control_a_misspelt_verb_or_an_own_verb_the_manager_has_is_found() -> None:
    misspelt = StrEnum("Misspelt", {"LOOKUP": "lookup", "PREPARE_LOADS": "prepare_loads", "DESCRIBE": "describe"})
    assert misnamed(misspelt, ChunkIndex, frozenset({"describe"})) == ["prepare_loads"]
    assert misnamed(misspelt, ChunkIndex, frozenset({"describe", "lookup"})) == ["lookup", "prepare_loads"]


def test_the_client_sends_exactly_the_verbs_the_service_serves() -> None:
    sent = verbs_named(inspect.getsource(client_module))
    assert uncovered(sent, VERBS) == {"sent, never served": [], "served, never sent": []}
    assert ONEWAY <= set(VERBS)


def test_negative_control_a_table_missing_a_verb_is_found() -> None:
    sent = verbs_named(inspect.getsource(client_module))
    fewer = {verb: handler for verb, handler in VERBS.items() if verb is not Verb.SYNC}
    assert uncovered(sent, fewer) == {"sent, never served": ["sync"], "served, never sent": []}
    assert uncovered(sent - {Verb.EVENTS}, VERBS) == {"sent, never served": [], "served, never sent": ["events"]}


def test_check_invariants_is_no_verb_of_the_service() -> None:
    assert "check_invariants" not in VERBS and "check_invariants" not in set(Verb)


@pytest.mark.parametrize("verb", list(Verb))
def test_the_closed_encoding_carries_a_verb_as_its_plain_string(verb: Verb) -> None:
    decoded = codec.decode(codec.encode((verb.value, "r")))
    assert decoded == (verb, "r") and type(decoded[0]) is str and Verb(decoded[0]) is verb


def test_negative_control_the_closed_encoding_refuses_the_enum_member_itself() -> None:
    with pytest.raises(TypeError, match="may not carry a lmcache_npu.node.messages.Verb"):
        codec.encode((Verb.LOOKUP, "r"))


def test_the_test_helper_check_invariants_finds_a_broken_index(start_node) -> None:
    node = start_node(store_config(4, 1))
    engine = node.engine("A", geometry(1))
    engine.store("r", keys_of(0, 2))
    check_invariants(node.service)  # control: the pool's bookkeeping agrees
    entry = next(iter(node.pool.index._entries.values()))
    entry.readers = -1  # a reader given back twice
    try:
        with pytest.raises(AssertionError):
            check_invariants(node.service)
    finally:
        entry.readers = 0
