"""A planned hand-over of the node cache to a successor (`node-cache --take-over`): the host cache stays warm, its
epochs stay the same, and the node never holds two pools' memory.

The successor connects to the running service's own socket and asks (`messages.HANDOVER`; only a process of the
service's uid may, and the successor checks the service's credentials as engines do). The predecessor then
1. stops handing out device commands (lookups miss, stores are not made, a load is refused so vLLM recomputes it),
2. waits up to the drain time for the commands its engines still run to be answered (their answers still count),
3. seals every ready slot it has not sealed yet (its envelope names the chunk and proves the bytes: the successor
   adopts only what verifies, `rebuild.py`), and notes the slots of commands still unanswered (torn: they rest),
4. stops accepting and sends its state (per pool: geometry, epoch, layout, command id high-water mark, torn slots,
   lease tokens) and its descriptors over SCM_RIGHTS: the listening socket first (connections wait in its backlog,
   no moment without a listener, the socket path is never unlinked), then every rank's segment files,
5. once the successor acknowledged them all, tells its workers the epochs live on, closes every connection and its
   pools (the disk tier flushes and lets go of its lock), says so, and exits. Engines attach again to the same epoch.
Until the acknowledgement nothing is lost: a successor that fails or goes away leaves the predecessor serving.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from ..store.index.contract import LookupResult
from . import wire
from .messages import HANDOVER, PROTOCOL_VERSION, PoolGeometry, Refused, Verb
from .rebuild import VERIFY_THREADS, InheritedArena

if TYPE_CHECKING:
    from .pool import NodePool


class HandoverHost(Protocol):
    """What a hand-over drives of the predecessor (`service.NodeCacheService`)."""

    lock: Any
    pools: dict

    def freeze(self) -> bool:
        ...

    def thaw(self) -> None:
        ...

    def pause_accepting(self) -> None:
        ...

    @property
    def listener_fd(self) -> int:
        ...

    def retire_after_handover(self, last_word: Callable[[], None]) -> None:
        ...

logger = logging.getLogger(__name__)

DRAIN_S = 30.0  # how long a predecessor waits for its engines' device commands (a load or store takes milliseconds)
STATE_WAIT_S = 900.0  # beyond the drain: sealing a large arena's unsealed slots takes a while
RELEASE_WAIT_S = 300.0  # the predecessor's disk tiers flush their write-behind queues before it lets go
ACK_WAIT_S = 60.0
STATE, FDS, ACK, RELEASED = "handover-state", "handover-fds", "handover-ack", "handover-released"


class HandoverFailed(ConnectionError):
    """The successor could not take over (nothing was lost: the predecessor serves on, or there was none)."""


@dataclass
class Succession:
    """What a successor takes over: the listening socket and each pool's memory."""

    listener: socket.socket
    pools: list[tuple[PoolGeometry, InheritedArena]]
    predecessor_pid: int


# ---- the predecessor's side ---------------------------------------------------------------------------------------

def frozen_answer(verb: str, arguments: tuple) -> tuple[bool, Any]:
    """(True, the answer) for a verb that would hand out device commands while the service hands over: a cache that
    holds nothing. A load refused is recomputed by vLLM, never waited for."""
    if verb == Verb.LOOKUP:
        return True, LookupResult(0, 0)
    if verb == Verb.PRESENCE:
        hashes = arguments[1] if len(arguments) == 3 else None
        if not isinstance(hashes, list):
            raise ValueError("presence needs (namespace, hashes, remote)")
        return True, [False] * len(hashes)
    if verb == Verb.PREPARE_STORE:
        return True, []
    if verb == Verb.PREPARE_LOAD:
        raise ValueError("the node cache is handing over to its successor: no load is handed out (recomputed)")
    return False, None


