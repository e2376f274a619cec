"""The node cache service (`lmcache-npu node-cache`): one per node, it owns the node's host cache, disk tier and
Mooncake client, and every engine on the node uses it through a Unix socket.

Security: the socket is created mode 0600 (0660 with `group`), every peer's credentials are checked with
`SO_PEERCRED` (this uid, or with `group` that primary gid: a supplementary membership opens the socket but does
not pass), and the shared segments are memory files in no filesystem, reachable only through descriptors this
service hands to checked peers. Peers' messages are of a closed encoding (codec.py, wire.py).
Engines attach with their pool geometry; each geometry gets a pool (`pool.py`), up to `max_pools`, each an equal
share of `cpu_bytes` and `disk_bytes`; a pool no engine holds is given back after `pool_idle_s` or when a new
geometry needs its place (`pool_table.py`). One lock serialises the verbs: they are index operations; Mooncake
existence checks, log lines and metrics formatting run outside it.
"""

from __future__ import annotations

import dataclasses
import grp
import importlib.metadata
import json
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from functools import cache, partial
from itertools import repeat
from typing import Any, Callable, Optional

from ..store.commands import Completion, Tier
from ..store.config import StoreConfig
from ..store.index.contract import ChunkView
from ..store.keys import ChunkKey
from ..store.metrics import Metric
from . import codec, wire
from .exporter import MetricsServer, exposition
from .messages import NAMED_WEIGHTS, PROTOCOL_VERSION, Attach, PoolGeometry, Refused, protocol_of
from .pool import COMMAND_TTL_S, ENGINE_SEPARATOR, EngineLease, LeaseLimits, NodePool, PoolRefused, scoped
from .pool_table import PoolTable

logger = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# the engine does not wait for these: their counters ride the next reply
ONEWAY = frozenset({"release", "on_completions", "describe"})
_new_key = partial(tuple.__new__, ChunkKey)  # ChunkKey(namespace, hash) without its Python-level __new__
HIT_CHUNKS = {Tier.ARENA: Metric.HIT_CHUNKS_CPU, Tier.DISK: Metric.HIT_CHUNKS_DISK,
              Tier.REMOTE: Metric.HIT_CHUNKS_REMOTE}
WEDGED_AFTER_S = 60.0  # a pool's pump has not had the lock this long: a verb hangs, /healthz says so
MAX_CONNECTIONS = 4096  # open at once (a DP=16 TP=8 node holds 144); each costs a thread
FIRST_MESSAGE_S = 10.0  # a connection's Attach (or ping) must arrive within this


@dataclass(frozen=True)
class ServiceOptions:
    """`store`: the node's tiers (cpu_bytes and disk_bytes for the whole node, all pools and ranks together)."""

    socket_path: str
    store: StoreConfig
    max_pools: int = 1
    group: Optional[str] = None  # a group (name or numeric gid) whose processes may attach too (socket 0660)
    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    pool_idle_s: float = 300.0  # a pool no engine has attached to for this long is given back (its memory freed)
    lease_slot_share: float = 0.25  # of a pool's slots one engine may reserve and load while others attach too
    reservation_ttl_s: float = 120.0  # a request's reservations no lookup renewed for this long are released
    command_ttl_s: float = COMMAND_TTL_S  # a device command unanswered this long fails (its slot or pin freed)


