"""Sealing behind the stores: each chunk an engine's store committed gets its envelope written soon after, off the
service's lock, so a crash leaves it adoptable by the next start (`fd_store.py`, `rebuild.py`).

Chunks leave the arena sealed anyway when they are spilled, persisted or put; this seals the others. It runs only
where a crash can be recovered (systemd keeps the pools' memory): a planned hand-over seals what is left itself. A
chunk being sealed is pinned in the index (never evicted or reused meanwhile, `Entry.sealing`): a trailer written
over bytes a new store replaced could name the old chunk for the new bytes, and a successor would serve them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Optional

from ..store.keys import ChunkKey
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

BATCH = 64  # chunks pinned and sealed per turn


class SealBehind:
    """One per pool (`pool`: its lock, index and executors); `note` runs under the pool's lock."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._queue: deque[tuple[int, ChunkKey]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.idle = threading.Event()  # nothing queued or being sealed (tests, benchmarks)
        self.idle.set()
        self._thread: Optional[threading.Thread] = threading.Thread(target=self._loop, name="lmcache-node-seal",
                                                                    daemon=True)
        self._thread.start()

    def note(self, slot: int, key: ChunkKey) -> None:
        """A store of `key` into `slot` committed (under the pool's lock)."""
        self._queue.append((slot, key))
        self.idle.clear()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            while self._queue and not self._stop.is_set():
                try:
                    self._seal_some()
                except Exception:  # a chunk left unsealed costs only its recovery after a crash
                    logger.exception("node cache pool %s: sealing behind the stores failed",
                                     self.pool.geometry.namespace)
            if not self._queue:
                self.idle.set()

    def _seal_some(self) -> None:
        pool = self.pool
        with pool.lock:
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            pinned = [(slot, key) for slot, key in batch if pool.index.pin_for_sealing(key, slot)]
        try:
            for slot, key in pinned:
                for executor in pool.executors:
                    executor.seal_slot(slot, key)
        finally:
            with pool.lock:
                for _, key in pinned:
                    pool.index.unpin_sealed(key)
                pool.index.counters.add(Metric.SEALED_BEHIND, len(pinned))
