"""A planned hand-over (`node-cache --take-over`) keeps the host cache warm: every chunk stays a hit with the very
bytes it had, the pool keeps its epoch, the workers keep their mappings (attached again, nothing mapped or
registered), and no second pool is made. A slot whose command was still running rests in quarantine, answers to
commands the successor never handed out change nothing, a byte changed after the seal is never served (the negative
control), a successor whose configuration lays the arena out otherwise starts cold with a clear error, and a
successor that fails before it acknowledged leaves its predecessor serving."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

from lmcache_npu.node import wire
from lmcache_npu.node import worker_mapping as worker_mapping_module
from lmcache_npu.node.messages import HANDOVER, PROTOCOL_VERSION, Refused
from lmcache_npu.node.rebuild import ArenaRebuild
from lmcache_npu.node.worker_mapping import WorkerNodeMapping, handed_over, service_alive
from lmcache_npu.store import segments as segments_module
from lmcache_npu.store.commands import Completion
from lmcache_npu.store.envelope import Sealer, seal
from lmcache_npu.store.index import slots as slots_module
from lmcache_npu.store.index.contract import DiskState, SlotState
from lmcache_npu.store.metrics import Metric
from lmcache_npu.store.tier import TierCounters

from tests.store.fakes import chunk_payload

from .harness import (OBJECT_BYTES, WAIT_S, WEIGHTS, Engine, Node, check_invariants, expected_bytes, geometry,
                      keys_of, store_config, sync, wait_for)

WORLD = 2
SLOTS = 8


def segment_files() -> set[int]:
    """Inodes of the node cache's segment files this process maps or holds (services and workers alike)."""
    inodes = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/memfd:lmcache-npu-segment"):
                inodes.add(int(fields[4]))
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:lmcache-npu-segment"):
                inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return inodes


def counted(monkeypatch: Any, module: Any, name: str) -> list:
    """Every call of `module.name` from now on (it still runs)."""
    calls: list = []
    real: Callable = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


class Workers:
    """Rank after rank, a worker's mapping across epochs (as the connector's worker keeps it), joined to `lease`."""

    def __init__(self, node: Node, lease: str) -> None:
        self.counters = [TierCounters() for _ in range(WORLD)]
        self.mappings = [WorkerNodeMapping(node.path, "A", geometry(WORLD), rank, self.counters[rank],
                                           weights=WEIGHTS, pinned=False, retry_s=0.05) for rank in range(WORLD)]
        for mapped in self.mappings:
            mapped.start(WAIT_S)
            assert mapped.current is not None and mapped.join(lease)

    def attachments(self) -> list:
        return [mapped.current for mapped in self.mappings]

    def close(self) -> None:
        for mapped in self.mappings:
            mapped.close()


def attached_engine(node: Node) -> tuple[Engine, Workers]:
    client = node.client("A", retry_s=0.05)
    workers = Workers(node, client.lease)
    return Engine(client, workers.attachments()), workers


def test_a_hand_over_keeps_every_chunk_its_bytes_and_its_epoch_and_maps_nothing_again(start_node, monkeypatch):
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    engine, workers = attached_engine(node)
    client = engine.client
    keys = keys_of(0, 4)
    slots = {command.key: command.slot for command in engine.store("w", keys)}
    before = {key: [bytes(arena.slot_array(slot)) for arena in node.pool.arenas] for key, slot in slots.items()}
    epoch, token, files = node.pool.epoch, client.lease, segment_files()
    made = counted(monkeypatch, segments_module, "create_shared")
    mapped = counted(monkeypatch, worker_mapping_module, "map_worker_arena")

    successor = start_node(store_config(SLOTS, WORLD), socket_name="s", take_over=True)
    pool = successor.pool
    # the predecessor sets handed_over right after its last word to the successor, which may already be serving
    assert node.service.handed_over.wait(WAIT_S) and pool.epoch == epoch
    assert pool.rebuild is not None and pool.rebuild.done.wait(WAIT_S)
    assert pool.rebuild.report.adopted == 4 and not pool.rebuild.report.rejected
    for rank, mapping in enumerate(workers.mappings):  # told the epoch lives on: attached again, nothing mapped
        wait_for(lambda: mapping.follow("", ()) is False and workers.counters[rank][Metric.NODE_REBINDS] == 1,
                 f"rank {rank} to attach to the successor")
        assert mapping.current is not None and mapping.epoch == epoch
    wait_for(lambda: client.lookup("again", keys).ready_chunks == 4, "the chunks to be hits on the successor")
    assert client.epoch == epoch and client.lease == token and client.counters[Metric.NODE_CACHE_RECONNECTS] == 1
    assert all(mapping.follow(epoch, ()) for mapping in workers.mappings)
    for key, slot in slots.items():  # the very slots, and the bytes in them
        assert pool.index.location(key) == (slot, SlotState.READY, DiskState.NONE)
        assert [bytes(arena.slot_array(slot)) for arena in pool.arenas] == before[key] == expected_bytes(key, WORLD)
    seen = engine.read(client.prepare_load("again", list(enumerate(keys))))
    assert seen == {key: before[key] for key in keys}
    assert made == [] and mapped == [] and segment_files() <= files  # no new pool, no worker mapped a byte again
    assert all(counters[Metric.EPOCH_CHANGES] == 0 for counters in workers.counters)
    assert pool.leases["A"].bound  # the workers presented the carried lease token: bound at their attach
    check_invariants(successor.service)
    workers.close()