class NodeCacheService:
    def __init__(self, options: ServiceOptions) -> None:
        if options.max_pools < 1:
            raise ValueError(f"max_pools must be at least 1, got {options.max_pools}")
        self.options = options
        self._limits = LeaseLimits(options.lease_slot_share, options.reservation_ttl_s)
        self.instance = secrets.token_hex(6)  # a restarted service is a new epoch for every engine
        self.lock = threading.RLock()
        self.refused_peers = 0
        self.refused_crowd = 0  # connections refused beyond MAX_CONNECTIONS
        self.connections = 0
        self.started_at = time.time()
        self._group_gid = group_id(options.group) if options.group else None
        self._next_connection = 0
        self._closed = threading.Event()
        self._table = PoolTable(options.store, options.max_pools, options.pool_idle_s, self.instance, self.lock,
                                self._closed, options.command_ttl_s)
        self._accepting = threading.Event()  # the accept loop runs (what /readyz and a ping report)
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()  # live connections: closing the service ends them too
        self._open_lock = threading.Lock()  # guards _open and _next_connection: accepting never waits on a verb
        self._listener = self._bind(options.socket_path)
        self._metrics: Optional[MetricsServer] = None
        if options.metrics_port is not None:
            self._metrics = MetricsServer(options.metrics_host, options.metrics_port, self.metrics_text,
                                          self._probes())

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

    @property
    def pools(self) -> dict[PoolGeometry, NodePool]:
        return self._table.pools

    @property
    def pools_reclaimed(self) -> int:
        return self._table.reclaimed

    def start(self) -> "NodeCacheService":
        for target, name in ((self.serve_forever, "lmcache-node-accept"), (self._reap_forever, "lmcache-node-reap")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _reap_forever(self) -> None:
        """Gives back idle pools, looking a few times per `pool_idle_s` (at most every 30 s)."""
        every = min(30.0, max(0.05, self.options.pool_idle_s / 4))
        while not self._closed.wait(every):
            try:
                self._table.reap()
            except Exception:  # a pool that fails to close must not end the reaping of the others
                logger.exception("node cache: giving back an idle pool failed")

    def serve_forever(self) -> None:
        logger.info("node cache: serving %s (%d B host memory, %d pool(s)%s)", self.options.socket_path,
                    self.options.store.cpu_bytes, self.options.max_pools,
                    f", disk {self.options.store.disk_path}" if self.options.store.disk_path else "")
        self._accepting.set()
        try:
            self._accept_loop()
        finally:
            self._accepting.clear()

    def _accept_loop(self) -> None:
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
            with self._open_lock:
                if self._closed.is_set():
                    connection.close()
                    return
                crowded = len(self._open) >= MAX_CONNECTIONS
                if not crowded:
                    self._next_connection += 1
                    number = self._next_connection
                    self._open.add(connection)
            if crowded:  # a thread per connection: a peer opening thousands must not exhaust the service's
                self.refused_crowd += 1
                if self.refused_crowd & (self.refused_crowd - 1) == 0:  # the 1st, 2nd, 4th...: a flood is no flood
                    logger.warning("node cache: refused a connection (%d so far): %d are open, the most it serves",
                                   self.refused_crowd, MAX_CONNECTIONS)
                connection.close()
                continue
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
            connection.settimeout(FIRST_MESSAGE_S)  # a peer that connects and says nothing holds a thread
            try:
                attach = wire.receive_request(connection)
            except wire.PickledRequest as exc:  # an older engine: it reads a pickled Refused, and is told why
                wire.send_reply(connection, Refused(str(exc)))
                return
            connection.settimeout(None)
            if attach == ("ping",):  # a probe (`lmcache-npu node-ping`): answered without the lock, then closed
                wire.send_reply(connection, ("pong", self.about()))
                return
            if not isinstance(attach, Attach) or not isinstance(attach.geometry, PoolGeometry):
                wire.send(connection, Refused("the first message must be an Attach"))
                return
            refusal = _attach_refusal(attach)
            if refusal is not None:
                logger.warning("node cache: refused engine %s: %s", attach.engine, refusal)
                wire.send(connection, Refused(refusal))
                return
            try:
                _check_geometry(attach.geometry)
                pool, (fds, lease) = self._table.acquire(attach.geometry, lambda found: self._lease(found, attach,
                                                                                                    number))
            except (PoolRefused, ValueError, TypeError, MemoryError, OSError) as exc:
                logger.warning("node cache: refused engine %s: %s", attach.engine, exc)
                wire.send(connection, Refused(str(exc)))
                return
            token = lease.token if attach.rank is None or number in lease.bound else ""  # set once, at the claim
            wire.send(connection, dataclasses.replace(pool.attached(), lease=token), fds)
            logger.info("node cache: engine %s %s attached (%s)", attach.engine,
                        "scheduler" if attach.rank is None else f"rank {attach.rank}", attach.geometry.describe())
            while True:
                request = wire.receive_request(connection)
                if type(request) is tuple and len(request) == 2 and request[0] == "join":  # a worker, its lease's
                    lease, reply = self._join(pool, lease, number, request[1])
                else:
                    reply = self._answer(pool, lease, request)
                pool.flush_log()  # what the verb logged, now that the lock is free
                if reply is not None:
                    wire.send_reply(connection, reply)
        except (ConnectionError, OSError) as exc:
            logger.debug("node cache: connection %d closed: %s", number, exc)
        except Exception:  # a bug must cost this connection (its lease ends below), never the service
            logger.exception("node cache: connection %d failed", number)
        finally:
            with self._open_lock:
                self._open.discard(connection)
            with self.lock:
                if pool is not None and lease is not None:
                    self.connections -= 1
                    if not self._closed.is_set():  # a closed service's pools are gone with every lease in them
                        pool.drop_connection(lease.engine, number)
            if pool is not None:
                pool.flush_log()  # a lease's end in one line, once the lock is free
            connection.close()

    def _lease(self, pool: NodePool, attach: Attach, number: int) -> tuple[list[int], EngineLease]:
        """The attaching connection's segment files and lease in `pool` (under the lock)."""
        fds = pool.segment_fds(attach.rank) if attach.rank is not None else []
        lease = pool.lease(attach.engine, number, attach.events, self._limits, rank=attach.rank, token=attach.lease)
        self.connections += 1
        return fds, lease

    def _answer(self, pool: NodePool, lease: EngineLease, request: Any) -> Optional[tuple]:
        if not isinstance(request, tuple) or not request or not isinstance(request[0], str):
            return ("error", "ValueError", "a request is a tuple (verb, *arguments)")
        verb, arguments = request[0], request[1:]
        if verb in REMOTE_KEYS and pool.index.remote_configured:  # the Mooncake RPC, asked before the lock
            _prefetch(pool, REMOTE_KEYS[verb](arguments))
        with self.lock:
            try:
                value = self._run(pool, lease, verb, arguments)
            except (ValueError, TypeError, KeyError, AssertionError) as exc:  # the peer's mistake, or a check failed
                if verb in ONEWAY:
                    pool.note(logging.WARNING, "node cache: engine %s: %s refused: %s", lease.engine, verb, exc)
                    return None
                return ("error", "ValueError", _unscoped(f"{verb}: {exc}", lease.engine))
            if verb in ONEWAY:
                return None
            counters = {str.__str__(name): amount for name, amount in lease.counters.items()}  # plain str on the wire
            lease.counters.clear()
            changes, lease.tier_changes = lease.tier_changes, []
            return ("ok", value, counters, changes)

    def _join(self, pool: NodePool, lease: EngineLease, number: int, token: Any) -> tuple[EngineLease, tuple]:
        """A worker's connection presents its scheduler's lease token (`pool.join`): True when bound to it."""
        with self.lock:
            joined = pool.join(lease.engine, number, token) if isinstance(token, str) else None
        if joined is None:
            logger.warning("node cache: engine %s: a worker's connection presented a lease token no live lease of "
                           "the engine holds; its commands will be refused", lease.engine)
        return joined or lease, ("ok", joined is not None, {}, [])

    @staticmethod
    def _run(pool: NodePool, lease: EngineLease, verb: str, arguments: tuple) -> Any:
        handler = VERBS.get(verb)
        if handler is None:
            raise ValueError(f"unknown verb {verb!r} (this service speaks {', '.join(sorted(VERBS))})")
        return handler(pool, lease, *arguments)

    # ---- what operators see ---------------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        return exposition(self)  # read under the lock, formatted outside it

    def about(self) -> dict[str, Any]:
        """What `/version` and a ping answer: read without the lock (plain attributes)."""
        return {"service": "lmcache-npu node-cache", "version": _version(), "encoding": codec.MAGIC[1],
                "epoch": self.instance, "started_at": self.started_at, "pid": os.getpid(),
                "serving": self.serving}

    @property
    def serving(self) -> bool:
        """Accepting engines: bound, its accept loop running, not closed (no lock: a probe never waits on a verb)."""
        return self._accepting.is_set() and not self._closed.is_set()

    def _probes(self) -> dict[str, Callable[[], tuple[int, str, str]]]:
        def state(ok: bool, what: str) -> tuple[int, str, str]:
            return (200, "text/plain", "ok\n") if ok else (503, "text/plain", f"not {what}\n")

        def alive() -> tuple[int, str, str]:
            held = max((time.monotonic() - pool.turned for pool in list(self.pools.values())), default=0.0)
            if held > WEDGED_AFTER_S:
                return state(False, f"alive: the service's lock has been held for {held:.0f} s")
            return state(not self._closed.is_set(), "alive: closed")

        return {"/healthz": alive,
                "/readyz": lambda: state(self.serving, "ready: not accepting engines"),
                "/version": lambda: (200, "application/json", json.dumps(self.about()) + "\n")}

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
        with self.lock, self._open_lock:
            pools = self._table.take_all()
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


@cache
def _version() -> str:
    try:
        return importlib.metadata.version("lmcache-npu")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


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

def _attach_refusal(attach: Attach) -> Optional[str]:
    """Why no pool takes this engine, whatever its geometry (None: nothing against it)."""
    version = protocol_of(attach)
    if version != PROTOCOL_VERSION:  # its verbs or their replies may differ from ours: misses, not misreadings
        return (f"this engine speaks node cache protocol {version} and the service {PROTOCOL_VERSION}: run the engines "
                "and the service of one lmcache_npu release (upgrade the older side)")
    # its namespace could be another model's, and the pool outlives the engine
    if not isinstance(attach.weights, str) or attach.weights not in NAMED_WEIGHTS:
        return (f"this engine's model identity names its weights by nothing (weights {attach.weights!r}, not one "
                f"of {', '.join(sorted(NAMED_WEIGHTS))}), and the node cache keeps and shares chunks beyond any "
                "engine, so another model with the same config could load them. Set model_fingerprint in "
                "kv_connector_extra_config to a string that names these exact weights")
    return None


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
    if ENGINE_SEPARATOR in value:  # "A\x1fB" + "r" would be "A" + "B\x1fr": another engine's request
        raise ValueError(f"a request id may not hold \\x1f, got {value!r}")
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
    lease.looked_up[name] = time.monotonic()  # renews its reservations (LeaseLimits.reservation_ttl_s)
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


def _prefetch(pool: NodePool, batch: Optional[tuple]) -> None:
    """The remote store's answers for a lookup's or presence's (namespace, hashes), asked without the lock
    (malformed arguments: nothing, the verb refuses them under the lock)."""
    if batch is None or len(batch) != 2:
        return
    try:
        keys = _hashed(pool, *batch)
    except ValueError:
        return
    pool.index.prefetch_remote(keys)


# the verbs that may ask the remote store: their (namespace, hashes) arguments when they will
REMOTE_KEYS: dict[str, Callable[[tuple], Optional[tuple]]] = {
    "lookup": lambda arguments: arguments[1:3],
    "presence": lambda arguments: arguments[0:2] if len(arguments) == 3 and arguments[2] else None,
}


def _release(pool: NodePool, lease: EngineLease, request_id: Any) -> None:
    name = scoped(lease.engine, _text(request_id))
    pool.call(lease, lambda: pool.index.release(name))
    lease.requests.discard(name)
    lease.looked_up.pop(name, None)


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
