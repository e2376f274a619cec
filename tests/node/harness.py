"""A node cache service in this process with small arenas, and the engines that attach to it (scheduler clients and
worker mappings), for the node cache's tests: no vLLM, no device, sockets in a short directory under /tmp."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import pytest

from lmcache_npu.node.attachment import WorkerAttachment, attach_worker_arena
from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.node.messages import WEIGHTS_CONTENT, PoolGeometry
from lmcache_npu.node.pool import COMMAND_TTL_S, ENGINE_SEPARATOR, NodePool
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.commands import Completion, Load, Store
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.index.contract import ChunkManager, SlotState
from lmcache_npu.store.keys import ChunkKey

from tests.store.fakes import chunk_payload, make_key

NAMESPACE = "0" * 32  # tests.store.fakes.make_key's default
OBJECT_BYTES = 4096  # one page of KV per rank and chunk: a slot is two pages with its envelope
FINGERPRINT = b"node-test-layout"
WAIT_S = 20.0  # bounded waits for what another thread or process does (never a timing assertion)
WEIGHTS = WEIGHTS_CONTENT  # the test engines' weights are named by their content
SLOWED_TIMEOUT_S = 0.5  # the call timeout of a client whose next call a test slows down
SLOWED_CALL_S = 2.0  # how long that call takes in the service: well past the timeout above


def short_dir() -> str:
    """A fresh directory whose socket paths stay far below the 108 bytes a Unix socket address holds."""
    return tempfile.mkdtemp(prefix="lmcn-", dir="/tmp")


def geometry(world: int = 2, object_bytes: int = OBJECT_BYTES, namespace: str = NAMESPACE) -> PoolGeometry:
    return PoolGeometry(namespace, FINGERPRINT, world, object_bytes, 256)


@dataclass(frozen=True)
class NodeStore:
    """A service's sizes (the node's) and tier settings."""

    capacity: NodeCapacity
    tiers: StoreConfig


def store_config(slots: int, world: int, object_bytes: int = OBJECT_BYTES, pools: int = 1,
                 disk_path: Optional[str] = None, disk_bytes: int = 0, **extra: object) -> NodeStore:
    """A node of exactly `slots` slots per rank in each of `pools` pools of this geometry (pageable, no hugepages: a
    test arena of a few pages); `disk_bytes` is the node's (all pools and ranks)."""
    cpu_bytes = pools * slots * world * slot_bytes_for(object_bytes)
    return NodeStore(NodeCapacity(cpu_bytes, disk_path, disk_bytes),
                     StoreConfig(pinned=False, hugepages="off", **extra))  # type: ignore[arg-type]


def memfd_mapped(base: int, span: int) -> bool:
    """Whether a memory file (a node cache segment) is still mapped anywhere in [base, base + span) of this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(edge, 16) for edge in line.split()[0].split("-"))
            if low < base + span and high > base and "memfd:" in line:
                return True
    return False


def hold_registration(monkeypatch: Any) -> threading.Event:
    """Workers' mappings of node segments wait for the returned event (at most WAIT_S) before they register them, as
    a device registering every segment does (minutes per TiB)."""
    from lmcache_npu.node import attachment as attachment_module

    release = threading.Event()
    original = attachment_module.HostArena

    def slow_registration(*args: Any, **kwargs: Any) -> Any:
        release.wait(WAIT_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(attachment_module, "HostArena", slow_registration)
    return release


def slow_next_call(monkeypatch: Any, node: "Node", client: NodeCacheClient, verb: str) -> list[str]:
    """The pool's index answers the next `verb` after SLOWED_CALL_S (under the service's lock, as a stalled Mooncake
    check or log pipe would) and `client`'s connection times out after SLOWED_TIMEOUT_S, so its call counts the live
    service as lost; attaching again waits with the usual timeout. The list records that the slowdown happened."""
    index = node.pool.index
    real = getattr(index, verb)
    slowed: list[str] = []

    def slow(*arguments: Any) -> Any:
        if not slowed:
            slowed.append(verb)
            time.sleep(SLOWED_CALL_S)
        return real(*arguments)

    monkeypatch.setattr(index, verb, slow)
    assert client._sock is not None
    client._sock.settimeout(SLOWED_TIMEOUT_S)
    return slowed


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = WAIT_S) -> None:
    """Polls until `condition()` holds; an AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.005)


