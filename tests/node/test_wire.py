"""The hot verbs (a step's lookups, stores, loads and answers) cross the socket as builtins only: keys as one
namespace and a list of chunk hashes, commands and answers as tuples. Encoding a 128K-token prompt's 512 named
tuples cost about a millisecond per lookup (bench-scheduler); a list of bytes takes microseconds. Every request the
client sends in an engine's step is checked for values of a class of ours; the old shape (keys as ChunkKeys) is the
negative control."""

from __future__ import annotations

from typing import Any

from lmcache_npu.node import codec, wire

from .harness import keys_of, store_config

HOT = {"lookup", "presence", "prepare_load", "prepare_store", "release", "on_completions"}
BUILTINS = (type(None), bool, int, float, str, bytes, list, tuple, dict, set, frozenset)


def classes_named(message: Any) -> set[str]:
    """The classes other than builtins the message carries, as the service decodes it."""
    named: set[str] = set()

    def visit(value: Any) -> None:
        if type(value) not in BUILTINS:
            named.add(f"{type(value).__module__}.{type(value).__qualname__}")
        if isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.items():
                visit(item)

    visit(codec.decode(wire.encode(message)[4:]))
    return named


def test_an_engines_step_sends_builtins_only(start_node, monkeypatch):
    node = start_node(store_config(8, 2))
    engine = node.engine("A")
    sent: list[Any] = []
    original = wire.send

    def recording(sock, message, fds=()):
        sent.append(message)
        original(sock, message, fds)

    monkeypatch.setattr(wire, "send", recording)
    keys = keys_of(0, 4)
    engine.store("r", keys)
    assert engine.client.lookup("q", keys).ready_chunks == 4 and engine.client.presence(keys) == [True] * 4
    loads = engine.client.prepare_load("q", list(enumerate(keys)))
    engine.read(loads)
    engine.client.release("q")
    verbs = {message[0] for message in sent}
    assert verbs >= HOT
    assert {message[0]: classes_named(message) for message in sent if message[0] in HOT} == {verb: set()
                                                                                               for verb in verbs & HOT}


def test_negative_control_keys_as_named_tuples_are_seen():
    assert classes_named(("lookup", "q", keys_of(0, 2))) == {"lmcache_npu.store.keys.ChunkKey"}
