"""A worker's side of the node cache: its rank's segments of the pool, mapped into this process, as the host arena its
device moves read and write (the same kernels and lanes as a private arena), and the connection that holds its lease.
`worker_mapping.py` keeps them across epochs.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Optional

from ..store.arena import HostArena, slot_bytes_for
from ..store.envelope import ENVELOPE_BYTES
from ..store.metrics import Metric
from . import wire
from .client import connect
from .messages import PROTOCOL_VERSION, Attach, Attached, PoolGeometry

logger = logging.getLogger(__name__)


@dataclass
class WorkerAttachment:
    """A worker's mapping of its rank's shared arena, and the connection that holds its lease once bound to it
    (`lease`: the token of its scheduler's lease, "" before it joined one)."""

    sock: socket.socket
    arena: HostArena
    epoch: str
    lease: str = ""

    def join(self, token: str) -> bool:
        """Binds this connection to the lease of `token` (its scheduler's, named in the step's metadata) before
        any of that scheduler's commands runs here; False when no live lease has it (or the service is gone)."""
        try:
            wire.send(self.sock, ("join", token))
            reply = wire.receive(self.sock)
        except (OSError, wire.WireError) as exc:
            logger.warning("lmcache_npu: could not join the node cache lease: %s", exc)
            return False
        joined = isinstance(reply, tuple) and len(reply) == 4 and reply[:2] == ("ok", True)
        if joined:
            self.lease = token
        return joined

    def close(self) -> None:
        self.sock.close()


def attach_worker_arena(path: str, engine: str, geometry: PoolGeometry, rank: int, *, weights: str,
                        pinned: Optional[bool], npu_host_memory: str = "auto", timeout_s: float = 30.0,
                        lease: str = "") -> WorkerAttachment:
    """Maps rank `rank`'s segments of the pool for `geometry`; pinned (None: where an accelerator is) means every
    segment is registered with the device before this returns (the node's slots are all live, so a worker must
    reach all of them), and a segment that cannot be is an error naming why. `weights`: how the engine's identity
    names its weights (messages.WEIGHTS_*). `lease`: the scheduler's lease token when this worker knows it (bound
    at once; otherwise it joins with the first step that names it)."""
    sock, attached, fds = connect(path, Attach(engine, geometry, rank, weights=weights, protocol=PROTOCOL_VERSION,
                                               lease=lease), timeout_s)
    return map_worker_arena(sock, attached, fds, rank, pinned=pinned, npu_host_memory=npu_host_memory)


def map_worker_arena(sock: socket.socket, attached: Attached, fds: list[int], rank: int, *, pinned: Optional[bool],
                     npu_host_memory: str = "auto") -> WorkerAttachment:
    """The segment files `fds` an attach of rank `rank` received, mapped (and registered, see attach_worker_arena);
    the attachment keeps `sock`. Closes both when it fails."""
    try:
        arena = HostArena(attached.num_slots, attached.object_bytes, pinned=pinned,
                          segment_bytes=attached.segment_bytes, hugepages=attached.hugepages, prefault=False,
                          npu_host_memory=npu_host_memory, shared_fds=fds)
    except BaseException:
        sock.close()
        for fd in fds:
            wire.close_fd(fd)
        raise
    arena.memory.close_segment_files()  # the mappings hold the files now
    if arena.pinned:
        arena.wait_ready()
        failed = [s for s in arena.memory.segments if s.error]
        if failed:
            arena.close()
            sock.close()
            raise MemoryError(f"rank {rank}: node cache segments {[s.index for s in failed]} could not be made "
                              f"DMA-able for this device ({failed[0].error}); the node cache needs host registration "
                              "of shared memory (docs/deployment.md, \"Node cache\")")
    return WorkerAttachment(sock, arena, attached.epoch, attached.lease)


class UnmappedArena:
    """The arena of a worker with no node cache epoch mapped (the service away, its pool still being made, or the
    epoch's segments still being registered): no slot, so nothing is handed to it; the worker fails the node's
    commands before they reach its executor."""

    num_slots = 0
    pinned = False
    contiguous = True

    def __init__(self, object_bytes: int) -> None:
        self.object_bytes = object_bytes
        self.sealed_bytes = object_bytes + ENVELOPE_BYTES
        self.slot_bytes = slot_bytes_for(object_bytes)

    def usable_ranges(self) -> tuple[tuple[int, int], ...]:
        return ()

    def registration_ranges(self) -> list[tuple[int, int]]:
        return []

    def segment_stats(self) -> dict[str, int]:
        return {Metric.ARENA_BYTES: 0, Metric.ARENA_LIVE_BYTES: 0, Metric.SEGMENTS_LIVE: 0, Metric.SEGMENTS_TOTAL: 0}

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        return True

    def close(self) -> None:
        """Nothing is mapped."""
