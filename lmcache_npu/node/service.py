"""The node cache service (`lmcache-npu node-cache`): one per node, it owns the node's host cache, disk tier and
Mooncake client, and every engine on the node uses it through a Unix socket.

Security: the socket is created mode 0600 (0660 with `group`), every peer's credentials are checked with
`SO_PEERCRED` (this uid, or with `group` that primary gid: a supplementary membership opens the socket but does
not pass), and the shared segments are memory files in no filesystem, reachable only through descriptors this
service hands to checked peers. Messages are allow-listed pickles (wire.py).
Engines attach with their pool geometry; each geometry gets a pool (`pool.py`), up to `max_pools`, each an equal
share of `cpu_bytes` and `disk_bytes`. One lock serialises the verbs: they are index operations of microseconds.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any, Callable, Optional

from ..store.commands import Completion, Tier
from ..store.config import StoreConfig
from ..store.index.contract import ChunkView
from ..store.keys import ChunkKey
from ..store.metrics import Metric
from . import wire
from .exporter import MetricsServer, exposition
from .messages import Attach, PoolGeometry, Refused
from .pool import COMMAND_TTL_S, EngineLease, NodePool, PoolRefused, scoped

logger = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# the engine does not wait for these: their counters ride the next reply
ONEWAY = frozenset({"release", "on_completions", "describe"})
_new_key = partial(tuple.__new__, ChunkKey)  # ChunkKey(namespace, hash) without its Python-level __new__
HIT_CHUNKS = {Tier.ARENA: Metric.HIT_CHUNKS_CPU, Tier.DISK: Metric.HIT_CHUNKS_DISK,
              Tier.REMOTE: Metric.HIT_CHUNKS_REMOTE}


@dataclass(frozen=True)
class ServiceOptions:
    """`store`: the node's tiers (cpu_bytes and disk_bytes for the whole node, all pools and ranks together)."""

    socket_path: str
    store: StoreConfig
    max_pools: int = 1
    group: Optional[str] = None  # a group (name or numeric gid) whose processes may attach too (socket 0660)
    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    command_ttl_s: float = COMMAND_TTL_S  # a device command unanswered this long fails (its slot or pin freed)


