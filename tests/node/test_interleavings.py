"""Two engines' verbs in any interleaving through the node cache answer exactly as one in-process `ChunkIndex` of
the same size and policy answers the same verbs with engine-scoped request ids: lookups, stores (slots included),
loads and their refusals, releases, failed stores, and what the index holds at the end. The node adds transport, not
behaviour."""

from __future__ import annotations

import shutil
from typing import Any, Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.node import verbs as verbs_module
from lmcache_npu.node.pool import scoped
from lmcache_npu.store.commands import Completion
from lmcache_npu.store.index.chunk_index import ChunkIndex

from .harness import Node, keys_of, short_dir, store_config, sync

SLOTS, WORLD = 4, 2
KEYS = keys_of(0, 6)
ENGINES = ("A", "B")

operation = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(ENGINES), st.sampled_from("rs"),
              st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=3, unique=True), st.booleans()),
    st.tuples(st.just("lookup"), st.sampled_from(ENGINES), st.sampled_from("rs"),
              st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4, unique=True)),
    st.tuples(st.just("load"), st.sampled_from(ENGINES), st.sampled_from("rs"), st.integers(1, 3)),
    st.tuples(st.just("release"), st.sampled_from(ENGINES), st.sampled_from("rs")),
)


class Reference:
    """The same verbs on one ChunkIndex, request ids scoped by engine as the node scopes them."""

    def __init__(self) -> None:
        self.index = ChunkIndex(SLOTS, WORLD, eviction_policy="arc")

    def run(self, op: tuple) -> Any:
        kind, request = op[0], scoped(op[1], op[2])
        if kind == "store":
            stores = self.index.prepare_store(request, [(i, KEYS[i]) for i in op[3]])
            self.index.take_commands()
            self.index.on_completions([Completion(c.cmd_id, rank, op[4] or rank == 0) for c in stores
                                       for rank in range(WORLD)])
            return [(c.slot, c.chunk_index, c.key) for c in stores]
        if kind == "lookup":
            return self.index.lookup(request, [KEYS[i] for i in op[3]])
        if kind == "load":
            try:
                loads = self.index.prepare_load(request, [(i, KEYS[i]) for i in range(op[3])])
            except ValueError:
                return "refused"
            self.index.take_commands()
            self.index.on_completions([Completion(c.cmd_id, rank, True) for c in loads for rank in range(WORLD)])
            return [(c.slot, c.chunk_index, c.key) for c in loads]
        self.index.release(request)
        return None


def run_on_node(node: Node, engines: dict, op: tuple) -> Any:
    kind, client, request = op[0], engines[op[1]], op[2]
    if kind == "store":
        stores = client.prepare_store(request, [(i, KEYS[i]) for i in op[3]])
        client.take_commands()
        client.on_completions([Completion(c.cmd_id, rank, op[4] or rank == 0) for c in stores
                               for rank in range(WORLD)])
        sync(client)  # answers are one-way: the other engine's next verb must come after them
        return [(c.slot, c.chunk_index, c.key) for c in stores]
    if kind == "lookup":
        return client.lookup(request, [KEYS[i] for i in op[3]])
    if kind == "load":
        try:
            loads = client.prepare_load(request, [(i, KEYS[i]) for i in range(op[3])])
        except ValueError:
            return "refused"
        client.take_commands()
        client.on_completions([Completion(c.cmd_id, rank, True) for c in loads for rank in range(WORLD)])
        sync(client)
        return [(c.slot, c.chunk_index, c.key) for c in loads]
    client.release(request)
    sync(client)
    return None


def first_difference(operations: list[tuple]) -> Optional[str]:
    """Runs `operations` on a fresh node and on the reference; the first way they differ (None: none)."""
    directory = short_dir()
    node = Node(directory, store_config(SLOTS, WORLD))
    try:
        engines = {name: node.client(name) for name in ENGINES}
        reference = Reference()
        for step, op in enumerate(operations):
            expected, got = reference.run(op), run_on_node(node, engines, op)
            if got != expected:
                return f"step {step} {op}: node {got}, in-process {expected}"
        held = {(view.key, view.slot, view.slot_state, view.readers, view.reservations) for view in
                node.pool.index.chunks()}
        wanted = {(view.key, view.slot, view.slot_state, view.readers, view.reservations)
                  for view in reference.index.chunks()}
        if held != wanted:
            return f"at the end the node holds {sorted(map(str, held ^ wanted))} differently"
        if node.pool.index.occupancy() != reference.index.occupancy():
            return "occupancy differs"
        return None
    finally:
        node.close()
        shutil.rmtree(directory, ignore_errors=True)


@settings(max_examples=60)
@given(st.lists(operation, min_size=1, max_size=25))
def test_two_engines_interleaved_through_the_node_answer_as_one_index(operations):
    assert first_difference(operations) is None


def test_negative_control_a_node_that_does_not_scope_request_ids_is_caught(monkeypatch):
    story = [("store", "A", "r", [0], True), ("lookup", "A", "r", [0]), ("release", "B", "r"),
             ("lookup", "B", "s", [1])]
    assert first_difference(story) is None  # control: the real node keeps A's reservation through B's release
    monkeypatch.setattr(verbs_module, "scoped", lambda engine, request_id: request_id)
    difference = first_difference(story)  # requests of both engines meet in the index (and lose their engine)
    assert difference is not None and difference.startswith("step 1 ('lookup', 'A', 'r', [0]): node LookupResult(")
