"""The store (DESIGN §7): chunk keys, host arena, scheduler-owned index, worker executor, disk and Mooncake tiers.

The scheduler builds one `ChunkIndex` (`factory.build_index`); every worker builds a `StoreExecutor` over its own
`HostArena` and tiers (`factory.build_executor`). The index emits `commands`; executors answer `Completion`s.
"""

from .arena import HostArena, slots_for_capacity
from .commands import Command, Completion, Drop, Load, Persist, Promote, Put, Source, Spill, Store
from .config import StoreConfig, parse_bytes
from .executor import DeviceMover, StoreExecutor
from .factory import build_executor, build_index, disk_keys_on_every_rank
from .index import ChunkIndex, DiskState, LookupResult, SlotState, disk_chunks_for_capacity
from .keys import ChunkKey, check_stable_hashing, chunk_keys, layout_fingerprint, model_fingerprint, namespace_of
from .tier import OK, TierCounters, TierResult

__all__ = [
    "OK",
    "ChunkIndex",
    "ChunkKey",
    "Command",
    "Completion",
    "DeviceMover",
    "DiskState",
    "Drop",
    "HostArena",
    "Load",
    "LookupResult",
    "Persist",
    "Promote",
    "Put",
    "SlotState",
    "Source",
    "Spill",
    "Store",
    "StoreConfig",
    "StoreExecutor",
    "TierCounters",
    "TierResult",
    "build_executor",
    "build_index",
    "check_stable_hashing",
    "chunk_keys",
    "disk_chunks_for_capacity",
    "disk_keys_on_every_rank",
    "layout_fingerprint",
    "model_fingerprint",
    "namespace_of",
    "parse_bytes",
    "slots_for_capacity",
]