class _Witness:
    """Stands for a service's `handed_over`: what every worker's connection held when it was set (the process of a
    `node-cache` exits on it, so each worker must have its notice by then)."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.seen: list = []
        self.event = threading.Event()

    def set(self) -> None:
        self.seen = [(service_alive(m.current.sock), handed_over(m.current.sock)) for m in self.workers.mappings]
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


def test_a_predecessor_says_it_handed_over_only_after_every_worker_was_told_and_the_successor_heard(start_node,
                                                                                                     caplog):
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    _, workers = attached_engine(node)
    witness, epoch = _Witness(workers), node.pool.epoch
    node.service.handed_over = witness
    with caplog.at_level(logging.WARNING, logger="lmcache_npu.node.handover"):
        start_node(store_config(SLOTS, WORLD), socket_name="s", take_over=True)
        assert witness.event.wait(WAIT_S)
    assert witness.seen == [(False, [epoch])] * WORLD  # told, and the connection ended
    assert not [r for r in caplog.records if "did not say it let go" in r.getMessage()]
    workers.close()


def test_a_command_running_at_the_hand_over_rests_its_slot_and_its_late_answer_changes_nothing(start_node,
                                                                                             monkeypatch):
    monkeypatch.setattr(slots_module, "QUARANTINE_S", 60.0)  # the rest outlasts this test on the slowest machine
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    engine, workers = attached_engine(node)
    client = engine.client
    done = keys_of(0, 2)
    engine.store("w", done)
    late = keys_of(5, 1)[0]
    (store,) = client.prepare_store("x", [(0, late)])
    client.take_commands()
    for rank, worker in enumerate(engine.workers):  # its bytes landed and a trailer names them: only the rule keeps it
        worker.arena.slot_array(store.slot)[:] = chunk_payload(late, rank, OBJECT_BYTES)
        seal(worker.arena.sealed_view(store.slot), late, rank, Sealer())
    high_water = node.pool.index.next_command_id

    successor = start_node(store_config(SLOTS, WORLD), socket_name="s", take_over=True, hand_over_drain_s=0.2)
    pool = successor.pool
    assert pool.rebuild is not None and pool.rebuild.done.wait(WAIT_S)
    assert pool.rebuild.report.torn == 1 and pool.index.counters[Metric.TORN_SLOTS] == 1
    assert pool.rebuild.report.adopted == 2 and pool.index.location(late)[0] is None
    wait_for(lambda: client.lookup("q", done).ready_chunks == 2, "the client to attach to the successor")
    client.on_completions([Completion(store.cmd_id, rank, True) for rank in range(WORLD)])  # the device finished
    sync(client)
    assert pool.index.counters[Metric.STALE_COMPLETIONS] == WORLD  # counted, and nothing else
    assert client.in_flight == 0 and client.lookup("q2", [late]).hit_chunks == 0
    fresh = client.prepare_store("y", [(i, key) for i, key in enumerate(keys_of(10, 5))])
    assert fresh and min(command.cmd_id for command in fresh) >= high_water
    assert store.slot not in {command.slot for command in fresh}  # resting: never handed out at once
    check_invariants(successor.service)
    workers.close()


def test_negative_control_a_byte_changed_after_the_seal_is_never_served(start_node, monkeypatch):
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    engine, workers = attached_engine(node)
    client = engine.client
    keys = keys_of(0, 2)
    slot = engine.store("w", keys)[0].slot
    real_start = ArenaRebuild.start

    def corrupt_then_start(rebuild: ArenaRebuild) -> None:
        rebuild.pool.arenas[1].slot_array(slot)[17] ^= 0x01  # after the predecessor sealed it, before the check
        real_start(rebuild)

    monkeypatch.setattr(ArenaRebuild, "start", corrupt_then_start)
    successor = start_node(store_config(SLOTS, WORLD), socket_name="s", take_over=True)
    pool = successor.pool
    assert pool.rebuild is not None and pool.rebuild.done.wait(WAIT_S)
    assert bytes(pool.arenas[1].slot_array(slot)) != expected_bytes(keys[0], WORLD)[1]  # the byte did change
    assert pool.rebuild.report.adopted == 1 and dict(pool.rebuild.report.rejected) == {"digest": 1}
    assert pool.index.counters[Metric.ADOPTION_REJECTED] == 1 and pool.index.location(keys[0])[0] is None
    wait_for(lambda: client.lookup("q", keys[1:]).ready_chunks == 1, "the client to attach to the successor")
    assert client.lookup("q", keys).hit_chunks == 0  # the changed chunk is a miss, so its prefix is
    workers.close()


def test_a_successor_laying_the_arena_out_otherwise_starts_cold_with_a_clear_error(start_node, caplog):
    caplog.set_level(logging.ERROR, logger="lmcache_npu.node")
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    engine, workers = attached_engine(node)
    keys = keys_of(0, 2)
    engine.store("w", keys)
    epoch = node.pool.epoch

    successor = start_node(store_config(2 * SLOTS, WORLD), socket_name="s", take_over=True)  # twice the slots
    assert node.service.handed_over.wait(WAIT_S) and successor.service.pools == {}
    assert "is not adopted" in caplog.text and "starts cold" in caplog.text and f"{SLOTS} slots" in caplog.text
    client = engine.client
    wait_for(lambda: client.lookup("q", keys) is not None and client.epoch is not None, "a new pool")
    assert client.epoch != epoch and client.lookup("q", keys).hit_chunks == 0  # never a hit of the old pages
    workers.close()


def test_taking_over_from_nobody_is_a_cold_start(start_node):
    successor = start_node(store_config(SLOTS, WORLD), socket_name="s", take_over=True)
    assert successor.service.serving and successor.service.pools == {}
    assert successor.client("A").epoch is not None


def test_a_successor_that_never_acknowledges_leaves_its_predecessor_serving(start_node):
    node = start_node(store_config(SLOTS, WORLD), socket_name="s")
    engine, workers = attached_engine(node)
    keys = keys_of(0, 2)
    engine.store("w", keys)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as refused:  # another release asks: told why not
        refused.connect(node.path)
        wire.send(refused, (HANDOVER, PROTOCOL_VERSION + 1, 1.0))
        answer, _ = wire.receive_with_fds(refused)
        assert isinstance(answer, Refused) and "protocol" in answer.reason
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quitter:
        quitter.connect(node.path)
        wire.send(quitter, (HANDOVER, PROTOCOL_VERSION, 0.5))
        state, fds = wire.receive_with_fds(quitter)  # the state came; it goes away before taking the descriptors
        assert state[0] == "handover-state" and fds == []
    wait_for(lambda: engine.client.lookup("q", keys).ready_chunks == 2, "the predecessor to serve again")
    assert not node.service.handed_over.is_set() and node.client("B").epoch == node.pool.epoch
    workers.close()


def test_a_hand_over_with_a_disk_tier_keeps_the_arena_and_readopts_the_files(start_node, node_dir):
    disk = {"disk_path": os.path.join(node_dir, "kv"), "disk_bytes": 1 << 20, "disk_write_through": True}
    node = start_node(store_config(SLOTS, WORLD, **disk), socket_name="s")
    engine, workers = attached_engine(node)
    keys = keys_of(0, 3)
    engine.store("w", keys)
    wait_for(lambda: all(node.pool.index.location(key)[2] is DiskState.PRESENT for key in keys), "the disk copies")

    successor = start_node(store_config(SLOTS, WORLD, **disk), socket_name="s", take_over=True)
    pool = successor.pool  # made: the predecessor let go of the directory's lock before the successor took it
    assert pool.rebuild is not None and pool.rebuild.done.wait(WAIT_S) and pool.rebuild.report.adopted == 3
    for key in keys:  # in the arena (adopted) and on disk (found as on any start)
        assert pool.index.location(key)[1:] == (SlotState.READY, DiskState.PRESENT)
    wait_for(lambda: engine.client.lookup("q", keys).ready_chunks == 3, "the client to attach to the successor")
    workers.close()
