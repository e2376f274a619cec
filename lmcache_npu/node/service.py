"""The node cache service (`lmcache-npu node-cache`): one per node, it owns the node's host cache, disk tier and
Mooncake client, and every engine on the node uses it through a Unix socket.

Security: the socket is created mode 0600 (0660 with `group`), every peer's credentials are checked with
`SO_PEERCRED` (this uid, or with `group` that primary gid: a supplementary membership opens the socket but does
not pass), and the shared segments are memory files in no filesystem, reachable only through descriptors this
service hands to checked peers. Peers' messages are of a closed encoding (codec.py, wire.py). Admission is the only
access control: a checked peer may attach to any geometry's pool and map it read-write.
Engines attach with their pool geometry; each geometry gets a pool (`pool.py`), up to `max_pools`, each an equal
share of `cpu_bytes` and `disk_bytes`; a pool no engine holds is given back after `pool_idle_s` or when a new
geometry needs its place (`pool_table.py`). One lock serialises the verbs: index operations (a long prompt's lookup
takes milliseconds), and the spills and disk drops an eviction issues; the Mooncake existence check, logging and
metrics formatting run outside it.
Restarts keep the host cache warm: a successor started with `take_over` takes the pools and the listening socket over
(`handover.py`), and under systemd every pool's memory is kept in its descriptor store for the next start
(`fd_store.py`); either way the pools keep their epochs and rebuild their index from the slots' envelopes.
"""

from __future__ import annotations

import dataclasses
import grp
import importlib.metadata
import json
import logging
import os
import secrets
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Optional

from ..checks import check_int
from ..store.config import StoreConfig
from . import codec, wire
from .capacity import NodeCapacity, check_node_store
from .exporter import MetricsServer, exposition, namespace_labeller
from .fd_store import SystemdFdStore, inherited_pools, passed_fds
from .handover import DRAIN_S, Handover, frozen_answer, same_uid, take_over
from .messages import (HANDOVER, NAMED_WEIGHTS, ONEWAY, PROTOCOL_VERSION, Attach, PoolGeometry, Refused,
                       protocol_of)
from .pool import COMMAND_TTL_S, EngineLease, LeaseLimits, NodePool, PoolRefused
from .pool_table import PoolTable
from .verbs import REMOTE_KEYS, VERBS, prefetch, unscoped

logger = logging.getLogger(__name__)

WEDGED_AFTER_S = 60.0  # a pool's pump has not had the lock this long: a verb hangs, /healthz says so
MAX_CONNECTIONS = 4096  # open at once (a DP=16 TP=8 node holds 144); each costs a thread
FIRST_MESSAGE_S = 10.0  # a connection's Attach (or ping) must arrive within this
BACKLOG = 1024  # connections waiting to be accepted: every engine's reattach after a hand-over lands at once


