"""A warm-restarted pool's index, rebuilt from its slots' sealed envelopes (store/envelope.py).

A pool that inherits its predecessor's memory (a planned hand-over, or systemd's file-descriptor store after a crash)
knows nothing of what the slots hold. Every slot whose trailer names a chunk of the pool's namespace is a candidate;
it becomes that chunk's ready copy only once its envelope verifies on every rank against the pool's sealer (digest,
and the MAC when a store secret is set): a torn, stale or forged slot is never served. The rest are free.

Verification is eager, in the background: candidates are held (never handed out, never looked up) from the pool's
first moment and adopted batch by batch as threads digest them, so engines attach at once, a chunk is a hit as soon
as its batch verified, and the cost is paid once per restart instead of on the load path under the service's lock
(a lazy check at the first load would put a digest of every rank's bytes into a verb every engine waits on).

Slots the predecessor still had a command on (a write may still land, a read may still run) rest in quarantine
instead of being adopted. After a crash nobody knows which those are, so every slot not adopted rests first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from ..store.envelope import ENVELOPE_BYTES, sealed_names, verify
from ..store.keys import ChunkKey
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

BATCH_SLOTS = 256  # slots verified per task and adopted per turn of the lock
VERIFY_THREADS = max(1, min(8, os.cpu_count() or 1))  # digests release the GIL: a few cores verify in parallel


class ArenaPool(Protocol):
    """What a rebuild reads and changes of its pool (`pool.NodePool`)."""

    lock: Any
    index: Any  # its ChunkIndex
    arenas: list  # per rank, a HostArena
    executors: list  # per rank, a StoreExecutor (its sealer verifies)
    geometry: Any
    epoch: str

    def dispatch(self) -> None:
        ...


@dataclass
class InheritedArena:
    """A predecessor's pool memory: per rank its segment files in segment order (this pool owns them from now on), the
    layout they were made with, and what it may have left running."""

    epoch: str
    num_slots: int
    segment_bytes: int
    hugepages: str
    fds: list[list[int]]
    next_cmd_id: int = 0  # every command id the predecessor issued is below this (0: unknown)
    torn: Optional[frozenset[int]] = None  # slots of its unanswered commands (None: unknown, after a crash)
    tokens: dict[str, str] = field(default_factory=dict)  # engine -> the lease token its scheduler held

    def close(self, ranks: range) -> None:
        """Closes the segment files of `ranks` (nothing maps them: a pool that refused them, or failed to map)."""
        for rank in ranks:
            for fd in self.fds[rank]:
                try:
                    os.close(fd)
                except OSError:
                    pass


@dataclass
class RebuildReport:
    candidates: int = 0  # slots whose trailer names a chunk of this pool
    adopted: int = 0
    duplicates: int = 0  # verified, but the chunk had a slot already (stored again meanwhile)
    rejected: Counter = field(default_factory=Counter)  # why a candidate did not verify -> how many
    torn: int = 0
    seconds: float = 0.0


class ArenaRebuild:
    """Rebuilds `pool`'s index from its arenas (`start` under no lock; the pool's own lock is taken per batch)."""

    def __init__(self, pool: ArenaPool, torn: Optional[frozenset[int]]) -> None:
        self.pool = pool
        self.torn = torn
        self.report = RebuildReport()
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._unsettled: set[int] = set()  # candidates held and not adopted or freed yet
        self._began = time.monotonic()

    def start(self) -> None:
        """Holds every slot until it is settled, rests the torn ones, and verifies the candidates on a thread."""
        candidates = self._candidates()
        pool = self.pool
        with pool.lock:
            index = pool.index
            everything = range(index.num_slots)
            if self.torn is None:  # after a crash: any slot may still be written; none is reused before it rested
                held = set(index.hold_slots(everything))
                resting = held.difference(candidates)
            else:
                held = set(index.hold_slots([*candidates, *self.torn]))
                resting = held.intersection(self.torn)
            index.free_held(sorted(resting), rest=True)
            candidates = {slot: key for slot, key in candidates.items() if slot in held and slot not in resting}
            self._unsettled = set(candidates)
            self.report.torn = len(resting) if self.torn is not None else 0
            self.report.candidates = len(candidates)
            index.counters.add(Metric.TORN_SLOTS, self.report.torn)
        self._thread = threading.Thread(target=self._verify_all, args=(sorted(candidates.items()),),
                                        name="lmcache-node-rebuild", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _candidates(self) -> dict[int, ChunkKey]:
        """Slot -> the chunk of this pool its rank-0 trailer names (read from the trailers only: no digest yet)."""
        arena = self.pool.arenas[0]
        namespace = self.pool.geometry.namespace
        found: dict[int, ChunkKey] = {}
        for segment in arena.memory.segments:
            rows = arena.memory.segment_view(segment.index).reshape(segment.num_slots, arena.slot_bytes)
            names = sealed_names(rows[:, arena.object_bytes:arena.object_bytes + ENVELOPE_BYTES])
            for within, name in enumerate(names):
                if name is not None and name[0] == namespace and name[2] == 0:
                    found[segment.first_slot + within] = ChunkKey(namespace, name[1])
        return found

    def _check(self, batch: list[tuple[int, ChunkKey]]) -> list[tuple[int, ChunkKey, Optional[str]]]:
        """Each slot's verdict: None when its envelope verifies for its key on every rank, else the first why not."""
        pool = self.pool
        checked = []
        for slot, key in batch:
            why = None
            for rank, (arena, executor) in enumerate(zip(pool.arenas, pool.executors)):
                why = verify(arena.sealed_view(slot), key, rank, executor.sealer)
                if why is not None:
                    why = f"rank {rank}: {why}"
                    break
            checked.append((slot, key, why))
        return checked

    def _verify_all(self, candidates: list[tuple[int, ChunkKey]]) -> None:
        batches = [candidates[i:i + BATCH_SLOTS] for i in range(0, len(candidates), BATCH_SLOTS)]
        threads = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="lmcache-node-verify")
        try:
            for checked in threads.map(self._check, batches):
                if self._stop.is_set():
                    break
                self._adopt(checked)
        except Exception:  # a bug here must not leave slots held for ever: the rest become free
            logger.exception("node cache pool %s: rebuilding the index from the arena failed; the slots not checked "
                             "yet are freed", self.pool.geometry.namespace)
        finally:
            threads.shutdown(wait=True, cancel_futures=True)  # a stopped rebuild digests nothing more
            self._release_unchecked()
            self.report.seconds = time.monotonic() - self._began
            self.done.set()
        if not self._stop.is_set():
            self._log()

    def _adopt(self, checked: list[tuple[int, ChunkKey, Optional[str]]]) -> None:
        pool, report = self.pool, self.report
        with pool.lock:
            adopted = rejected = 0
            for slot, key, why in checked:
                self._unsettled.discard(slot)
                if why is not None:
                    pool.index.free_held([slot], rest=True)  # bytes not what the trailer says: a write landed late?
                    report.rejected[why.partition(": ")[2]] += 1
                    rejected += 1
                elif pool.index.adopt_slot(slot, key):
                    for executor in pool.executors:
                        executor.mark_sealed(slot, key)
                    adopted += 1
                else:
                    report.duplicates += 1
            report.adopted += adopted
            pool.index.counters.add(Metric.ADOPTED_CHUNKS, adopted)
            pool.index.counters.add(Metric.ADOPTION_REJECTED, rejected)
            pool.dispatch()  # adopting issues nothing today; a policy that did must not leave it queued

    def _release_unchecked(self) -> None:
        """Slots still held (the rebuild stopped or failed before their batch) become free after a rest."""
        pool = self.pool
        with pool.lock:
            unsettled, self._unsettled = sorted(self._unsettled), set()
            if unsettled:
                pool.index.free_held(unsettled, rest=True)

    def _log(self) -> None:
        report = self.report
        rejected = sum(report.rejected.values())
        logger.info("node cache pool %s (epoch %s): index rebuilt from the arena's envelopes in %.2f s: %d chunk(s) "
                    "adopted of %d sealed slot(s)%s%s%s", self.pool.geometry.namespace, self.pool.epoch,
                    report.seconds, report.adopted, report.candidates,
                    f", {rejected} rejected ({dict(report.rejected)})" if rejected else "",
                    f", {report.duplicates} stored again meanwhile" if report.duplicates else "",
                    f", {report.torn} torn slot(s) rest in quarantine" if report.torn else "")
        if rejected:
            logger.warning("node cache pool %s: %d slot(s) whose envelope did not verify were not adopted (never "
                           "served): %s", self.pool.geometry.namespace, rejected, dict(report.rejected))
