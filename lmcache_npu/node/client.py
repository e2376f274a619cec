"""The scheduler half's side of the node cache: `NodeCacheClient`, the manager contract over the service's socket
(a worker's mapping of the shared arena is `attachment.py`'s).

The service being away never stops an engine, at start-up or later: every verb then answers as a cache that holds
nothing (lookups miss, stores are not made, a load already promised is refused, so vLLM recomputes it), and the
client attaches on a thread of its own, at most once per `retry_s` (`REFUSED_RETRY_S` after the service refused it:
a geometry beyond its pools), waiting up to `ATTACH_TIMEOUT_S` for a pool the service is still making. An engine
starts with a short wait for that attach and serves without the node cache when it is not done by then. Each
attachment is an epoch, which the scheduler sends its workers with each step so they map its segments before they
move a byte.

Nor does a service that answers wrongly: an error reply (a verb the service refused, a bug there, another release's
arguments) or a reply of the wrong shape answers as the same miss, counted (`node_cache_error_replies`,
`node_cache_malformed_replies`) and logged once per verb, never as an exception in vLLM's scheduler. A service of
another protocol version is refused at attach (messages.py), and the engine serves without it.

A command handed to vLLM is never forgotten, since the step's load and store plans name it and its workers wait for
it: one that had not reached the workers when the service was lost is handed out as refused (`take_refused`: the
workers answer it as failed, so a load recomputes and a store settles); one they already run is answered by them.
Their answers settle the commands here. An attachment to the same epoch (a slow call timed out, the service lives)
keeps them and sends the service what it missed meanwhile (releases, then answers), so its slots, pins and
reservations are given back; the answers to an earlier epoch's commands go nowhere.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from functools import partial
from operator import itemgetter
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from ..store.commands import Command, Completion, Load, Store, Tier
from ..store.index.contract import (ChunkManager, ChunkManagerView, ChunkView, DiskState, LookupResult,
                                    NumberedChunks, PayloadSink, SlotState, TierListener, Writer)
from ..store.index.ledger import CommandLedger
from ..store.keys import ChunkKey
from ..store.metrics import Metric
from ..store.tier import TierCounters
from . import replies, wire
from .messages import PROTOCOL_VERSION, Attach, lease_id, Attached, PoolGeometry, Refused, Verb, protocol_of

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # at most one attach attempt per second while the service is away
REFUSED_RETRY_S = 10.0  # after a refusal (no pool for this geometry): asked again this rarely
CALL_TIMEOUT_S = 10.0  # a verb the service has not answered by then counts as the service being away
START_WAIT_S = 5.0  # how long an engine's start waits for its first attach (a pool being made takes longer)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
OCCUPANCY_TTL_S = 1.0  # the gauges vLLM's stats read every step: asked at most once a second
# releases kept while the service is away, for an attachment to the same epoch (those of the requests that looked
# up before it went away come first; beyond, the reservations wait for the lease's end)
MAX_UNSENT_RELEASES = 4096
ATTACH_TIMEOUT_S = 900.0  # the first attach of a geometry maps and pre-faults its pool: minutes on a large node


class NodeCacheUnavailable(ConnectionError):
    """The node cache service cannot be reached (or refused this engine)."""


class NodeCacheRefused(NodeCacheUnavailable):
    """The service answered and will not take this engine (`Refused`: no pool for its geometry, weights nothing names,
    ...; or it speaks another protocol version): the reason says what to change."""


def check_service_peer(sock: socket.socket, path: str) -> None:
    """The process behind `path` must be one this engine may trust with its KV: this user's, root's, or the owner of
    a socket whose directory nobody else can write (a service of another user, e.g. with --group). Anyone could
    otherwise bind a socket at a path in a shared directory first and serve forged chunks."""
    _, uid, _ = wire.peer_credentials(sock)
    if uid in (os.getuid(), 0):
        return
    try:
        owner = os.stat(path).st_uid
        directory = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise NodeCacheUnavailable(f"the node cache at {path} cannot be checked: {exc}") from exc
    placed_by_owner = directory.st_uid in (uid, 0) and not directory.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if owner == uid and placed_by_owner:
        return
    raise NodeCacheUnavailable(f"the node cache at {path} is served by uid {uid}, neither this user ({os.getuid()}) "
                               "nor root, from a directory others may write: refusing it (another user could have "
                               "placed that socket; see docs/deployment.md, \"Node cache\", Security)")


def connect(path: str, attach: Attach, timeout_s: float) -> tuple[socket.socket, Attached, list[int]]:
    """Connects and attaches; retries until `timeout_s` while the socket is missing or refuses connections. The
    reply may take `ATTACH_TIMEOUT_S` (the service makes the geometry's pool first); later calls get
    `CALL_TIMEOUT_S`."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CALL_TIMEOUT_S)
            sock.connect(path)
            check_service_peer(sock, path)
            wire.send(sock, attach)
            sock.settimeout(ATTACH_TIMEOUT_S)
            reply, fds = wire.receive_with_fds(sock)
            sock.settimeout(CALL_TIMEOUT_S)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise NodeCacheUnavailable(f"no node cache service listens on {path} ({exc.strerror}); start "
                                           "`lmcache-npu node-cache --socket PATH ...` on this node first") from exc
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        except NodeCacheUnavailable:
            sock.close()
            raise
        except (OSError, wire.WireError) as exc:
            sock.close()
            raise NodeCacheUnavailable(f"the node cache at {path} did not attach this engine: {exc}") from exc
        if isinstance(reply, Refused):
            sock.close()
            for fd in fds:
                wire.close_fd(fd)
            raise NodeCacheRefused(f"the node cache at {path} refused this engine: {reply.reason}")
        if not isinstance(reply, Attached) or protocol_of(reply) != PROTOCOL_VERSION:
            sock.close()
            for fd in fds:
                wire.close_fd(fd)
            if isinstance(reply, Attached):  # a service of an older or newer release: its replies may differ
                raise NodeCacheRefused(f"the node cache at {path} speaks protocol {protocol_of(reply)} and this engine "
                                       f"{PROTOCOL_VERSION}: run the engines and the service of one lmcache_npu "
                                       "release (upgrade the older side)")
            raise NodeCacheUnavailable(f"the node cache at {path} answered {type(reply).__name__}, not Attached")
        if not replies.attached(reply):  # the pool's sizes build this engine's arena and gauges: a wrong type: no pool
            sock.close()
            for fd in fds:
                wire.close_fd(fd)
            raise NodeCacheRefused(f"the node cache at {path} answered a malformed Attached: {reply!r}")
        return sock, reply, fds


class NodeCacheClient(ChunkManager, ChunkManagerView):
    """The manager contract over the node cache's socket, for one engine's scheduler half. The engine's own device
    commands are tracked here (their ranks' answers, `is_pending`, the outbox), so a step costs no round trip for
    them; everything about the node's chunks is asked of the service."""

    def __init__(self, path: str, engine: str, geometry: PoolGeometry, *, weights: str,
                 connect_timeout_s: float = START_WAIT_S, retry_s: float = RETRY_S, strict: bool = False) -> None:
        """`weights`: how the engine's identity names its weights (messages.WEIGHTS_*). `strict` (tests of the
        service itself) raises an error or malformed reply as a ValueError instead of answering a miss."""
        self.path = path
        self.engine = engine
        self.geometry = geometry
        self.weights = weights
        self.retry_s = retry_s
        self.strict = strict
        self._told: set[tuple[str, str]] = set()  # (verb, what went wrong) already logged as a warning
        self._miss = ""  # why the last call answered `missing`
        self.counters = TierCounters()
        self._events = False
        self._listener: Optional[TierListener] = None
        self._sock: Optional[socket.socket] = None
        self._next_try = 0.0
        self._retry_lock = threading.Lock()
        self._retrying: Optional[threading.Thread] = None  # attaching again in the background
        self._reattached: Optional[tuple[socket.socket, Attached]] = None  # its result, for the next call
        # told the payload (builtins: what a router needs to name a chunk) another engine of the node described
        self.payload_sink: Optional[PayloadSink] = None
        # this engine's device commands of epoch `_ledger_epoch`: the outbox and every rank's answers, as the
        # in-process index keeps them
        self._ledger = CommandLedger(geometry.world, self.counters)
        self._ledger_epoch: Optional[str] = None
        self._orphans: list[CommandLedger] = []  # earlier epochs' commands the workers have not all answered yet
        self._refused: list[Command] = []  # queued when the service was lost: the workers answer them as failed
        self._unacked: list[tuple[int, int, bool, str]] = []  # answers of `_ledger_epoch` the service has not had
        self._unreleased: dict[str, None] = {}  # requests released while `_ledger_epoch`'s service was away
        self._occupancy: Optional[tuple[float, dict[Tier, tuple[int, int]]]] = None
        self.epoch: Optional[str] = None
        self.num_slots = 0  # the pool's, once attached
        self.disk_chunks = 0
        self._policy = ""
        self._closed = False
        self._refusal = ""  # the last refusal's reason, said once
        self._away = ""  # why the last attach failed otherwise
        self.lease = ""  # the token the service issued this engine's lease (its workers present it)
        # the first attach runs as every later one does, in the background; the start waits for it a little
        with self._retry_lock:
            retrying = self._retrying = threading.Thread(target=self._reattach, name="lmcache-node-attach",
                                                         daemon=True)
        retrying.start()
        retrying.join(timeout=connect_timeout_s)
        if not self._connected() and not self._refusal:  # a refusal was said with its reason
            logger.warning("lmcache_npu: the node cache at %s is not attached yet (%s); serving without it (every "
                           "lookup misses) and attaching in the background", self.path,
                           "still attaching" if retrying.is_alive() else self._away)

    # ---- the connection -------------------------------------------------------------------------------------------

    def _attach_message(self) -> Attach:
        return Attach(self.engine, self.geometry, None, self._events, weights=self.weights, protocol=PROTOCOL_VERSION,
                      lease=self.lease)

    def _adopt(self, sock: socket.socket, attached: Attached) -> None:
        self._sock = sock
        self.epoch = attached.epoch
        self.lease = attached.lease
        self.num_slots = attached.num_slots
        self.disk_chunks = attached.disk_chunks
        self._policy = attached.eviction_policy
        if attached.epoch == self._ledger_epoch:  # the same service: its commands and their answers still count
            return
        if self._ledger.in_flight:  # a dead epoch's: the workers' answers settle them here, and go nowhere
            self._orphans.append(self._ledger)
        if self._unacked:
            logger.info("lmcache_npu: %d answer(s) to the node cache's epoch %s dropped: it is gone",
                        len(self._unacked), self._ledger_epoch)
        self._ledger = CommandLedger(self.geometry.world, self.counters)
        self._ledger_epoch = attached.epoch
        self._unacked = []
        self._unreleased = {}

    def _lost(self, why: BaseException) -> None:
        if self._sock is not None:
            logger.warning("lmcache_npu: lost the node cache at %s (%s); serving without it (every lookup misses) "
                           "and attaching again every %.1f s", self.path, why, self.retry_s)
            self._sock.close()
            self.counters.add(Metric.NODE_CACHE_DISCONNECTS)
        self._sock = None
        self.epoch = None
        # the step's plans already name the queued commands: never run now, they are answered as failed
        queued = self._ledger.take()
        if queued:
            self._refused.extend(queued)
            self.counters.add(Metric.NODE_CACHE_REFUSED_COMMANDS, len(queued))
        self._occupancy = None
        with self._retry_lock:
            self._next_try = time.monotonic() + self.retry_s

    def _connected(self) -> bool:
        """Whether a connection is up; while it is not, attaching again runs on a thread of its own (a restarted
        service makes the pool anew, which may take minutes), and its result is taken up by the next call."""
        if self._sock is not None:
            return True
        with self._retry_lock:
            done, self._reattached = self._reattached, None
            if done is None:
                if self._retrying is None and time.monotonic() >= self._next_try and not self._closed:
                    self._retrying = threading.Thread(target=self._reattach, name="lmcache-node-reattach",
                                                      daemon=True)
                    self._retrying.start()
                return False
        sock, attached = done
        first = self.num_slots == 0  # never attached before (a pool has at least one slot)
        self._adopt(sock, attached)
        if first:
            logger.info("lmcache_npu: attached to the node cache at %s (epoch %s)", self.path, self.epoch)
            return True
        self.counters.add(Metric.NODE_CACHE_RECONNECTS)
        logger.info("lmcache_npu: attached to the node cache at %s again (epoch %s)", self.path, self.epoch)
        self._replay()
        return self._sock is not None

    def _replay(self) -> None:
        """What the same epoch's service missed while this engine was away: its releases (a reply it never read may
        have reserved chunks), then its workers' answers."""
        for request_id in list(self._unreleased):
            if not self._send(Verb.RELEASE, request_id):
                return  # away again: the rest wait for the next attachment
            del self._unreleased[request_id]
        self._deliver(replay=True)

    def _reattach(self) -> None:
        try:
            sock, attached, _ = connect(self.path, self._attach_message(), 0.0)
        except NodeCacheRefused as exc:
            self.counters.add(Metric.NODE_CACHE_REFUSED)
            if str(exc) != self._refusal:  # said once per reason: it is asked again every REFUSED_RETRY_S
                logger.warning("lmcache_npu: %s; serving without the node cache and asking again every %.0f s",
                               exc, max(self.retry_s, REFUSED_RETRY_S))
            self._refusal = str(exc)
            self._retry_after(max(self.retry_s, REFUSED_RETRY_S))
            return
        except NodeCacheUnavailable as exc:
            logger.debug("lmcache_npu: node cache still away: %s", exc)
            self._away = str(exc)
            self._retry_after(self.retry_s)
            return
        self._refusal = ""
        with self._retry_lock:
            if self._closed:  # closed while this attach waited: nothing takes it up
                sock.close()
            else:
                self._reattached = (sock, attached)
            self._retrying = None

    def _retry_after(self, delay_s: float) -> None:
        with self._retry_lock:
            self._next_try = time.monotonic() + delay_s
            self._retrying = None

    def poll_epoch(self) -> Optional[str]:
        """The epoch now (None while unattached), after taking up an attach that finished in the background or
        starting one that is due: the scheduler asks once per step, also when no verb of the step reaches here."""
        self._connected()
        return self.epoch

    def step_epoch(self) -> Optional[str]:
        """The epoch for the step's metadata: the workers map it before they move a byte ("" while unattached)."""
        return self.poll_epoch() or ""

    def mapped_on(self, epochs: Mapping[int, str]) -> bool:
        """Attached, and every rank that told maps this epoch (a rank that never said counts as mapping every one)."""
        epoch = self.epoch
        return epoch is not None and all(mapped == epoch for mapped in epochs.values())

    def share_payloads(self, sink: PayloadSink) -> Optional[PayloadSink]:
        """Every engine of the node names the node's chunks (the node is their holder): others' payloads reach
        `sink`, this engine's go to the service (`describe`)."""
        self.payload_sink = sink
        return self.describe

    def _call(self, verb: Verb, *arguments: Any, missing: Any = None,
              valid: Optional[Callable[[Any], bool]] = None) -> Any:
        """The verb's answer; `missing` (counted, the reason in `_miss`) when the service is away, answers an error
        or a reply of another shape than `valid` accepts for the value (raised instead as a ValueError by a client
        made `strict`)."""
        self._miss = "the service is away"
        if not self._connected():
            self.counters.add(Metric.NODE_CACHE_UNREACHABLE)
            return missing
        assert self._sock is not None
        try:
            wire.send(self._sock, (verb.value, *arguments))  # the closed encoding carries a plain str, no enum
            reply = wire.receive(self._sock)
        except (OSError, wire.WireError) as exc:
            self._lost(exc)
            self.counters.add(Metric.NODE_CACHE_UNREACHABLE)
            return missing
        try:  # everything the service sent is checked before any of it is used
            if replies.is_error(reply):
                problem: Optional[tuple[Metric, str]] = (Metric.NODE_CACHE_ERROR_REPLIES,
                                                         f"it answered an error: {reply[2]}")
            elif not (replies.is_ok(reply) and (valid or replies.none)(reply[1])):
                problem = (Metric.NODE_CACHE_MALFORMED_REPLIES,
                           f"it answered a malformed reply ({replies.describe(reply)})")
            else:
                problem = None
        except (TypeError, ValueError, AttributeError) as exc:  # a value whose own methods fail: malformed too
            problem = (Metric.NODE_CACHE_MALFORMED_REPLIES, f"it answered a malformed reply ({type(exc).__name__}: "
                                                            f"{exc})")
        if problem is not None:
            self._miss = problem[1]
            return self._unanswered(verb, problem[0], missing)
        _, value, counters, changes = reply
        for name, amount in counters.items():
            self.counters.add(name, amount)
        if self._listener is not None:
            namespace = self.geometry.namespace
            for chunk_hash, tier, entered, payload in changes:
                key = ChunkKey(namespace, chunk_hash)
                if payload is not None and self.payload_sink is not None:
                    try:
                        self.payload_sink(key, payload)
                    except (TypeError, ValueError) as exc:  # a payload the events cannot read: the change still counts
                        self._unanswered("payload", Metric.NODE_CACHE_MALFORMED_REPLIES, None, str(exc))
                self._listener(key, tier, entered)
        return value

    def _unanswered(self, verb: str, metric: Metric, missing: Any, why: str = "") -> Any:
        """Counts a reply the engine cannot use and answers `missing` (the first of each kind per verb is a warning)."""
        self.counters.add(metric)
        why = why or self._miss
        if self.strict:
            raise ValueError(f"node cache: {verb}: {why}")
        log = logger.warning if self._first(verb, metric) else logger.debug
        log("lmcache_npu: the node cache at %s could not answer %s (%s): taken as a miss", self.path, verb, why)
        return missing

    def _first(self, verb: str, what: str) -> bool:
        """Whether `what` went wrong with `verb` for the first time (warned about once, then only at debug level)."""
        if (verb, what) in self._told:
            return False
        self._told.add((verb, what))
        return True

    def _send(self, verb: Verb, *arguments: Any) -> bool:
        """A verb the engine does not wait for (its counters come with the next answer); whether it was sent."""
        if not self._connected():
            return False
        assert self._sock is not None
        try:
            wire.send(self._sock, (verb.value, *arguments))
        except OSError as exc:
            self._lost(exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with self._retry_lock:
            self._closed = True  # an attach still waiting closes its own connection when it ends
            done, self._reattached = self._reattached, None
        if done is not None:
            done[0].close()

    def _batch(self, keys: Sequence[ChunkKey]) -> tuple[str, list[bytes]]:
        """Keys as the wire carries them: their one namespace and their hashes (pickling 512 named tuples costs a
        millisecond, a list of bytes some microseconds); keys of several namespaces are never sent together."""
        namespaces = set(map(_FIRST, keys))  # map/itemgetter: C speed for a 128K prompt's 512 keys
        if len(namespaces) > 1:
            raise ValueError(f"keys of {len(namespaces)} namespaces in one call ({', '.join(sorted(namespaces))}): "
                             "a node cache pool holds one namespace's chunks")
        return (namespaces.pop() if namespaces else self.geometry.namespace), list(map(_SECOND, keys))

    def _numbered(self, chunks: NumberedChunks) -> tuple[str, list[int], list[bytes]]:
        namespace, hashes = self._batch(list(map(_SECOND, chunks)))
        return namespace, list(map(_FIRST, chunks)), hashes

    def lookup(self, request_id: str, keys: Sequence[ChunkKey]) -> LookupResult:
        return self._call(Verb.LOOKUP, request_id, *self._batch(keys), missing=LookupResult(0, 0),
                          valid=partial(replies.lookup_result, len(keys)))

    def lookup_awaiting(self, request_id: str, keys: Sequence[ChunkKey], writer: Writer) -> LookupResult:
        return self._call(Verb.LOOKUP, request_id, *self._batch(keys), list(writer), missing=LookupResult(0, 0),
                          valid=partial(replies.lookup_result, len(keys)))

    def handoff_writer(self) -> Optional[Writer]:
        """This engine under its live lease (None until the service issued one)."""
        return (self.engine, lease_id(self.lease)) if self.lease and self.epoch is not None else None

    def presence(self, keys: Sequence[ChunkKey], remote: bool = True) -> list[bool]:
        return self._call(Verb.PRESENCE, *self._batch(keys), remote, missing=[False] * len(keys),
                          valid=partial(replies.bools, len(keys)))

    def prepare_load(self, request_id: str, chunks: NumberedChunks) -> list[Load]:
        namespace, numbers, hashes = self._numbered(chunks)
        moves = self._call(Verb.PREPARE_LOAD, request_id, namespace, numbers, hashes, missing=None,
                           valid=partial(replies.moves, set(hashes), self.num_slots))
        if moves is None:  # a hit was promised and is not loadable: refused, so vLLM recomputes these tokens
            if self._sock is None:
                raise ValueError(f"the node cache at {self.path} went away between the lookup and the load")
            raise ValueError(f"the node cache at {self.path} gave no load for a promised hit: {self._miss}")
        return self._track(Load, request_id, chunks, moves)

    def release(self, request_id: str) -> None:
        if not self._send(Verb.RELEASE, request_id) and len(self._unreleased) < MAX_UNSENT_RELEASES:
            self._unreleased[request_id] = None

    def describe(self, key: ChunkKey, payload: tuple) -> None:
        """What routers need to name `key` (this engine stored or promoted it): the node keeps it for the others."""
        self._send(Verb.DESCRIBE, key, payload)

    def prepare_store(self, request_id: str, chunks: NumberedChunks) -> list[Store]:
        namespace, numbers, hashes = self._numbered(chunks)
        moves = self._call(Verb.PREPARE_STORE, request_id, namespace, numbers, hashes, missing=[],
                           valid=partial(replies.moves, set(hashes), self.num_slots))
        return self._track(Store, request_id, chunks, moves)

    def _track(self, kind: type, request_id: str, chunks: NumberedChunks,
               moves: Sequence[tuple[int, int, int, bytes]]) -> list:
        """The service's (command id, slot, chunk number, chunk hash) moves as this engine's commands, tracked."""
        if not moves:
            return []
        keys = {key[1]: key for _, key in chunks}
        return [self._ledger.emit(kind(cmd_id, keys[chunk_hash], slot, request_id, number, epoch=self.epoch))
                for cmd_id, slot, number, chunk_hash in moves]

    def take_commands(self) -> list[Command]:
        return self._ledger.take()

    def take_refused(self) -> list[Command]:
        """Commands the step's plans may name that the service was lost before they reached the workers: each rank
        answers them as failed without running them (a load recomputes, a store settles)."""
        refused, self._refused = self._refused, []
        return refused

    def queued_commands(self) -> tuple[Command, ...]:
        return (*self._refused, *self._ledger.queued())

    def _ledger_of(self, cmd_id: int, rank: int) -> Optional[CommandLedger]:
        """The ledger waiting for `rank`'s answer to `cmd_id`: this epoch's, or an earlier one's."""
        for ledger in (self._ledger, *self._orphans):
            if rank in ledger.waiting_ranks(cmd_id):
                return ledger
        return None

    def on_completions(self, completions: Iterable[Completion]) -> None:
        for done in completions:
            ledger = self._ledger_of(done.cmd_id, done.rank)
            if ledger is None:  # a repeat, or of a command this engine never had
                self.counters.add(Metric.UNEXPECTED_COMPLETIONS)
                continue
            for _ in ledger.answer((done,)):  # settled once its last rank answered
                pass
            if ledger is self._ledger:  # plain tuples: a step's answers pickle in microseconds
                self._unacked.append((done.cmd_id, done.rank, done.ok, done.reason))
        if self._orphans:
            self._orphans = [ledger for ledger in self._orphans if ledger.in_flight]
        self._deliver()

    def _deliver(self, replay: bool = False) -> None:
        """Sends the answers the service has not had; kept while it is away, for an attachment to the same epoch."""
        if not self._unacked or not self._connected() or not self._unacked:  # attaching again may have sent them
            return
        assert self._sock is not None
        answers, self._unacked = self._unacked, []
        try:
            wire.send(self._sock, (Verb.ON_COMPLETIONS.value, answers))
        except OSError as exc:  # the service has none of them (a message cut short is dropped whole)
            self._unacked = answers + self._unacked
            self._lost(exc)
            return
        if replay:
            self.counters.add(Metric.NODE_CACHE_REPLAYED_COMPLETIONS, len(answers))

    def is_pending(self, cmd_id: int) -> bool:
        return self._ledger.is_pending(cmd_id) or any(ledger.is_pending(cmd_id) for ledger in self._orphans)

    def pending_command_ids(self) -> tuple[int, ...]:
        """This engine's commands some rank has not answered, oldest first (benches answer them all)."""
        return tuple(cmd_id for ledger in (*self._orphans, self._ledger) for cmd_id in ledger.pending_ids())

    @property
    def in_flight(self) -> int:
        return self._ledger.in_flight + sum(ledger.in_flight for ledger in self._orphans)

    @property
    def eviction_policy(self) -> str:
        return self._policy

    def limit_slots(self, usable: Union[int, Sequence[tuple[int, int]]]) -> None:
        """The node's slots are live before any engine maps them, and each worker registers all of its mapping
        before it reports: nothing to limit (the service's pool decides which slots exist)."""
        logger.debug("lmcache_npu: node cache slots are the service's; ignoring a usable-slot report %s", usable)

    def occupancy(self) -> dict[Tier, tuple[int, int]]:
        now = time.monotonic()
        if self._occupancy is not None and now - self._occupancy[0] < OCCUPANCY_TTL_S:
            return self._occupancy[1]
        use = self._call(Verb.OCCUPANCY, missing=None, valid=replies.occupancy)
        if use is None:
            return {Tier.ARENA: (0, self.num_slots), Tier.DISK: (0, self.disk_chunks)}
        self._occupancy = (now, use)
        return use

    def location(self, key: ChunkKey) -> tuple[Optional[int], SlotState, DiskState]:
        return self._call(Verb.LOCATION, key, missing=(None, SlotState.FREE, DiskState.NONE), valid=replies.location)

    def chunks(self) -> list[ChunkView]:
        return self._call(Verb.CHUNKS, missing=[], valid=replies.chunk_views)

    def sync(self) -> None:
        """Collects what one-way calls caused since the last answer (their counters, the node's tier changes): the
        scheduler asks before it hands vLLM the step's KV events."""
        self._call(Verb.SYNC)

    def adopt_disk(self, keys: Iterable[ChunkKey]) -> int:
        return self._call(Verb.ADOPT_DISK, list(keys), missing=0, valid=replies.count)

    def drop_disk_copies(self, keys: Iterable[ChunkKey]) -> None:
        self._call(Verb.DROP_DISK_COPIES, list(keys))

    def set_tier_listener(self, listener: Optional[TierListener]) -> None:
        """The node's tier changes reach `listener` with the answers to this engine's calls (the service queues
        them for the engine while it wants them)."""
        if listener is not None and not callable(listener):
            raise ValueError(f"tier listener must be callable or None, got {type(listener).__name__}")
        self._listener = listener
        wanted = listener is not None
        if wanted != self._events:
            self._events = wanted  # also said by every later attach (a reconnect)
            self._call(Verb.EVENTS, wanted)