class Handover:
    """Runs the predecessor's side on the connection the successor asked on (the service's connection thread)."""

    def __init__(self, service: HandoverHost) -> None:
        self.service = service

    def run(self, connection: socket.socket, request: tuple) -> bool:
        """Whether the pools were handed over (the service is closed then); a refusal or failure leaves it serving."""
        drain_s = _request_drain(request)
        if isinstance(drain_s, str):
            wire.send(connection, Refused(drain_s))
            return False
        service = self.service
        if not service.freeze():
            wire.send(connection, Refused("a hand-over is under way already"))
            return False
        began = time.monotonic()
        committed = False
        fds: list[int] = []
        try:
            left = self._drain(drain_s)
            with service.lock:
                state, fds = self._describe(left)
            service.pause_accepting()
            _send_state(connection, state, [service.listener_fd, *fds])
            connection.settimeout(ACK_WAIT_S)
            ack = wire.receive_request(connection)
            if ack != (ACK, len(fds) + 1):
                raise HandoverFailed(f"the successor answered {ack!r}, not the acknowledgement of {len(fds) + 1} "
                                     "descriptors")
            committed = True
        except (OSError, wire.WireError, HandoverFailed) as exc:
            logger.warning("node cache: the hand-over to a successor failed (%s); serving on", exc)
            return False
        finally:
            for fd in fds:  # the successor holds its own now
                os.close(fd)
            if not committed:
                service.thaw()
        chunks = sum(pool["chunks"] for pool in state["pools"])
        service.retire_after_handover(lambda: _say_released(connection))
        logger.info("node cache: handed %d pool(s) (%d chunk(s), %d still-unanswered command slot(s)) to pid %s in "
                    "%.2f s", len(state["pools"]), chunks, sum(len(pool["torn"]) for pool in state["pools"]),
                    _peer_pid(connection), time.monotonic() - began)
        return True

    def _drain(self, drain_s: float) -> int:
        """Waits up to `drain_s` for every pool's commands to be answered; how many are still unanswered."""
        deadline = time.monotonic() + drain_s
        while True:
            with self.service.lock:
                left = sum(pool.index.in_flight for pool in self.service.pools.values())
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.01)

    def _describe(self, unanswered: int) -> tuple[dict, list[int]]:
        """Every pool's state and descriptors, its ready slots sealed (under the service's lock: nothing moves)."""
        pools, fds = [], []
        for pool in self.service.pools.values():
            torn = pool.index.pending_slots()
            ready = [(slot, key) for slot, key in pool.index.ready_chunks() if slot not in torn]
            _seal(pool, ready)
            for rank in range(pool.geometry.world):  # duplicates: a pool given back meanwhile closes only its own
                fds += [os.dup(fd) for fd in pool.segment_fds(rank)]
            arena = pool.arenas[0]
            pools.append({"geometry": pool.geometry, "epoch": pool.epoch, "num_slots": arena.num_slots,
                          "segment_bytes": pool.store.arena_segment_bytes, "hugepages": pool.store.hugepages,
                          "segments": len(arena.segment_fds), "next_cmd_id": pool.index.next_command_id,
                          "torn": sorted(torn), "chunks": len(ready),
                          "tokens": {lease.engine: lease.token for lease in pool.leases.values() if lease.token}})
        if unanswered:
            logger.warning("node cache: %d command(s) still unanswered after the drain; their slots rest in the "
                           "successor's quarantine", unanswered)
        return {"pid": os.getpid(), "pools": pools, "fds": len(fds) + 1}, fds


def _seal(pool: "NodePool", ready: list[tuple[int, Any]]) -> None:
    """Seals `ready` on every rank (digests on a few threads: they release the GIL)."""
    work = [(executor, slot, key) for executor in pool.executors for slot, key in ready]
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="lmcache-node-seal") as threads:
        list(threads.map(lambda item: item[0].seal_slot(item[1], item[2]), work))


def _say_released(connection: socket.socket) -> None:
    """Tells the successor this service let go (its workers were told, its disk tiers flushed)."""
    try:
        wire.send(connection, (RELEASED,))
    except OSError:
        pass


def _request_drain(request: tuple) -> Any:
    """The drain seconds a hand-over request asks for, or why it is refused (a str)."""
    if len(request) != 3 or request[1] != PROTOCOL_VERSION:
        return (f"this service speaks node cache protocol {PROTOCOL_VERSION}: a hand-over needs a successor of the "
                "same protocol (run it from the same lmcache_npu release, or restart cold)")
    drain_s = request[2]
    if isinstance(drain_s, bool) or not isinstance(drain_s, (int, float)) or not 0 <= drain_s <= 3600:
        return f"a hand-over's drain time must be 0-3600 seconds, got {drain_s!r}"
    return float(drain_s)


def _send_state(connection: socket.socket, state: dict, fds: list[int]) -> None:
    wire.send(connection, (STATE, state))
    for first in range(0, len(fds), wire.MAX_FDS):
        batch = fds[first:first + wire.MAX_FDS]
        wire.send(connection, (FDS, len(batch)), batch)


def _peer_pid(connection: socket.socket) -> int:
    try:
        return wire.peer_credentials(connection)[0]
    except OSError:
        return -1


def same_uid(connection: socket.socket) -> bool:
    """Only a process of this service's own uid may take it over (a `--group` member may attach, not take over)."""
    try:
        uid = wire.peer_credentials(connection)[1]
    except OSError:
        return False
    return uid == os.getuid()


# ---- the successor's side -----------------------------------------------------------------------------------------

