"""Everything an engine holds is a lease on its connections: an engine process killed with SIGKILL (no goodbye, no
release) gives back its reservations, its pinned (READING) slots and its half-written (WRITING) slots, and its
unanswered commands fail, so another engine can use those slots. The lease lasts while any of the engine's
connections (its scheduler's or a worker's) is open. A pool that never ends leases is caught by the same stale-lease
detector (`harness.wait_released`): the negative control."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from lmcache_npu.node.pool import NodePool
from lmcache_npu.store.index import slots as slots_module
from lmcache_npu.store.index.contract import SlotState
from lmcache_npu.store.metrics import Metric

from .harness import Node, engine_holdings, geometry, keys_of, store_config, wait_for, wait_released

ROOT = Path(__file__).resolve().parents[2]
ONE_RANK = geometry(world=1)


class Child:
    """tests/node/crash_engine.py running as engine `engine`; what it reported holding once ready."""

    def __init__(self, node: Node, engine: str) -> None:
        self.engine = engine
        self.ready = os.path.join(node.directory, f"{engine}.json")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.node.crash_engine", node.path, self.ready,
                                         engine], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: os.path.exists(self.ready) or self.process.poll() is not None, "the engine process to attach")
        if self.process.poll() is not None:
            raise AssertionError(f"the engine process exited {self.process.returncode}: "
                                 f"{self.process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        with open(self.ready) as file:
            self.state = json.load(file)
        self.cmd_ids = [cmd_id for cmd_id, _ in self.state["loads"] + self.state["stores"]]
        self.slots = [slot for _, slot in self.state["loads"] + self.state["stores"]]

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stdout.close()  # type: ignore[union-attr]
        self.process.stderr.close()  # type: ignore[union-attr]


def kinds(held: list[str]) -> dict[str, int]:
    """How many of each kind of thing the detector reported (the first word after "the")."""
    out: dict[str, int] = {}
    for line in held:
        word = line.split()[1] if line.startswith("the ") else line.split()[0]
        out[word] = out.get(word, 0) + 1
    return out


@pytest.fixture
def node_with_chunks(start_node) -> Iterator[Node]:
    """A node of 6 slots whose chunks 0-2 engine P stored (the child pins them)."""
    node = start_node(store_config(6, 1))
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 3))
    yield node


def test_a_killed_engine_process_gives_back_everything_and_its_slots_are_usable(node_with_chunks, monkeypatch):
    monkeypatch.setattr(slots_module, "QUARANTINE_S", 0.05)
    node = node_with_chunks
    index = node.pool.index
    before = index.counters.snapshot()
    child = Child(node, "doomed")
    assert child.state["ready_chunks"] == 3 and len(child.state["loads"]) == 2 and len(child.state["stores"]) == 2
    states = {view.slot: (view.slot_state, view.readers) for view in index.chunks()}
    assert [states[slot] for _, slot in child.state["loads"]] == [(SlotState.READING, 1)] * 2  # pinned by loads
    assert [states[slot][0] for _, slot in child.state["stores"]] == [SlotState.WRITING] * 2
    # control: the detector sees all a live engine holds (its lease, chunk 2's reservation, 4 slots, 4 commands)
    assert kinds(engine_holdings(node.service, "doomed", child.cmd_ids, child.slots)) == {
        "lease": 1, "reservations": 1, "slot": 4, "command": 4}
    child.kill()
    assert wait_released(node.service, "doomed", child.cmd_ids, child.slots) == []
    after = index.counters.snapshot()
    assert after.get(Metric.LEASES_ENDED, 0) - before.get(Metric.LEASES_ENDED, 0) == 1
    assert after.get(Metric.ABANDONED_COMMANDS, 0) - before.get(Metric.ABANDONED_COMMANDS, 0) == 4
    assert not any(view.readers or view.reservations or view.slot_state is SlotState.WRITING
                   for view in index.chunks())
    # another engine takes every slot: the two the child was writing (once out of quarantine), and the three it had
    # pinned (evicted now)
    time.sleep(0.1)
    stores = node.engine("Q", ONE_RANK).store("next", keys_of(20, 6))
    assert len(stores) == 6 and {c.slot for c in stores} == set(range(6))


def test_the_lease_lasts_while_any_connection_of_the_engine_is_open(node_with_chunks):
    node = node_with_chunks
    engine = node.engine("E", ONE_RANK)
    keys = keys_of(0, 3)
    assert engine.client.lookup("r", keys).ready_chunks == 3
    loads = engine.client.prepare_load("r", [(0, keys[0])])
    connections = node.service.connections
    engine.client.close()  # the scheduler's connection is gone; the worker's is still open
    wait_for(lambda: node.service.connections == connections - 1, "the service to see the scheduler leave")
    held = engine_holdings(node.service, "E", [loads[0].cmd_id], [loads[0].slot])
    assert held[0] == "the lease of engine E (1 connection(s))"
    assert kinds(held) == {"lease": 1, "reservations": 2, "slot": 1, "command": 1}  # nothing given back yet
    engine.workers[0].close()  # the last connection: now the lease ends
    assert wait_released(node.service, "E", [loads[0].cmd_id], [loads[0].slot]) == []


def test_negative_control_a_pool_that_never_ends_leases_is_caught_by_the_detector(node_with_chunks, monkeypatch):
    def keep_every_lease(self: NodePool, engine: str, connection: int) -> bool:
        lease = self.leases.get(engine)
        if lease is not None:
            lease.connections.discard(connection)
        return False

    monkeypatch.setattr(NodePool, "drop_connection", keep_every_lease)
    node = node_with_chunks
    child = Child(node, "doomed")
    connections = node.service.connections
    child.kill()
    wait_for(lambda: node.service.connections == connections - 2, "the service to see both connections close")
    held = wait_released(node.service, "doomed", child.cmd_ids, child.slots, timeout_s=0.5)
    assert held[0] == "the lease of engine doomed (0 connection(s))"
    assert kinds(held) == {"lease": 1, "reservations": 1, "slot": 4, "command": 4}


def test_a_dead_engines_half_written_slots_rest_before_another_engine_writes_them(start_node, monkeypatch):
    monkeypatch.setattr(slots_module, "QUARANTINE_S", 0.5, raising=False)
    node = start_node(store_config(4, 1))
    doomed = node.engine("doomed", ONE_RANK)
    stores = doomed.client.prepare_store("w", list(enumerate(keys_of(0, 2))))  # its worker may be mid-DMA
    doomed.client.take_commands()
    doomed.client.close()
    doomed.workers[0].close()
    assert wait_released(node.service, "doomed", [c.cmd_id for c in stores]) == []
    other = node.engine("other", ONE_RANK)
    first = other.store("a", keys_of(10, 4))
    assert sorted(c.slot for c in first) == [2, 3]  # a late write of the dead worker cannot land in a new chunk
    time.sleep(0.6)
    assert sorted(c.slot for c in other.store("b", keys_of(20, 2))) == [0, 1]  # then they serve again
    node.pool.index.check_invariants()
