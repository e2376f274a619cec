"""A rank's share of a chunk object whose tail is replicated across the tensor-parallel group (docs/storage.md
"Replicated KV").

The full chunk object (what the transfer kernels read and write, `TransferPlan.object_bytes`) is
`[own planes][replicated planes]`: `replicated_offset` splits the two, both 64-byte aligned. Every rank keeps its
own part whole; the replicated tail is cut by bytes into `size` equal shares of `share_bytes` (the tail divided by
the group size, rounded up to 64 bytes), rank r keeping `[r * share_bytes, (r + 1) * share_bytes)` of the tail,
clipped to its end (the last shares may be short or empty). The object a rank stores (arena slot, disk file,
Mooncake object) is `[own part][its share, zero padded to share_bytes]`: the same size on every rank, so the arenas
keep one slot numbering. Shares are disjoint and cover the tail exactly (`share_range`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ..ops.plan import OBJECT_ALIGN_BYTES, align_up


@dataclass(frozen=True)
class ShareLayout:
    """How one rank's stored object maps onto the full chunk object."""

    full_bytes: int  # the whole chunk object of the plan
    replicated_offset: int  # where the replicated tail starts; full_bytes when nothing is replicated
    rank: int
    size: int  # ranks in the tensor-parallel group

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"share layout: group size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"share layout: rank {self.rank} is outside a group of {self.size}")
        if self.full_bytes < 0 or not 0 <= self.replicated_offset <= self.full_bytes:
            raise ValueError(f"share layout: replicated offset {self.replicated_offset} must lie in the object's "
                             f"{self.full_bytes} B")
        if self.replicated_offset % OBJECT_ALIGN_BYTES:
            raise ValueError(f"share layout: replicated offset {self.replicated_offset} is not a multiple of "
                             f"{OBJECT_ALIGN_BYTES} B")

    @property
    def own_bytes(self) -> int:
        """The part every rank keeps whole (its head-split planes)."""
        return self.replicated_offset

    @property
    def replicated_bytes(self) -> int:
        return self.full_bytes - self.replicated_offset

    @property
    def share_bytes(self) -> int:
        """Bytes every rank reserves for its share: the tail over the group size, rounded up to 64 B."""
        return align_up(-(-self.replicated_bytes // self.size), OBJECT_ALIGN_BYTES) if self.replicated_bytes else 0

    @property
    def object_bytes(self) -> int:
        """The object each rank stores: its own part and its (padded) share."""
        return self.own_bytes + self.share_bytes

    def share_range(self, rank: int) -> tuple[int, int]:
        """[begin, end) of `rank`'s share in the full object (empty where the tail ran out)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"share layout: rank {rank} is outside a group of {self.size}")
        begin = self.replicated_offset + min(rank * self.share_bytes, self.replicated_bytes)
        end = self.replicated_offset + min((rank + 1) * self.share_bytes, self.replicated_bytes)
        return begin, end

    def fingerprint(self, layout_fingerprint: bytes) -> bytes:
        """The layout fingerprint of a stored share object: the plan's, the group size and the split (not the rank,
        which names the object already, so every rank reports the same one)."""
        text = f"share v1 size {self.size} own {self.own_bytes} tail {self.replicated_bytes} share {self.share_bytes}"
        return hashlib.sha256(layout_fingerprint + text.encode()).digest()[:16]

    def _check(self, full: torch.Tensor, stored: torch.Tensor) -> None:
        if full.numel() < self.full_bytes or stored.numel() < self.object_bytes:
            raise ValueError(f"share layout: full object of {full.numel()} B (needs {self.full_bytes}) or stored "
                             f"object of {stored.numel()} B (needs {self.object_bytes}) is too small")

    def pack(self, full: torch.Tensor, stored: torch.Tensor) -> None:
        """Full chunk object -> this rank's stored object (own part, then its share, zeros after it)."""
        self._check(full, stored)
        own = self.own_bytes
        begin, end = self.share_range(self.rank)
        stored[:own].copy_(full[:own])
        stored[own:own + end - begin].copy_(full[begin:end])
        stored[own + end - begin:self.object_bytes].zero_()

    def share_of(self, stored: torch.Tensor) -> torch.Tensor:
        """This rank's padded share inside its stored object (`share_bytes`, what it contributes to the gather)."""
        return stored[self.own_bytes:self.object_bytes]

    def assemble(self, stored: Sequence[torch.Tensor], gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Full chunk objects (`full`, one row per object, on any device) from this rank's stored objects (their own
        parts, host memory) and every rank's padded shares of them, rank-major (`size x len(stored) x share_bytes`,
        on `full`'s device: the gather's output)."""
        count = len(stored)
        if full.dim() != 2 or full.shape[0] != count or full.shape[1] < self.full_bytes:
            raise ValueError(f"share layout: full objects of shape {tuple(full.shape)}, {count} rows of at least "
                             f"{self.full_bytes} B expected")
        if gathered.numel() < self.size * count * self.share_bytes:
            raise ValueError(f"share layout: {gathered.numel()} B gathered, {self.size} x {count} shares of "
                             f"{self.share_bytes} B expected")
        for obj in stored:
            if obj.numel() < self.object_bytes:
                raise ValueError(f"share layout: stored object of {obj.numel()} B, {self.object_bytes} B expected")
        if self.own_bytes:
            own = torch.stack([obj[:self.own_bytes] for obj in stored])
            # pinned, so the copy to a device is asynchronous and torch keeps the buffer until it is done
            full[:, :self.own_bytes].copy_(own if full.device.type == "cpu" else own.pin_memory(), non_blocking=True)
        by_rank = gathered[:self.size * count * self.share_bytes].view(self.size, count, self.share_bytes)
        tail = by_rank.permute(1, 0, 2).reshape(count, self.size * self.share_bytes)
        full[:, self.replicated_offset:self.full_bytes].copy_(tail[:, :self.replicated_bytes])