def take_over(path: str, drain_s: float = DRAIN_S, check_peer: Optional[Callable[[socket.socket, str], None]] = None
              ) -> Optional[Succession]:
    """The running service's pools and listening socket at `path`; None when none listens there (a cold start).
    HandoverFailed when it refused or the hand-over broke off (it serves on, unless it had acknowledged)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received: list[int] = []
    try:
        sock.settimeout(10.0)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        if not same_uid(sock):
            raise HandoverFailed(f"the node cache at {path} runs as another user: only a service of this uid "
                                 f"({os.getuid()}) is taken over")
        if check_peer is not None:
            check_peer(sock, path)
        wire.send(sock, (HANDOVER, PROTOCOL_VERSION, drain_s))
        sock.settimeout(drain_s + STATE_WAIT_S)
        reply, fds = wire.receive_with_fds(sock)
        received += fds
        if isinstance(reply, Refused):
            raise HandoverFailed(f"the node cache at {path} refused the hand-over: {reply.reason}")
        state = _state(reply)
        while len(received) < state["fds"]:
            reply, fds = wire.receive_with_fds(sock)
            received += fds
            if reply != (FDS, len(fds)) or not fds:
                raise HandoverFailed(f"the hand-over sent {reply!r} with {len(fds)} descriptor(s)")
        if len(received) != state["fds"]:
            raise HandoverFailed(f"the hand-over sent {len(received)} descriptors, announced {state['fds']}")
        succession = _succession(state, received)
        received = []  # the succession owns them now
        try:
            wire.send(sock, (ACK, state["fds"]))
        except OSError:
            _abandon(succession)
            raise
    except (OSError, wire.WireError, ValueError, KeyError, TypeError) as exc:
        raise HandoverFailed(f"taking over the node cache at {path} failed: {exc}") from exc
    finally:
        for fd in received:
            wire.close_fd(fd)
    try:
        sock.settimeout(RELEASE_WAIT_S)
        released = wire.receive(sock)
        if released != (RELEASED,):
            logger.warning("node cache: the predecessor ended the hand-over with %r", released)
    except (OSError, wire.WireError) as exc:  # it acknowledged: its pools are ours whatever it says now
        logger.warning("node cache: the predecessor did not say it let go (%s); going on", exc)
    finally:
        sock.close()
    return succession


def _state(reply: Any) -> dict:
    if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == STATE and isinstance(reply[1], dict)):
        raise HandoverFailed(f"the predecessor answered {type(reply).__name__}, not its state")
    state = reply[1]
    if not isinstance(state.get("pools"), list) or not isinstance(state.get("fds"), int) or state["fds"] < 1:
        raise HandoverFailed("the predecessor's state names no pools or descriptors")
    return state


def _succession(state: dict, fds: list[int]) -> Succession:
    """The listener (the first descriptor) and each pool's files, checked against what the state announces before
    any is taken: on a refusal the caller still owns (and closes) every descriptor."""
    position = 1
    pools = []
    for described in state["pools"]:
        geometry = described["geometry"]
        if not isinstance(geometry, PoolGeometry) or not isinstance(described["segments"], int):
            raise HandoverFailed(f"a pool of the predecessor's state is malformed: {described!r}")
        per_rank = []
        for _ in range(geometry.world):
            per_rank.append(fds[position:position + described["segments"]])
            position += described["segments"]
        tokens = {str(engine): str(token) for engine, token in dict(described["tokens"]).items()}
        pools.append((geometry, InheritedArena(
            epoch=str(described["epoch"]), num_slots=int(described["num_slots"]),
            segment_bytes=int(described["segment_bytes"]), hugepages=str(described["hugepages"]), fds=per_rank,
            next_cmd_id=int(described["next_cmd_id"]), torn=frozenset(map(int, described["torn"])), tokens=tokens)))
    if position != len(fds):
        raise HandoverFailed(f"the predecessor's pools name {position} descriptors, it sent {len(fds)}")
    kind = socket.socket(fileno=os.dup(fds[0]))  # a probe of the first one: a listening Unix stream socket?
    try:
        listening = (kind.family, kind.type, kind.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)) == (
            socket.AF_UNIX, socket.SOCK_STREAM, 1)
    finally:
        kind.close()
    if not listening:
        raise HandoverFailed("the first descriptor handed over is not a listening Unix socket")
    for fd in fds:
        os.set_inheritable(fd, False)
    return Succession(socket.socket(fileno=fds[0]), pools, int(state.get("pid", -1)))


def _abandon(succession: Succession) -> None:
    succession.listener.close()
    for _, inherited in succession.pools:
        inherited.close(range(len(inherited.fds)))
