"""A worker's mapping of the node cache across epochs: which epoch its arena is, mapping the next one in the
background, and giving back the ones that are gone.

- Attaching (connect, map, register every segment with the device: minutes per TiB) runs on a thread of its own,
  never inside a step. Until an epoch's mapping is complete the worker has none for it, and fails the commands of
  that epoch (loads recompute, stores are not made) rather than make the step wait. The scheduler hands out no
  command of an epoch before every rank reported it mapped (`epoch` here, sent with the worker's metadata).
- The scheduler names its epoch every step (`follow`): "" when it has none. A mapping whose connection the service
  closed (it died or restarted) is retired when the scheduler names another epoch or none, and unmapped once the
  commands that were in flight on it have settled (`settle`): a restarted service never finds the old pages still
  held by every engine (twice the memory; with hugepages the new pool could not even be made). A mapping whose
  service lives is kept while the scheduler is away (a slow call is not a dead service) and replaced once the epoch
  the scheduler names is mapped.
- A warm restart keeps the epoch (the successor adopted the very pages). A mapping whose service closed it is kept
  when that service said its epoch lives on (a planned hand-over) or when the scheduler names that same epoch again:
  the worker attaches again in the background without mapping or registering a byte (`node_rebinds`), and serves
  from its mapping meanwhile. Only when that attach finds the epoch gone is the mapping retired.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Collection, Iterable, Optional, Union

from ..store.arena import HostArena
from ..store.metrics import Metric
from ..store.tier import TierCounters
from . import client, wire
from .attachment import UnmappedArena, WorkerAttachment, map_worker_arena
from .client import RETRY_S, NodeCacheRefused, connect
from .messages import HANDOVER, PROTOCOL_VERSION, Attach, Attached, PoolGeometry

logger = logging.getLogger(__name__)


def service_alive(sock: socket.socket) -> bool:
    """Whether the service still holds this connection (it sends a worker nothing after the attach, so a readable
    socket is one it closed); never blocks."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    events = poller.poll(0)
    if not events:
        return True
    if events[0][1] & (select.POLLHUP | select.POLLERR):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""  # readable: data, or the end of it
    except BlockingIOError:
        return True
    except OSError:
        return False


def handed_over(sock: socket.socket) -> list[str]:
    """The epochs the service said live on in its successor before it closed `sock` (empty: it said nothing)."""
    said = wire.peek_message(sock)
    if type(said) is tuple and len(said) == 2 and said[0] == HANDOVER and isinstance(said[1], list):
        return [epoch for epoch in said[1] if isinstance(epoch, str)]
    return []


