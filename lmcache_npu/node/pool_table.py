"""The service's pools, one per geometry, and their lifecycle: found without waiting, made once per geometry, at most
`max_pools` of them, and given back when no engine has held a lease on them for a while.

- An attach to an existing pool never waits: the table is read under the verbs' lock before any creation starts.
- Making a pool maps and pre-faults its memory, scans its disk tier and connects Mooncake (minutes on a large node).
  Each geometry has its own creation (a future the attaches of that geometry wait on), so an attach of another
  geometry, or of a pool that exists, never waits behind it.
- A new geometry beyond `max_pools` takes the place of an idle pool (no lease: no engine has a connection to it),
  the one idle longest first; with none idle it is refused, and the engine serves without the node cache.
- `reap()` gives back the pools idle for `idle_s` (the service calls it from a thread of its own), so a model
  roll-out does not hold the old model's memory until the service restarts.
- `inherit()` takes in the pools a predecessor left (a hand-over, systemd's descriptor store): each keeps its epoch
  and counts as idle until an engine attaches. A `keeper` (systemd's descriptor store) is told of every pool made and
  every one given back, so it holds the memory of exactly the pools in the table.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Protocol, TypeVar

from ..store.config import StoreConfig
from .capacity import NodeCapacity
from .messages import PoolGeometry
from .pool import COMMAND_TTL_S, NodePool, PoolRefused
from .rebuild import InheritedArena

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PoolKeeper(Protocol):
    """Keeps pools' memory beyond this process (systemd's descriptor store)."""

    def keep(self, pool: NodePool) -> None:
        ...

    def forget(self, pool: NodePool) -> None:
        ...


class PoolTable:
    """`pools` is read by the service's verbs and metrics under `lock`; each pool gets an equal share of `capacity`
    (one of `max_pools`) and the tier settings `tiers`; `closed` set means no pool is made any more."""

    def __init__(self, capacity: NodeCapacity, tiers: StoreConfig, max_pools: int, idle_s: float, instance: str, lock: threading.RLock,
                 closed: threading.Event, command_ttl_s: float = COMMAND_TTL_S,
                 keeper: Optional[PoolKeeper] = None, seal_behind: bool = False) -> None:
        if idle_s < 0:
            raise ValueError(f"the idle time before a pool is given back must be >= 0 seconds, got {idle_s}")
        self.share = capacity.pool_share(max_pools)
        self.tiers = tiers
        self.max_pools = max_pools
        self.idle_s = idle_s
        self.instance = instance
        self.lock = lock
        self.closed = closed
        self.command_ttl_s = command_ttl_s
        self.keeper = keeper
        self.seal_behind = seal_behind  # pools seal committed stores off the lock (a crash can be recovered)
        self.pools: dict[PoolGeometry, NodePool] = {}
        self.reclaimed = 0  # pools given back (idle past idle_s, or to make room for a new geometry)
        self._making: dict[PoolGeometry, Future] = {}  # geometry -> its creation under way
        self._made = 0  # every pool's epoch is new, also after a pool of the same geometry was given back

    def acquire(self, geometry: PoolGeometry, take: Callable[[NodePool], T]) -> tuple[NodePool, T]:
        """The geometry's pool (made on its first attach) and `take(pool)`, run under `lock` while the pool is in the
        table: what it leases cannot be in a pool given back meanwhile."""
        while True:
            pool, taken = self._find_or_make(geometry, take)
            if taken is not None:
                return pool, taken[0]
            with self.lock:
                if self.pools.get(geometry) is pool:
                    return pool, take(pool)
            # given back between its making and this attach (a roll-out's other geometry took its place): again

    def _find_or_make(self, geometry: PoolGeometry,
                      take: Callable[[NodePool], T]) -> tuple[NodePool, tuple[T] | None]:
        with self.lock:
            pool = self.pools.get(geometry)
            if pool is not None:
                return pool, None
            if self.closed.is_set():
                raise PoolRefused("the node cache is shutting down")
            future = self._making.get(geometry)
            victims: list[NodePool] = []
            if future is None:
                victims = self._make_room(geometry)
                future = self._making[geometry] = Future()
                epoch = f"{self.instance}/{self._made}"
                self._made += 1
                mine = True
            else:
                mine = False
        self._close(victims)  # outside the lock: a pool's pump thread takes it
        if not mine:
            return future.result(), None  # that creation's pool, or its error
        try:
            pool = NodePool(geometry, self.share, self.tiers, epoch, self.lock, command_ttl_s=self.command_ttl_s,
                            seal_behind=self.seal_behind)
        except Exception as exc:
            with self.lock:
                del self._making[geometry]
            future.set_exception(exc)
            raise
        taken = None
        with self.lock:
            del self._making[geometry]
            inserted = not self.closed.is_set()
            if inserted:
                self.pools[geometry] = pool
                try:
                    taken = (take(pool),)  # leased before anyone may take this idle pool's place
                except Exception:
                    future.set_result(pool)  # the pool is made: its other attaches go on without this one
                    raise
        if not inserted:  # made while the service closed: nothing else will close it
            pool.close()
            refused = PoolRefused("the node cache is shutting down")
            future.set_exception(refused)
            raise refused
        future.set_result(pool)
        self._keep(pool)
        return pool, taken

    def inherit(self, pools: list[tuple[PoolGeometry, InheritedArena]]) -> list[NodePool]:
        """Makes the pools a predecessor left, each on its memory and epoch (at most `max_pools`; the others, and one
        this configuration would lay out otherwise, are refused: their files closed, their chunks lost, never
        misread). Called before the service accepts engines."""
        made = []
        for number, (geometry, inherited) in enumerate(pools):
            if number >= self.max_pools or geometry in self.pools:
                logger.error("node cache: the inherited pool of %s (epoch %s) is not kept: %s", geometry.describe(),
                             inherited.epoch, f"--max-pools is {self.max_pools}" if number >= self.max_pools else
                             "a second pool of that geometry")
                inherited.close(range(len(inherited.fds)))
                continue
            try:
                pool = NodePool(geometry, self.share, self.tiers, inherited.epoch, self.lock,
                                command_ttl_s=self.command_ttl_s, inherited=inherited, seal_behind=self.seal_behind)
            except (PoolRefused, ValueError, OSError, MemoryError) as exc:
                logger.error("node cache: the inherited pool of %s is not adopted: %s", geometry.describe(), exc)
                continue
            with self.lock:
                self.pools[geometry] = pool
            self._keep(pool)
            made.append(pool)
        return made

    def _keep(self, pool: NodePool) -> None:
        if self.keeper is not None:
            try:
                self.keeper.keep(pool)
            except OSError as exc:  # the pool serves regardless; only a crash would lose its chunks
                logger.warning("node cache: the pool of %s is not kept beyond this process: %s",
                               pool.geometry.describe(), exc)

    def _make_room(self, geometry: PoolGeometry) -> list[NodePool]:
        """The idle pools that give their place to `geometry` (taken out of the table); PoolRefused when the table is
        full of pools engines hold. Called under `lock`."""
        needed = len(self.pools) + len(self._making) + 1 - self.max_pools
        if needed <= 0:
            return []
        idle = sorted((pool for pool in self.pools.values() if not pool.leases), key=lambda pool: pool.idle_since)
        if len(idle) < needed:
            held = "; ".join(g.describe() for g in [*self.pools, *self._making])
            raise PoolRefused(f"the node cache holds {len(self.pools) + len(self._making)} pool(s) (--max-pools "
                              f"{self.max_pools}), each with an engine attached: {held}; this engine's geometry "
                              f"({geometry.describe()}) needs another. It serves without the node cache and attaches "
                              "once a pool is idle (no engine attached), or start the service with a larger "
                              "--max-pools (each pool gets an equal share of --cpu-bytes)")
        victims = idle[:needed]
        for pool in victims:
            self._take_out(pool, f"to make room for {geometry.describe()}")
        return victims

    def _take_out(self, pool: NodePool, why: str) -> None:
        del self.pools[pool.geometry]
        self.reclaimed += 1
        logger.info("node cache: gave back the pool of %s (no engine attached for %.0f s) %s",
                    pool.geometry.describe(), time.monotonic() - pool.idle_since, why)

    def reap(self) -> int:
        """Gives back every pool no engine has held a lease on for `idle_s`; how many."""
        now = time.monotonic()
        with self.lock:
            victims = [pool for pool in self.pools.values() if not pool.leases and now - pool.idle_since >= self.idle_s]
            for pool in victims:
                self._take_out(pool, f"after --pool-idle-seconds {self.idle_s:g}")
        self._close(victims)
        return len(victims)

    def _close(self, pools: list[NodePool]) -> None:
        for pool in pools:
            if self.keeper is not None:
                try:
                    self.keeper.forget(pool)  # given back for good: not held beyond this process either
                except OSError as exc:
                    logger.warning("node cache: the pool of %s is still kept beyond this process: %s",
                                   pool.geometry.describe(), exc)
            pool.close()  # its disk tier flushes; its memory goes once nothing maps it (no engine does: no lease)

    def take_all(self) -> list[NodePool]:
        """Every pool, taken out of the table (the service closes them). Called under `lock`."""
        pools, self.pools = list(self.pools.values()), {}
        return pools