class SlowPools:
    """Pools of `namespace` take until `release` is set to make (a large pool pre-faulting); every pool made is
    counted per namespace and kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, namespace: str) -> None:
        self.began = threading.Event()
        self.release = threading.Event()
        self.made: Counter = Counter()
        self.pools: list[NodePool] = []
        original = NodePool.__init__

        def init(pool: NodePool, geo: Any, *args: Any, **kwargs: Any) -> None:
            self.made[geo.namespace] += 1
            if geo.namespace == namespace:
                self.began.set()
                self.release.wait(WAIT_S)
            original(pool, geo, *args, **kwargs)
            self.pools.append(pool)

        monkeypatch.setattr(NodePool, "__init__", init)


class Node:
    """One service on `directory`/s and everything attached to it; `close()` ends them all (attachments first)."""

    def __init__(self, directory: str, store: NodeStore, *, max_pools: int = 1, group: Optional[str] = None,
                 metrics_port: Optional[int] = None, socket_name: str = "s", pool_idle_s: Optional[float] = None,
                 lease_slot_share: float = 1.0, reservation_ttl_s: float = 120.0,
                 command_ttl_s: float = COMMAND_TTL_S, **restart: Any) -> None:
        """`lease_slot_share` 1.0: these pools of a few slots are shared by engines that each reserve most of them;
        the per-engine cap (0.25 by default) is tested on its own (test_tenancy.py). `restart`: the service's
        options of a warm restart (take_over, hand_over_drain_s, systemd_fd_store) and any other, e.g. metrics_host."""
        self.directory = directory
        self.path = os.path.join(directory, socket_name)
        idle = {} if pool_idle_s is None else {"pool_idle_s": pool_idle_s}
        self.service = NodeCacheService(ServiceOptions(self.path, store.capacity, store.tiers, max_pools=max_pools, group=group,
                                                       metrics_port=metrics_port, lease_slot_share=lease_slot_share,
                                                       reservation_ttl_s=reservation_ttl_s, command_ttl_s=command_ttl_s,
                                                       **idle, **restart)).start()
        self.clients: list[NodeCacheClient] = []
        self.workers: list[WorkerAttachment] = []

    def client(self, engine: str, geo: Optional[PoolGeometry] = None, **options: float) -> NodeCacheClient:
        client = NodeCacheClient(self.path, engine, geo or geometry(), weights=WEIGHTS, connect_timeout_s=5.0,
                                 **options)
        self.clients.append(client)
        return client

    def worker(self, engine: str, rank: int, geo: Optional[PoolGeometry] = None, lease: str = "") -> WorkerAttachment:
        """A worker's mapping; bound to the lease of token `lease` (its scheduler's), else to none yet."""
        attachment = attach_worker_arena(self.path, engine, geo or geometry(), rank, weights=WEIGHTS, pinned=False,
                                         timeout_s=5.0, lease=lease)
        self.workers.append(attachment)
        return attachment

    def engine(self, name: str, geo: Optional[PoolGeometry] = None) -> "Engine":
        """A whole engine: its scheduler's client and a worker mapping per rank, bound to its lease."""
        geo = geo or geometry()
        client = self.client(name, geo)
        return Engine(client, [self.worker(name, rank, geo, client.lease) for rank in range(geo.world)])

    @property
    def pool(self) -> NodePool:
        (pool,) = self.service.pools.values()
        return pool

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for worker in self.workers:
            worker.close()
            worker.arena.close()
        self.service.close()


class Engine:
    """An engine attached to the node: its scheduler half's client and its workers' mappings. Its workers move
    bytes the way a device would: a store writes the chunk's pattern into this engine's mapping of the slot."""

    def __init__(self, client: NodeCacheClient, workers: Sequence[WorkerAttachment]) -> None:
        self.client = client
        self.workers = list(workers)

    def store(self, request_id: str, keys: Sequence[ChunkKey], first: int = 0) -> list[Store]:
        """Stores `keys` (chunk numbers from `first`): every rank writes its pattern and answers."""
        stores = self.client.prepare_store(request_id, [(first + i, key) for i, key in enumerate(keys)])
        self.client.take_commands()
        for command in stores:
            for rank, worker in enumerate(self.workers):
                worker.arena.slot_array(command.slot)[:] = chunk_payload(command.key, rank, worker.arena.object_bytes)
        answer(self.client, stores, range(len(self.workers)))
        sync(self.client)
        return stores

    def read(self, loads: Sequence[Load]) -> dict[ChunkKey, list[bytes]]:
        """What each rank's mapping holds in the loads' slots (a device would copy these bytes), then answered."""
        seen = {command.key: [bytes(worker.arena.slot_array(command.slot)) for worker in self.workers]
                for command in loads}
        answer(self.client, loads, range(len(self.workers)))
        sync(self.client)
        return seen