@dataclass(frozen=True)
class ServiceOptions:
    """`capacity`: the node's host memory and disk for the cache (all pools and ranks together); `tiers`: every other
    tier setting (hugepages, eviction, write-through, Mooncake), without sizes (node/capacity.py)."""

    socket_path: str
    capacity: NodeCapacity
    tiers: StoreConfig = field(default_factory=StoreConfig)
    max_pools: int = 1
    group: Optional[str] = None  # a group (name or numeric gid) whose processes may attach too (socket 0660)
    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    pool_idle_s: float = 300.0  # a pool no engine has attached to for this long is given back (its memory freed)
    lease_slot_share: float = 0.25  # of a pool's slots one engine may reserve and load while others attach too
    reservation_ttl_s: float = 120.0  # a request's reservations no lookup renewed for this long are released
    command_ttl_s: float = COMMAND_TTL_S  # a device command unanswered this long fails (its slot or pin freed)
    take_over: bool = False  # take the pools and the socket over from the service running at socket_path
    hand_over_drain_s: float = DRAIN_S  # how long a predecessor waits for its engines' device commands
    systemd_fd_store: bool = True  # under systemd (NOTIFY_SOCKET), keep and find pools in its descriptor store
    seal_behind: Optional[bool] = None  # seal committed stores off the lock (None: where systemd keeps the pools)

    def __post_init__(self) -> None:
        check_node_store(self.capacity, self.tiers)


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
        self._frozen = False  # handing over: no device command is handed out
        self.handed_over = threading.Event()  # its pools and socket went to a successor, its workers were told
        self._fd_store = SystemdFdStore.from_environment() if options.systemd_fd_store else None
        seal_behind = self._fd_store is not None if options.seal_behind is None else options.seal_behind
        self._table = PoolTable(options.capacity, options.tiers, options.max_pools, options.pool_idle_s, self.instance, self.lock,
                                self._closed, options.command_ttl_s, keeper=self._fd_store, seal_behind=seal_behind)
        self._accepting = threading.Event()  # the accept loop runs (what /readyz and a ping report)
        self._pause = threading.Event()  # the accept loop is asked to stop (a hand-over, or closing)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # wakes the accept loop's poll
        self._threads: list[threading.Thread] = []
        self._acceptor: Optional[threading.Thread] = None
        self._open: dict[socket.socket, bool] = {}  # live connections (True: a worker's): closing ends them too
        self._open_lock = threading.Lock()  # guards _open and _next_connection: accepting never waits on a verb
        succession = take_over(options.socket_path, options.hand_over_drain_s) if options.take_over else None
        if succession is not None:
            self._listener = succession.listener
            self._listener.listen(BACKLOG)
            self._table.inherit(succession.pools)
            logger.info("node cache: took %d pool(s) over from pid %d on %s", len(succession.pools),
                        succession.predecessor_pid, options.socket_path)
        else:
            self._listener = self._bind(options.socket_path)
            self._inherit_from_systemd()
        self._listener.setblocking(False)
        self._metrics: Optional[MetricsServer] = None
        self.namespace_label = namespace_labeller(options.metrics_host)  # a pseudonym beyond loopback (M3)
        if options.metrics_port is not None:
            try:
                self._metrics = MetricsServer(options.metrics_host, options.metrics_port, self.metrics_text,
                                              self._probes())
            except OSError as exc:
                if succession is None:
                    raise
                # the host cache is ours now: serving it without metrics beats losing it to a taken port
                logger.error("node cache: no metrics on %s:%d (%s); serving the taken-over pools without them",
                             options.metrics_host, options.metrics_port, exc)

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
        listener.listen(BACKLOG)
        return listener

    def _inherit_from_systemd(self) -> None:
        """The pools systemd kept for this service across its last exit (a crash, a restart), adopted warm."""
        store = self._fd_store
        if store is None:
            return
        found = inherited_pools(passed_fds(), store)
        for _, _, tag, names in found:
            store.adopted(tag, names)
        made = {pool.epoch for pool in self._table.inherit([(geometry, arena) for geometry, arena, _, _ in found])}
        for _, arena, tag, names in found:
            if arena.epoch not in made:  # refused (its layout is not this configuration's): systemd lets it go
                store.kept.pop(tag, None)
                store.forget_tag(tag, names)
        if found:
            logger.info("node cache: adopted %d of %d pool(s) systemd kept across the last exit", len(made),
                        len(found))

    @property
    def pools(self) -> dict[PoolGeometry, NodePool]:
        return self._table.pools

    @property
    def pools_reclaimed(self) -> int:
        return self._table.reclaimed

    def start(self) -> "NodeCacheService":
        self.resume_accepting()
        reaper = threading.Thread(target=self._reap_forever, name="lmcache-node-reap", daemon=True)
        reaper.start()
        self._threads.append(reaper)
        return self

    def _reap_forever(self) -> None:
        """Gives back idle pools, looking a few times per `pool_idle_s` (at most every 30 s)."""
        every = min(30.0, max(0.05, self.options.pool_idle_s / 4))
        while not self._closed.wait(every):
            if self._frozen:  # a hand-over is describing the pools: none may go meanwhile
                continue
            try:
                self._table.reap()
            except Exception:  # a pool that fails to close must not end the reaping of the others
                logger.exception("node cache: giving back an idle pool failed")

    def serve_forever(self) -> None:
        logger.info("node cache: serving %s (%d B host memory, %d pool(s)%s)", self.options.socket_path,
                    self.options.capacity.cpu_bytes, self.options.max_pools,
                    f", disk {self.options.capacity.disk_path}" if self.options.capacity.disk_path else "")
        self._accepting.set()
        if self._fd_store is not None:
            try:
                self._fd_store.ready()
            except OSError as exc:  # systemd's socket gone: it serves all the same
                logger.warning("node cache: could not tell systemd it serves: %s", exc)
        try:
            self._accept_loop()
        finally:
            self._accepting.clear()

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed.is_set() and not self._pause.is_set():
            poller.poll()
            if self._closed.is_set() or self._pause.is_set():
                return
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):  # woken, or another waiter took it
                continue
            connection.setblocking(True)
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
                    self._open[connection] = False
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

    def pause_accepting(self) -> None:
        """Stops the accept loop (connections wait in the listener's backlog) and waits until it has."""
        self._pause.set()
        os.write(self._wake_w, b"x")
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join()
        self._acceptor = None

    def resume_accepting(self) -> None:
        if self._acceptor is not None or self._closed.is_set():
            return
        self._pause.clear()
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._acceptor = threading.Thread(target=self.serve_forever, name="lmcache-node-accept", daemon=True)
        self._acceptor.start()

    def _peer_allowed(self, connection: socket.socket) -> bool:
        pid, uid, gid = wire.peer_credentials(connection)
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
            if type(attach) is tuple and attach[:1] == (HANDOVER,):  # a successor (`node-cache --take-over`)
                with self._open_lock:
                    self._open.pop(connection, None)  # the hand-over's own: not ended with the engines'
                if not same_uid(connection):
                    wire.send(connection, Refused("only a process of the service's own uid may take it over"))
                    return
                connection.settimeout(None)
                Handover(self).run(connection, attach)
                return
            if not isinstance(attach, Attach) or not isinstance(attach.geometry, PoolGeometry):
                wire.send(connection, Refused("the first message must be an Attach"))
                return
            refusal = _attach_refusal(attach)
            if refusal is not None:
                logger.warning("node cache: refused engine %s: %s", attach.engine, refusal)
                wire.send(connection, Refused(refusal))
                return
            if self._frozen and attach.geometry not in self.pools:  # a pool made now would not be handed over
                wire.send(connection, Refused("the node cache is handing over to its successor: attach to it"))
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
            with self._open_lock:
                if connection in self._open:
                    self._open[connection] = attach.rank is not None  # a worker's: told of a hand-over
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
                self._open.pop(connection, None)
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
            prefetch(pool, REMOTE_KEYS[verb](arguments))
        with self.lock:
            try:
                value = self._run(pool, lease, verb, arguments)
            except (ValueError, TypeError, KeyError, AssertionError) as exc:  # the peer's mistake, or a check failed
                if verb in ONEWAY:
                    pool.note(logging.WARNING, "node cache: engine %s: %s refused: %s", lease.engine, verb, exc)
                    return None
                return ("error", "ValueError", unscoped(f"{verb}: {exc}", lease.engine))
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

    def _run(self, pool: NodePool, lease: EngineLease, verb: str, arguments: tuple) -> Any:
        if self._frozen:
            frozen, value = frozen_answer(verb, arguments)
            if frozen:
                return value
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

    # ---- a hand-over (handover.py drives these) -------------------------------------------------------------------

    def freeze(self) -> bool:
        """Hands out no device command from now on (a hand-over began); False when one is under way already."""
        with self.lock:
            if self._frozen or self._closed.is_set():
                return False
            self._frozen = True
            return True

    def thaw(self) -> None:
        """The hand-over failed: serving on as before."""
        with self.lock:
            self._frozen = False
        self.resume_accepting()

    @property
    def listener_fd(self) -> int:
        return self._listener.fileno()

    def retire_after_handover(self, last_word: Callable[[], None]) -> None:
        """The successor holds the pools' memory and the listening socket: tells every worker its epoch lives on,
        ends every connection, closes the pools (the disk tiers flush) and this service, leaving the socket, and says
        `last_word` to the successor. `handed_over` is set only then: the process may exit on it."""
        self._closed.set()
        self.pause_accepting()
        if self._metrics is not None:
            self._metrics.close()
        with self.lock, self._open_lock:
            notice = wire.encode((HANDOVER, sorted(pool.epoch for pool in self.pools.values())))
            pools = self._table.take_all()
            for connection, worker in self._open.items():
                try:
                    if worker:
                        connection.sendall(notice)
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for pool in pools:
            pool.close()
        self._listener.close()  # the successor's duplicate listens on
        self._close_wake()
        last_word()
        self.handed_over.set()

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Stops accepting, ends the live connections, closes the pools (their disk tiers flush) and removes the
        socket; once (a second call must not unlink a successor's socket of the same path)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.pause_accepting()
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
        self._close_wake()
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
        check_int(f"a pool geometry's {name}", getattr(geometry, name), lo=1)
