"""A small, independent oracle of DESIGN §4: one row at a time, byte offsets into raw buffers.

It shares nothing with lmcache_npu but the formula; every test geometry is allocated here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from lmcache_npu.ops import GroupSpec, PageLayout, Plane, TransferPlan


@dataclass
class RawPlane:
    """A plane's memory as the test owns it: a raw byte buffer and where block 0 starts."""

    raw: torch.Tensor  # 1-D uint8, includes slack before block 0 and after the last block
    offset: int
    num_blocks: int
    rows_per_block: int
    row_bytes: int
    block_stride: int
    group: int
    nz_unit: int = 0  # 0: ND
    dtype: torch.dtype = torch.uint8

    def row_offsets(self, slot: int) -> list[tuple[int, int]]:
        """(byte offset in raw, length) pieces that make up the row at `slot`, in row order."""
        block, row = divmod(slot, self.rows_per_block)
        base = self.offset + block * self.block_stride
        if not self.nz_unit:
            return [(base + row * self.row_bytes, self.row_bytes)]
        cols = self.row_bytes // self.nz_unit
        return [(base + col * self.rows_per_block * self.nz_unit + row * self.nz_unit, self.nz_unit) for col in range(cols)]

    def plane(self, name: str) -> Plane:
        pages = torch.as_strided(self.raw, (self.num_blocks, self.rows_per_block * self.row_bytes),
                                 (self.block_stride, 1), self.offset)
        layout = PageLayout.FRACTAL_NZ if self.nz_unit else PageLayout.ND
        return Plane(pages, self.group, self.rows_per_block, self.row_bytes, layout, self.nz_unit, self.dtype, name)


def allocate(num_blocks: int, rows_per_block: int, row_bytes: int, pad: int, group: int, generator: torch.Generator,
             nz_unit: int = 0, dtype: torch.dtype = torch.uint8, slack: int = 96) -> RawPlane:
    stride = rows_per_block * row_bytes + pad
    total = slack + (num_blocks - 1) * stride + rows_per_block * row_bytes + slack
    raw = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator)
    return RawPlane(raw, slack, num_blocks, rows_per_block, row_bytes, stride, group, nz_unit, dtype)


@dataclass
class Geometry:
    groups: list[GroupSpec]
    raw_planes: list[RawPlane]
    chunk_tokens: int
    names: list[str] = field(default_factory=list)

    def plan(self) -> TransferPlan:
        names = self.names or [f"p{i}" for i in range(len(self.raw_planes))]
        return TransferPlan(self.groups, [rp.plane(n) for rp, n in zip(self.raw_planes, names)], self.chunk_tokens)


def small_geometry() -> Geometry:
    """Two groups (one compressed 4x), three planes with odd row widths: the validation and host tests' geometry."""
    g = torch.Generator().manual_seed(3)
    return Geometry([GroupSpec(16), GroupSpec(64, compress_ratio=4)],
                    [allocate(4, 16, 132, 8, 0, g), allocate(4, 16, 2, 0, 0, g), allocate(3, 16, 64, 0, 1, g)], 32)


def good_slots() -> list[np.ndarray]:
    """One chunk of `small_geometry` that every check accepts."""
    return [np.arange(32).reshape(1, 32), np.arange(8).reshape(1, 8)]


def oracle_object_layout(geometry: Geometry) -> tuple[list[int], list[int], int]:
    """Plan order (group-major, stable), 64 B aligned segment offsets, total object bytes."""
    order = sorted(range(len(geometry.raw_planes)), key=lambda i: geometry.raw_planes[i].group)
    order = [i for i in order if not geometry.groups[geometry.raw_planes[i].group].skip]
    offsets, cursor = [], 0
    for i in order:
        rp = geometry.raw_planes[i]
        g = geometry.groups[rp.group]
        tokens = geometry.chunk_tokens if g.sliding_window is None else min(geometry.chunk_tokens, g.sliding_window)
        cursor = (cursor + 63) // 64 * 64
        offsets.append(cursor)
        cursor += tokens // g.compress_ratio * rp.row_bytes
    return order, offsets, (cursor + 63) // 64 * 64


def payload_mask(geometry: Geometry) -> np.ndarray:
    """True for the object bytes that belong to a plane segment; alignment gaps carry no data."""
    order, offsets, total = oracle_object_layout(geometry)
    mask = np.zeros(total, dtype=bool)
    for i, off in zip(order, offsets):
        rp = geometry.raw_planes[i]
        g = geometry.groups[rp.group]
        tokens = geometry.chunk_tokens if g.sliding_window is None else min(geometry.chunk_tokens, g.sliding_window)
        mask[off: off + tokens // g.compress_ratio * rp.row_bytes] = True
    return mask


def oracle_store(geometry: Geometry, slots: list[Optional[np.ndarray]], objects: np.ndarray) -> np.ndarray:
    """objects (chunks, object_bytes) after a store; skipped rows become zeros, gaps stay as they were."""
    out = objects.copy()
    order, offsets, _ = oracle_object_layout(geometry)
    for i, off in zip(order, offsets):
        rp = geometry.raw_planes[i]
        raw = rp.raw.cpu().numpy()
        for c in range(out.shape[0]):
            for r, slot in enumerate(slots[rp.group][c]):
                dst = off + r * rp.row_bytes
                if slot < 0:
                    out[c, dst:dst + rp.row_bytes] = 0
                    continue
                pos = dst
                for start, length in rp.row_offsets(int(slot)):
                    out[c, pos:pos + length] = raw[start:start + length]
                    pos += length
    return out


def oracle_load(geometry: Geometry, slots: list[Optional[np.ndarray]], objects: np.ndarray) -> list[np.ndarray]:
    """Every raw plane buffer after a load; skipped rows and everything else stay as they were."""
    result = [rp.raw.cpu().numpy().copy() for rp in geometry.raw_planes]
    order, offsets, _ = oracle_object_layout(geometry)
    for i, off in zip(order, offsets):
        rp = geometry.raw_planes[i]
        for c in range(objects.shape[0]):
            for r, slot in enumerate(slots[rp.group][c]):
                if slot < 0:
                    continue
                pos = off + r * rp.row_bytes
                for start, length in rp.row_offsets(int(slot)):
                    result[i][start:start + length] = objects[c, pos:pos + length]
                    pos += length
    return result
