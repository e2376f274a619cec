"""One chunk as the index holds it: its arena slot and that slot's state, its pins, and its disk copy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..keys import ChunkKey
from .contract import DiskState, SlotState


@dataclass
class Entry:
    key: ChunkKey
    slot: Optional[int] = None
    slot_state: SlotState = SlotState.FREE
    readers: int = 0  # in-flight loads, puts and persists reading the slot
    reservations: set[str] = field(default_factory=set)  # requests between lookup and load
    disk: DiskState = DiskState.NONE
    disk_readers: int = 0  # in-flight promotions reading the file
    disk_cmd: int = 0  # the spill or persist that is writing the current disk copy
    remote_put: bool = False  # a put of this chunk is in flight or done
    holders: Optional[dict[str, int]] = None  # per holder (limit_holders): its reservations and loads of this chunk
    chunk_index: Optional[int] = None  # its position in the request that stored it (the cost model's admission)
    sealing: int = 0  # its slot's envelope is being written off the lock (not a reader: reports stay READY)

    @property
    def pinned(self) -> bool:
        return self.readers > 0 or bool(self.reservations) or self.sealing > 0

    @property
    def has_copy(self) -> bool:
        return self.slot is not None or self.disk is not DiskState.NONE