class NodeCacheService:
    def __init__(self, options: ServiceOptions) -> None:
        if options.max_pools < 1:
            raise ValueError(f"max_pools must be at least 1, got {options.max_pools}")
        self.options = options
        self.instance = secrets.token_hex(6)  # a restarted service is a new epoch for every engine
        self.lock = threading.RLock()
        self._pool_creation = threading.Lock()  # one pool is made at a time, outside `lock`
        self.pools: dict[PoolGeometry, NodePool] = {}
        self.refused_peers = 0
        self.connections = 0
        self.started_at = time.time()
        self._group_gid = group_id(options.group) if options.group else None
        self._next_connection = 0
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()  # live connections: closing the service ends them too
        self._listener = self._bind(options.socket_path)
        self._metrics: Optional[MetricsServer] = None
        if options.metrics_port is not None:
            self._metrics = MetricsServer(options.metrics_host, options.metrics_port, self.metrics_text)

    # ---- the socket -----------------------------------------------------------------------------------------------

    def _bind(self, path: str) -> socket.socket:
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise FileExistsError(f"{path} exists and is not a socket: refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # a dead service's socket
            else:
                raise FileExistsError(f"a node cache already serves {path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket exists with mode 0600 from its first moment
        try:
            listener.bind(path)
        finally:
            os.umask(old_umask)
        if self._group_gid is not None:
            os.chown(path, -1, self._group_gid)
            os.chmod(path, 0o660)
        listener.listen(64)
        return listener

    def start(self) -> "NodeCacheService":
        thread = threading.Thread(target=self.serve_forever, name="lmcache-node-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def serve_forever(self) -> None:
        logger.info("node cache: serving %s (%d B host memory, %d pool(s)%s)", self.options.socket_path,
                    self.options.store.cpu_bytes, self.options.max_pools,
                    f", disk {self.options.store.disk_path}" if self.options.store.disk_path else "")
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                raise
            if not self._peer_allowed(connection):
                connection.close()
                continue
            with self.lock:
                if self._closed.is_set():
                    connection.close()
                    return
                self._next_connection += 1
                number = self._next_connection
                self._open.add(connection)
            thread = threading.Thread(target=self._serve, args=(connection, number), daemon=True,
                                      name=f"lmcache-node-conn{number}")
            thread.start()

    def _peer_allowed(self, connection: socket.socket) -> bool:
        pid, uid, gid = _PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               _PEERCRED.size))
        if uid == os.getuid() or (self._group_gid is not None and gid == self._group_gid):
            return True
        self.refused_peers += 1
        logger.warning("node cache: refused a connection from pid %d (uid %d, gid %d): only uid %d%s may attach",
                       pid, uid, gid, os.getuid(), f" and group {self.options.group}" if self.options.group else "")
        return False

    # ---- one connection -------------------------------------------------------------------------------------------

    def _serve(self, connection: socket.socket, number: int) -> None:
        pool: Optional[NodePool] = None
        lease: Optional[EngineLease] = None
        try:
            attach = wire.receive(connection)
            if not isinstance(attach, Attach) or not isinstance(attach.geometry, PoolGeometry):
                wire.send(connection, Refused("the first message must be an Attach"))
                return
            try:
                pool = self._pool_for(attach.geometry)
                with self.lock:
                    fds = pool.segment_fds(attach.rank) if attach.rank is not None else []
                    lease = pool.lease(attach.engine, number, attach.events)
                    self.connections += 1
            except (PoolRefused, ValueError, TypeError, MemoryError, OSError) as exc:
                logger.warning("node cache: refused engine %s: %s", attach.engine, exc)
                wire.send(connection, Refused(str(exc)))
                return
            wire.send(connection, pool.attached(), fds)
            logger.info("node cache: engine %s %s attached (%s)", attach.engine,
                        "scheduler" if attach.rank is None else f"rank {attach.rank}", attach.geometry.describe())
            while True:
                request = wire.receive(connection)
                reply = self._answer(pool, lease, request)
                if reply is not None:
                    wire.send(connection, reply)
        except (ConnectionError, OSError) as exc:
            logger.debug("node cache: connection %d closed: %s", number, exc)
        except Exception:  # a bug must cost this connection (its lease ends below), never the service
            logger.exception("node cache: connection %d failed", number)
        finally:
            with self.lock:
                self._open.discard(connection)
                if pool is not None and lease is not None:
                    self.connections -= 1
                    if not self._closed.is_set():  # a closed service's pools are gone with every lease in them
                        pool.drop_connection(lease.engine, number)
            connection.close()

    def _pool_for(self, geometry: PoolGeometry) -> NodePool:
        """The geometry's pool, made on its first attach. Making one maps and pre-faults its memory (minutes for a
        large node): that happens outside the verbs' lock, so engines of other pools are served meanwhile."""
        with self._pool_creation:
            with self.lock:
                pool = self.pools.get(geometry)
            if pool is not None:
                return pool
            pool = self._new_pool(geometry)
            with self.lock:
                self.pools[geometry] = pool
            return pool

    def _new_pool(self, geometry: PoolGeometry) -> NodePool:
        _check_geometry(geometry)
        if len(self.pools) >= self.options.max_pools:
            held = "; ".join(g.describe() for g in self.pools)
            raise PoolRefused(f"the node cache holds {len(self.pools)} pool(s) (--max-pools {self.options.max_pools}): "
                              f"{held}; this engine's geometry ({geometry.describe()}) needs another. Start the "
                              "service with a larger --max-pools (each pool gets an equal share of --cpu-bytes)")
        pools = self.options.max_pools
        share = dataclasses.replace(self.options.store, cpu_bytes=self.options.store.cpu_bytes // pools,
                                    disk_bytes=self.options.store.disk_bytes // pools)
        return NodePool(geometry, share, f"{self.instance}/{len(self.pools)}", self.lock,
                        command_ttl_s=self.options.command_ttl_s)

    def _answer(self, pool: NodePool, lease: EngineLease, request: Any) -> Optional[tuple]:
        if not isinstance(request, tuple) or not request or not isinstance(request[0], str):
            return ("error", "ValueError", "a request is a tuple (verb, *arguments)")
        verb, arguments = request[0], request[1:]
        with self.lock:
            try:
                value = self._run(pool, lease, verb, arguments)
            except (ValueError, TypeError, KeyError, AssertionError) as exc:  # the peer's mistake, or a check failed
                if verb in ONEWAY:
                    logger.warning("node cache: engine %s: %s refused: %s", lease.engine, verb, exc)
                    return None
                return ("error", "ValueError", _unscoped(f"{verb}: {exc}", lease.engine))
            if verb in ONEWAY:
                return None
            counters = {str.__str__(name): amount for name, amount in lease.counters.items()}  # plain str on the wire
            lease.counters.clear()
            changes, lease.tier_changes = lease.tier_changes, []
            return ("ok", value, counters, changes)

    @staticmethod
    def _run(pool: NodePool, lease: EngineLease, verb: str, arguments: tuple) -> Any:
        handler = VERBS.get(verb)
        if handler is None:
            raise ValueError(f"unknown verb {verb!r} (this service speaks {', '.join(sorted(VERBS))})")
        return handler(pool, lease, *arguments)

    # ---- what operators see ---------------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        with self.lock:
            return exposition(self)

    @property
    def metrics_address(self) -> Optional[tuple[str, int]]:
        return self._metrics.address if self._metrics is not None else None

    def close(self) -> None:
        """Stops accepting, ends the live connections, closes the pools (their disk tiers flush) and removes the
        socket; once (a second call must not unlink a successor's socket of the same path)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._metrics is not None:
            self._metrics.close()
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
            for connection in self._open:  # an engine must see the service gone, not be answered by closed pools
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for pool in pools:
            pool.close()
        try:
            os.unlink(self.options.socket_path)
        except FileNotFoundError:
            pass


def group_id(group: str) -> int:
    """`--group`'s gid: a group of this host's /etc/group, or a number (a container's /etc/group rarely names the
    engines' group)."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isascii() and group.isdigit():
            return int(group)
        raise ValueError(f"--group {group!r} is neither a group of this host (/etc/group) nor a numeric gid") from None


# ---- checks of what a peer sent --------------------------------------------------------------------------------------

def _check_geometry(geometry: PoolGeometry) -> None:
    if not isinstance(geometry.namespace, str) or len(geometry.namespace) != 32:
        raise ValueError(f"a pool geometry's namespace must be 32 hex characters, got {geometry.namespace!r}")
    if not isinstance(geometry.layout_fingerprint, bytes):
        raise ValueError("a pool geometry's layout fingerprint must be bytes")
    for name in ("world", "object_bytes", "chunk_tokens"):
        value = getattr(geometry, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a pool geometry's {name} must be a positive integer, got {value!r}")


def _unscoped(text: str, engine: str) -> str:
    """`text` with the engine's scope taken off its request ids (as written and as repr() writes them)."""
    scope = scoped(engine, "")
    return text.replace(scope, "").replace(repr(scope)[1:-1], "")


def _as_seen_by(engine: str, view: ChunkView) -> ChunkView:
    """`view` as `engine` sees it: its own requests' reservations by the ids it gave, others' engine-scoped."""
    own = scoped(engine, "")
    names = frozenset(name[len(own):] if name.startswith(own) else name for name in view.reservations)
    return view if names == view.reservations else dataclasses.replace(view, reservations=names)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a request id must be a string, got {type(value).__name__}")
    return value


def _keys(keys: Any, namespace: str) -> list[ChunkKey]:
    if not isinstance(keys, (list, tuple)):
        raise ValueError(f"keys must be a list, got {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, ChunkKey) or not isinstance(key.chunk_hash, bytes):
            raise ValueError(f"a key must be a ChunkKey, got {key!r}")
        if key.namespace != namespace:  # another model's or layout's chunks never meet this pool's
            raise ValueError(f"key of namespace {key.namespace!r} sent to the pool of namespace {namespace!r}")
    return list(keys)


def _hashed(pool: NodePool, namespace: Any, hashes: Any) -> list[ChunkKey]:
    """The keys a batch names: its namespace, which must be the pool's, and its chunk hashes (messages.py)."""
    if namespace != pool.geometry.namespace:  # another model's or layout's chunks never meet this pool's
        raise ValueError(f"key of namespace {namespace!r} sent to the pool of namespace {pool.geometry.namespace!r}")
    if not isinstance(hashes, list) or not set(map(type, hashes)) <= {bytes}:  # map/set: C speed for 512 hashes
        raise ValueError(f"chunk hashes must be a list of bytes, got {_shape(hashes)}")
    return list(map(_new_key, zip(repeat(pool.geometry.namespace), hashes)))


def _numbered(pool: NodePool, namespace: Any, numbers: Any, hashes: Any) -> list[tuple[int, ChunkKey]]:
    keys = _hashed(pool, namespace, hashes)
    if (not isinstance(numbers, list) or len(numbers) != len(keys) or not set(map(type, numbers)) <= {int}
            or (numbers and min(numbers) < 0)):
        raise ValueError(f"chunk numbers must be a list of ints >= 0, one per hash ({len(keys)}), got "
                         f"{_shape(numbers)}")
    return list(zip(numbers, keys))


def _shape(value: Any) -> str:
    if not isinstance(value, list):
        return type(value).__name__
    return f"a list of {len(value)} ({', '.join(sorted({type(item).__name__ for item in value}))})"


def _payload(payload: Any, chunk_tokens: int) -> tuple:
    """A chunk's event payload as `ChunkPayload.to_plain` makes it: (block hashes, parent hash, token ids as int32
    bytes, LoRA id, LoRA name)."""
    if not isinstance(payload, tuple) or len(payload) != 5:
        raise ValueError("a chunk payload is (block hashes, parent hash, token bytes, lora id, lora name)")
    hashes, parent, token_bytes, lora_id, lora_name = payload
    if (not isinstance(hashes, tuple) or len(hashes) > chunk_tokens
            or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in hashes)):
        raise ValueError("a chunk payload's block hashes must be a tuple of ints or bytes, one per hash block")
    if parent is not None and (not isinstance(parent, (int, bytes)) or isinstance(parent, bool)):
        raise ValueError("a chunk payload's parent hash must be an int, bytes or None")
    if not isinstance(token_bytes, bytes) or len(token_bytes) != 4 * chunk_tokens:
        raise ValueError(f"a chunk payload's token ids must be {chunk_tokens} int32 values")
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
        raise ValueError("a chunk payload's LoRA id must be an int or None")
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError("a chunk payload's LoRA name must be a string or None")
    return payload


def _completions(completions: Any) -> list[Completion]:
    if not isinstance(completions, list):
        raise ValueError(f"completions must be a list, got {type(completions).__name__}")
    answers = []
    for done in completions:
        if (not isinstance(done, tuple) or len(done) != 4 or set(map(type, done[:2])) != {int}
                or type(done[2]) is not bool or not isinstance(done[3], str)):
            raise ValueError(f"a completion must be (command id, rank, ok, reason), got {done!r}")
        answers.append(Completion(*done))
    return answers


# ---- the verbs: handler(pool, lease, *arguments) -> the reply's value (messages.py says what each sends) ------------

def _lookup(pool: NodePool, lease: EngineLease, request_id: Any, namespace: Any, hashes: Any) -> Any:
    keys = _hashed(pool, namespace, hashes)
    name = scoped(lease.engine, _text(request_id))
    if name not in lease.requests:
        lease.requests.add(name)
        pool.lookup_counters[Metric.LOOKUPS] += 1
    found = pool.call(lease, lambda: pool.index.lookup(name, pool.visible(lease, keys)))
    for tier, metric in HIT_CHUNKS.items():  # per tier, for status's hit rates (tuple.count: C speed)
        pool.lookup_counters[metric] += found.sources.count(tier)
    return found


def _presence(pool: NodePool, lease: EngineLease, namespace: Any, hashes: Any, remote: Any) -> list[bool]:
    keys = _hashed(pool, namespace, hashes)
    # as lookup will see them: nothing from another engine's store in flight on
    visible = len(pool.visible(lease, keys, count=False))
    return pool.index.presence(keys[:visible], bool(remote)) + [False] * (len(keys) - visible)


def _prepare(verb: str) -> Callable[..., list[tuple[int, int, int, bytes]]]:
    def prepare(pool: NodePool, lease: EngineLease, request_id: Any, namespace: Any, numbers: Any,
                hashes: Any) -> list[tuple[int, int, int, bytes]]:
        chunks = _numbered(pool, namespace, numbers, hashes)
        name = scoped(lease.engine, _text(request_id))
        return pool.hand_out(lease, pool.call(lease, lambda: getattr(pool.index, verb)(name, chunks)))

    return prepare


def _release(pool: NodePool, lease: EngineLease, request_id: Any) -> None:
    name = scoped(lease.engine, _text(request_id))
    pool.call(lease, lambda: pool.index.release(name))
    lease.requests.discard(name)


VERBS: dict[str, Callable[..., Any]] = {
    "lookup": _lookup,
    "presence": _presence,
    "prepare_load": _prepare("prepare_load"),
    "prepare_store": _prepare("prepare_store"),
    "release": _release,
    "on_completions": lambda pool, lease, completions: pool.call(
        lease, lambda: pool.on_completions(lease, _completions(completions))),
    "events": lambda pool, lease, wanted: setattr(lease, "events", bool(wanted)),
    "describe": lambda pool, lease, key, payload: pool.describe(_keys([key], pool.geometry.namespace)[0],
                                                                _payload(payload, pool.geometry.chunk_tokens)),
    "check_invariants": lambda pool, lease: pool.index.check_invariants(),
    "sync": lambda pool, lease: None,  # nothing but the reply: the counters and tier changes of one-way calls
    "occupancy": lambda pool, lease: pool.index.occupancy(),
    "location": lambda pool, lease, key: pool.index.location(_keys([key], pool.geometry.namespace)[0]),
    "chunks": lambda pool, lease: [_as_seen_by(lease.engine, view) for view in pool.index.chunks()],
    "adopt_disk": lambda pool, lease, keys: pool.call(
        lease, lambda: pool.index.adopt_disk(_keys(keys, pool.geometry.namespace))),
    "drop_disk_copies": lambda pool, lease, keys: pool.call(
        lease, lambda: pool.index.drop_disk_copies(_keys(keys, pool.geometry.namespace))),
}