class WorkerNodeMapping:
    """Rank `rank`'s mapping of the pool for `geometry` at `path`, epoch after epoch. Every method but the attach
    thread's runs on the worker's step thread."""

    def __init__(self, path: str, engine: str, geometry: PoolGeometry, rank: int, counters: TierCounters, *,
                 weights: str, pinned: Optional[bool], npu_host_memory: str = "auto", retry_s: float = RETRY_S) -> None:
        """`weights`: how the engine's identity names its weights (messages.WEIGHTS_*)."""
        self.path = path
        self.weights = weights
        self.engine = engine
        self.geometry = geometry
        self.rank = rank
        self.counters = counters
        self.pinned = pinned
        self.npu_host_memory = npu_host_memory
        self.retry_s = retry_s
        self.current: Optional[WorkerAttachment] = None  # mapped and registered whole
        self.unmapped = UnmappedArena(geometry.object_bytes)
        self._lock = threading.Lock()
        self._attaching: Optional[threading.Thread] = None
        self._done: Optional[WorkerAttachment] = None  # a background attach's mapping, not taken up yet
        self._next_try = 0.0
        self._said = ""  # the last failure logged as a warning (said once)
        self._closed = False
        self._mapped_once = False
        self._rebinding = False  # the current mapping's service closed it, and its epoch may live on: attaching again
        self._rebound: Optional[tuple[socket.socket, Attached]] = None  # that attach's connection, same epoch
        self._rebind_failed = False  # that attach found the epoch gone, or no service
        self.retired: list[tuple[WorkerAttachment, set[int]]] = []  # old mappings and their commands in flight

    @property
    def arena(self) -> Union[HostArena, UnmappedArena]:
        """What the executor runs commands against: the current epoch's mapping, or no slot at all."""
        return self.current.arena if self.current is not None else self.unmapped

    @property
    def epoch(self) -> Optional[str]:
        """The epoch mapped (and registered) here, None while none is."""
        return self.current.epoch if self.current is not None else None

    @property
    def lease(self) -> str:
        """The scheduler's lease the current mapping's connection is bound to ("" none yet)."""
        return self.current.lease if self.current is not None else ""

    def join(self, token: str) -> bool:
        """Binds the current mapping's connection to the scheduler's lease `token` (WorkerAttachment.join); False
        when nothing is mapped or no live lease has it."""
        return self.current is not None and self.current.join(token)

    def start(self, wait_s: float) -> None:
        """Attaches in the background and waits up to `wait_s` for it (the pool exists: milliseconds); an engine
        starts without the node cache when it is not done by then (the service away, the pool being made)."""
        thread = self._begin()
        if thread is not None:
            thread.join(timeout=wait_s)
        self._take_up(())

    def follow(self, wanted: Optional[str], in_flight: Collection[int]) -> bool:
        """The scheduler names epoch `wanted` for this step ("" none, None: it names none at all): whether the step's
        commands may run here. Takes up a finished attach, retires a mapping whose service is gone, and starts mapping
        `wanted` when it is not; `in_flight` are the commands submitted so far (the retired mapping's among them)."""
        self._take_up(in_flight)
        current = self.current
        if wanted is None:  # a scheduler that does not name epochs: whatever is mapped
            return current is not None
        if current is not None and not self._rebinding and not service_alive(current.sock):
            if current.epoch == wanted or current.epoch in handed_over(current.sock):
                self._rebind()  # the same pages live on in a successor: attach again, map nothing
            else:
                self._retire(current, in_flight)  # that epoch is gone: unmapped once its commands settle
                current = None
        if current is not None and current.epoch == wanted:
            return True
        if wanted:
            self._begin()
        return False

    def _rebind(self) -> None:
        self._rebinding = True
        with self._lock:
            self._next_try = 0.0
        self._begin()

    def settle(self, completed: Iterable[int]) -> None:
        """Commands that completed: a retired mapping none of whose commands is in flight any more is given back."""
        if not self.retired:
            return
        done = set(completed)
        keep = []
        for attachment, pending in self.retired:
            pending -= done
            if pending:
                keep.append((attachment, pending))
            else:
                self._release(attachment)
        self.retired = keep

    def close(self) -> None:
        with self._lock:
            self._closed = True
            done, self._done = self._done, None
        for attachment in [self.current, done, *(a for a, _ in self.retired)]:
            if attachment is not None:
                attachment.arena.close()
                attachment.close()
        self.current, self.retired = None, []

    # ---- internals ------------------------------------------------------------------------------------------------

    def _begin(self) -> Optional[threading.Thread]:
        """Starts a background attach when none runs and the last one is long enough ago."""
        with self._lock:
            if self._attaching is not None or self._closed or time.monotonic() < self._next_try:
                return None
            self._attaching = threading.Thread(target=self._attach, name=f"lmcache-node-map-r{self.rank}",
                                               daemon=True)
            self._attaching.start()
            return self._attaching

    def _attach(self) -> None:
        mapped: Optional[WorkerAttachment] = None
        rebound: Optional[tuple[socket.socket, Attached]] = None
        current, rebinding = self.current, self._rebinding
        retry_s = self.retry_s
        try:
            lease = current.lease if rebinding and current is not None else ""
            sock, attached, fds = connect(self.path, Attach(self.engine, self.geometry, self.rank, weights=self.weights,
                                                          protocol=PROTOCOL_VERSION, lease=lease), 0.0)
            if current is not None and _same_pages(attached, current):  # mapped already: nothing to register
                for fd in fds:
                    wire.close_fd(fd)
                if rebinding:
                    rebound = (sock, attached)
                else:
                    sock.close()
            else:
                mapped = map_worker_arena(sock, attached, fds, self.rank, pinned=self.pinned,
                                          npu_host_memory=self.npu_host_memory)
        except (ConnectionError, OSError, MemoryError, ValueError) as exc:
            if isinstance(exc, (NodeCacheRefused, MemoryError)):  # not for a while: no pool, or no registration
                retry_s = max(retry_s, client.REFUSED_RETRY_S)
            if str(exc) != self._said:
                logger.warning("lmcache_npu rank %d: node cache not mapped (%s); this rank fails the node's commands "
                               "until it is", self.rank, exc)
                self._said = str(exc)
        with self._lock:
            self._attaching = None
            self._next_try = time.monotonic() + retry_s
            if self._closed:
                if mapped is not None:
                    mapped.arena.close()
                    mapped.close()
                if rebound is not None:
                    rebound[0].close()
            elif mapped is not None:
                self._done = mapped
            elif rebound is not None:
                self._rebound = rebound
            elif rebinding:
                self._rebind_failed = True

    def _take_up(self, in_flight: Collection[int]) -> None:
        with self._lock:
            done, self._done = self._done, None
            rebound, self._rebound = self._rebound, None
            failed, self._rebind_failed = self._rebind_failed, False
        current = self.current
        if rebound is not None and current is not None:
            self._rebinding = False
            stale, current.sock, current.lease = current.sock, rebound[0], rebound[1].lease
            stale.close()
            self.counters.add(Metric.NODE_REBINDS)
            logger.info("lmcache_npu rank %d: the node cache at %s kept epoch %s across its restart: mapping kept, "
                        "attached again", self.rank, self.path, current.epoch)
        elif failed and current is not None and self._rebinding and done is None:
            self._rebinding = False
            self._retire(current, in_flight)  # no successor has that epoch: unmapped once its commands settle
        if done is None:
            return
        self._rebinding = False
        if self.current is not None:
            self._retire(self.current, in_flight)
        self.current = done
        self._said = ""
        if self._mapped_once:
            self.counters.add(Metric.EPOCH_CHANGES)
        self._mapped_once = True
        logger.info("lmcache_npu rank %d: mapped the node cache at %s (epoch %s, %d slots)", self.rank, self.path,
                    done.epoch, done.arena.num_slots)

    def _retire(self, attachment: WorkerAttachment, in_flight: Collection[int]) -> None:
        if self.current is attachment:
            self.current = None
        self.retired.append((attachment, set(in_flight)))
        if not in_flight:
            self.settle(())

    def _release(self, attachment: WorkerAttachment) -> None:
        """Unregisters and unmaps off the step (unregistering a large mapping takes a while); the lease that
        connection held ends with it."""
        self.counters.add(Metric.NODE_EPOCH_RELEASES)
        logger.info("lmcache_npu rank %d: unmapping the node cache's epoch %s (its commands settled)", self.rank,
                    attachment.epoch)

        def release() -> None:
            attachment.arena.close()
            attachment.close()

        threading.Thread(target=release, name=f"lmcache-node-unmap-r{self.rank}", daemon=True).start()


def _same_pages(attached: Attached, mapping: WorkerAttachment) -> bool:
    """Whether an attach's answer is the pool `mapping` maps: its epoch, laid out as mapped."""
    arena = mapping.arena
    return (attached.epoch == mapping.epoch and attached.num_slots == arena.num_slots
            and attached.object_bytes == arena.object_bytes)
