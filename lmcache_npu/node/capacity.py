"""The node cache's sizes in the service's own scope (issue 42 item 2): one meaning per key.

An engine's `cpu_bytes` and `disk_bytes` (`StoreConfig`) are per rank. The service is told the node's host memory
and disk for the cache, every pool and rank together (`NodeCapacity`: `node-cache --cpu-bytes/--disk-path/
--disk-bytes`); each pool gets an equal share (`PoolShare`, `--max-pools` of them), and each of a pool's ranks an
engine-scoped `StoreConfig` that is made here and only here, its slots from the one `slots_for_capacity`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..checks import check_int
from ..store.arena import slot_bytes_for, slots_for_capacity
from ..store.config import StoreConfig


class PoolRefused(ValueError):
    """The pool cannot be made (no memory for one slot per rank, a disk tier that holds no chunk)."""


@dataclass(frozen=True)
class PoolShare:
    """One pool's part of the node, all its ranks together."""

    cpu_bytes: int
    disk_path: Optional[str] = None
    disk_bytes: int = 0

    def rank_store(self, tiers: StoreConfig, object_bytes: int, world: int, describe: str = "") -> StoreConfig:
        """The per-rank configuration of a pool of `world` ranks (`tiers`' settings, this share's sizes): the arena
        holds whole slots only, so its `cpu_bytes` is a multiple of the slot. PoolRefused when a rank's part holds no
        slot."""
        per_rank, slot_bytes = self.cpu_bytes // world, slot_bytes_for(object_bytes)
        if per_rank < slot_bytes:
            raise PoolRefused(f"the node cache's {self.cpu_bytes} B for this pool hold no slot of {slot_bytes} B on "
                              f"each of {world} ranks ({describe}); raise --cpu-bytes")
        slots = slots_for_capacity(per_rank, object_bytes)
        return dataclasses.replace(tiers, cpu_bytes=slots * slot_bytes, disk_path=self.disk_path,
                                   disk_bytes=self.disk_bytes // world)


@dataclass(frozen=True)
class NodeCapacity:
    """The node's host memory and disk for the cache, every pool and rank together."""

    cpu_bytes: int
    disk_path: Optional[str] = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        check_int("the node cache's cpu_bytes (--cpu-bytes)", self.cpu_bytes, lo=1)
        check_int("the node cache's disk_bytes (--disk-bytes)", self.disk_bytes, lo=0)
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError(f"the node cache's disk needs both --disk-path and --disk-bytes (got disk_path "
                             f"{self.disk_path!r}, disk_bytes {self.disk_bytes})")

    def pool_share(self, max_pools: int) -> PoolShare:
        """An equal share for each of `max_pools` pools (decided: fixed shares, docs/deployment.md)."""
        check_int("max_pools", max_pools, lo=1)
        return PoolShare(self.cpu_bytes // max_pools, self.disk_path, self.disk_bytes // max_pools)


def check_node_store(capacity: NodeCapacity, tiers: StoreConfig) -> None:
    """The service's tier settings carry no sizes or disk of their own: those are the node's (`capacity`), and in a
    `StoreConfig` they would read as an engine's per-rank keys. The disk is checked by StoreConfig's own rules."""
    default = StoreConfig()
    if tiers.cpu_bytes != default.cpu_bytes or tiers.disk_bytes or tiers.disk_path is not None:
        raise ValueError("the node cache's sizes and disk go in its NodeCapacity (--cpu-bytes, --disk-path, "
                         "--disk-bytes), not in its tier settings, whose cpu_bytes and disk_bytes are an engine's "
                         f"per-rank keys (got cpu_bytes {tiers.cpu_bytes}, disk_path {tiers.disk_path!r}, "
                         f"disk_bytes {tiers.disk_bytes})")
    dataclasses.replace(tiers, cpu_bytes=capacity.cpu_bytes, disk_path=capacity.disk_path,
                        disk_bytes=capacity.disk_bytes)  # raises what StoreConfig refuses of such a disk