def answer(manager: ChunkManager, commands: Iterable, ranks: Iterable[int], ok: bool = True) -> None:
    manager.on_completions([Completion(c.cmd_id, rank, ok, "" if ok else "device: test") for c in commands
                            for rank in ranks])


def check_invariants(service: NodeCacheService) -> None:
    """Every pool of `service` checks its index's bookkeeping, under the service's lock as a verb runs (a test's
    question: the service serves no verb for it)."""
    with service.lock:
        for pool in service.pools.values():
            pool.index.check_invariants()


def sync(client: NodeCacheClient) -> None:
    """One round trip: the service has handled every one-way message this client sent before (release, answers),
    which another engine's connection may otherwise overtake."""
    client.presence([])


def expected_bytes(key: ChunkKey, world: int, object_bytes: int = OBJECT_BYTES) -> list[bytes]:
    return [chunk_payload(key, rank, object_bytes).tobytes() for rank in range(world)]


def keys_of(first: int, count: int, namespace: str = NAMESPACE) -> list[ChunkKey]:
    return [make_key(i, namespace) for i in range(first, first + count)]


def engine_holdings(service: NodeCacheService, engine: str, cmd_ids: Sequence[int] = (),
                    slots: Sequence[int] = ()) -> list[str]:
    """What `engine` still holds in the service (empty when nothing): its lease, reservations scoped to it, its
    commands `cmd_ids` still pending, and `slots` (the ones its commands used) still WRITING or read."""
    held = []
    scope = f"{engine}{ENGINE_SEPARATOR}"
    with service.lock:
        for pool in service.pools.values():
            if engine in pool.leases:
                held.append(f"the lease of engine {engine} ({len(pool.leases[engine].connections)} connection(s))")
            views = pool.index.chunks()
            for view in views:
                mine = sorted(name for name in view.reservations if name.startswith(scope))
                if mine:
                    held.append(f"reservations {mine} of chunk {view.key.chunk_hash.hex()[:8]}")
                if view.slot in slots and (view.slot_state is SlotState.WRITING or view.readers):
                    held.append(f"slot {view.slot} {view.slot_state.value} with {view.readers} reader(s)")
            held += [f"command {cmd_id} pending" for cmd_id in cmd_ids if pool.index.is_pending(cmd_id)]
    return held


def wait_released(service: NodeCacheService, engine: str, cmd_ids: Sequence[int] = (), slots: Sequence[int] = (),
                  timeout_s: float = WAIT_S) -> list[str]:
    """The stale-lease detector: waits (bounded) until `engine` holds nothing; what it still holds then."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = engine_holdings(service, engine, cmd_ids, slots)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


class NodeManagers:
    """The contract's factory for the node cache: each call starts a service holding exactly `slots` slots per rank
    and returns a client attached to it; `close()` ends every service it started."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.directories: list[str] = []

    def __call__(self, slots: int, ranks: int) -> ChunkManager:
        directory = short_dir()
        self.directories.append(directory)
        node = Node(directory, store_config(slots, ranks))
        self.nodes.append(node)
        client = node.client("contract", geometry(ranks))
        assert client.num_slots == slots, f"the pool holds {client.num_slots} slots, the test asked for {slots}"
        return client

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)
        self.nodes.clear()
        self.directories.clear()


def half_written(start_node: Callable[..., Any], world: int) -> tuple[Any, Any, Any, list[ChunkKey], list]:
    """Engine A's three stores handed out with their bytes in its ranks' slots, chunk 0 committed on every rank, 1
    and 2 on rank 0 only (still being written); B is a second engine of the pool. (node, a, b, keys, stores)."""
    node = start_node(store_config(8, world))
    a, b = node.engine("A"), node.engine("B")
    keys = keys_of(0, 3)
    stores = a.client.prepare_store("a-1", list(enumerate(keys)))
    a.client.take_commands()
    for command in stores:
        for rank, worker in enumerate(a.workers):
            worker.arena.slot_array(command.slot)[:] = chunk_payload(command.key, rank, worker.arena.object_bytes)
    answer(a.client, stores[:1], range(world))
    answer(a.client, stores[1:], [0])
    sync(a.client)
    return node, a, b, keys, stores

