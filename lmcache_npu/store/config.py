"""The store's configuration keys (the `kv_connector_extra_config` subset the store reads; DESIGN §9).

Sizes are bytes, given as integers or strings with a unit ("64GiB", "512MB", "1.5TiB"). Unknown keys are an error
that lists the valid ones; every value is checked here, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..platform.ascend_host import parse_requested
from .mooncake_config import MooncakeConfig
from .policies import POLICIES
from .sections import parse_bytes, parse_section
from ..platform.vm import PAGE_BYTES as SLOT_ALIGN_BYTES, parse_hugepages

__all__ = ["MooncakeConfig", "StoreConfig", "parse_bytes", "parse_section"]


@dataclass(frozen=True)
class StoreConfig:
    """Where chunks live. Capacities are per rank: every rank has its own arena and its own disk files."""

    cpu_bytes: int = 8 << 30  # host arena (L1) per rank
    numa_node: Optional[int] = None  # bind the arena to this NUMA node (the accelerator's); None: first touch
    pinned: Optional[bool] = None  # page-lock the arena; None: when an accelerator is present
    arena_segment_bytes: int = 2 << 30  # the arena is mapped and registered in pieces of this size (whole slots)
    hugepages: str = "auto"  # arena pages: auto (transparent hugepages where offered), off, 2M or 1G (MAP_HUGETLB)
    # how an Ascend host makes the arena DMA-able: auto (from its driver, kernel and SoC: aclrtHostRegister ->
    # aclrtMallocHost -> halHostRegister), or one of those three alone
    npu_host_memory: str = "auto"
    disk_path: Optional[str] = None  # L2: directory for chunk files (local NVMe); None: no disk tier
    disk_bytes: int = 0  # L2 capacity per rank; required with disk_path
    disk_max_pending_bytes: int = 256 << 20  # write-behind queue; a spill beyond it is dropped and counted
    disk_writer_threads: int = 2
    # every stored or promoted-from-remote chunk is also written to disk in the background, so a restart finds it;
    # false: the disk only receives evicted chunks
    disk_write_through: bool = True
    mooncake: Optional[Mapping[str, Any]] = None  # L3: MooncakeConfig keys (master, metadata, ...); None: off
    put_to_remote: bool = True  # write every stored chunk through to Mooncake (how other instances find it)
    io_threads: int = 4  # per worker: promotions, puts and remote drops run on these
    eviction_policy: str = "arc"  # the arena's eviction order: arc, lru or s3fifo (chosen in docs/performance.md)
    # reuse gates (0: off): a chunk is put to Mooncake only once this many later requests looked it up
    remote_admit_hits: int = 0
    # an evicted chunk is spilled to disk only once this many later requests looked it up (write-through, when on,
    # still writes every chunk at once)
    disk_admit_hits: int = 0

    _SIZES = ("cpu_bytes", "disk_bytes", "disk_max_pending_bytes", "arena_segment_bytes")

    def __post_init__(self) -> None:
        if self.cpu_bytes <= 0:
            raise ValueError(f"cpu_bytes must be positive (the host arena is the first tier), got {self.cpu_bytes}")
        if self.numa_node is not None and (isinstance(self.numa_node, bool) or not isinstance(self.numa_node, int)
                                           or self.numa_node < 0):
            raise ValueError(f"numa_node must be a NUMA node number (>= 0) or null, got {self.numa_node!r}")
        if self.pinned is not None and not isinstance(self.pinned, bool):
            raise ValueError(f"pinned must be true, false or null (auto), got {self.pinned!r}")
        if self.arena_segment_bytes < SLOT_ALIGN_BYTES:
            raise ValueError(f"arena_segment_bytes must be at least one page ({SLOT_ALIGN_BYTES} B), got "
                             f"{self.arena_segment_bytes}")
        parse_hugepages(self.hugepages)
        parse_requested(self.npu_host_memory)
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path
                                           or "\0" in self.disk_path):  # the OS refuses NUL later, unnamed
            raise ValueError(f"disk_path must be a directory path (no NUL characters), got {self.disk_path!r}")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be set (> 0) when disk_path is ({self.disk_path!r}): it caps the "
                             f"chunk files each rank keeps there")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("disk_bytes is set but disk_path is not: name the directory for chunk files")
        for key in ("disk_writer_threads", "io_threads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{key} must be an integer from 1 to 64, got {value!r}")
        if self.disk_max_pending_bytes <= 0:
            raise ValueError(f"disk_max_pending_bytes must be positive, got {self.disk_max_pending_bytes}")
        if not isinstance(self.disk_write_through, bool):
            raise ValueError(f"disk_write_through must be true or false, got {self.disk_write_through!r}")
        if not isinstance(self.put_to_remote, bool):
            raise ValueError(f"put_to_remote must be true or false, got {self.put_to_remote!r}")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(sorted(POLICIES))}, "
                             f"got {self.eviction_policy!r}")
        for key in ("remote_admit_hits", "disk_admit_hits"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
                raise ValueError(f"{key} must be an integer from 0 (no reuse gate) to 1000, got {value!r}")
        if self.mooncake is not None:
            MooncakeConfig.from_dict(self.mooncake)  # its errors name the mooncake key

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "StoreConfig":
        """From the store's keys of `kv_connector_extra_config`; an unknown key is refused with the valid ones."""
        parsed = parse_section("store", cls, values, cls._SIZES)
        if parsed.get("mooncake") is not None and not isinstance(parsed["mooncake"], Mapping):
            raise ValueError(f"mooncake must be an object of Mooncake settings, got {parsed['mooncake']!r}")
        return cls(**parsed)

    def mooncake_config(self) -> Optional[MooncakeConfig]:
        """The parsed Mooncake settings, or None when the remote tier is off."""
        if self.mooncake is None:
            return None
        return MooncakeConfig.from_dict(self.mooncake)
