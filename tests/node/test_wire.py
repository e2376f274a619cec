"""The hot verbs (a step's lookups, stores, loads and answers) cross the socket as builtins only: keys as one
namespace and a list of chunk hashes, commands and answers as tuples. Pickling a 128K-token prompt's 512 named
tuples cost about a millisecond per lookup (bench-scheduler); a list of bytes pickles in microseconds. Every
request the client sends in an engine's step is checked for class references; the old shape (keys as ChunkKeys)
is the negative control."""

from __future__ import annotations

import pickletools
from typing import Any

from lmcache_npu.node import wire

from .harness import keys_of, store_config

HOT = {"lookup", "presence", "prepare_load", "prepare_store", "release", "on_completions"}


def classes_named(message: Any) -> set[str]:
    """The classes a message's pickle refers to (what an unpickler must look up and call)."""
    named, strings = set(), []
    for opcode, argument, _ in pickletools.genops(wire.encode(message)[4:]):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(argument)
        elif opcode.name == "STACK_GLOBAL":
            named.add(".".join(strings[-2:]))
        elif opcode.name == "GLOBAL":
            named.add(argument.replace(" ", "."))
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
