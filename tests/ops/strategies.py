"""Hypothesis strategies for transfer geometries and slot mappings (structure drawn, bytes seeded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from hypothesis import strategies as st

from lmcache_npu.ops import GroupSpec, rows_per_chunk

from .oracle import Geometry, allocate

# (dtype, element size) pairs; fp8 travels as plain bytes.
DTYPES = [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4), (torch.int8, 1), (torch.uint8, 1)]
ODD_ROW_BYTES = [1, 2, 3, 33, 132, 576, 1152]


@dataclass
class Case:
    geometry: Geometry
    slots: list[Optional[np.ndarray]]
    num_chunks: int
    seed: int


def _slot_matrix(rng: np.random.Generator, num_chunks: int, rows: int, rows_per_block: int, num_blocks: int,
                 holes: float, shuffles: int) -> np.ndarray:
    """Distinct slots: a random block table, a random start inside the first block, some -1 and swaps."""
    start = int(rng.integers(0, rows_per_block))
    table = rng.permutation(num_blocks)
    logical = np.arange(num_chunks * rows) + start
    slots = table[logical // rows_per_block] * rows_per_block + logical % rows_per_block
    slots = slots.reshape(num_chunks, rows).astype(np.int64)
    if holes:
        slots[rng.random(slots.shape) < holes] = -1
    flat = slots.reshape(-1)
    for _ in range(shuffles):
        a, b = rng.integers(0, flat.size, 2)
        flat[a], flat[b] = flat[b], flat[a]
    return slots


@st.composite
def cases(draw: st.DrawFn, soc: str = "a2", max_chunks: int = 16) -> Case:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    chunk_tokens = draw(st.sampled_from([16, 32, 64, 128, 256]))
    num_chunks = draw(st.integers(1, max_chunks))
    groups: list[GroupSpec] = []
    raw_planes = []
    slots: list[Optional[np.ndarray]] = []
    for g in range(draw(st.integers(1, 3))):
        ratio = draw(st.sampled_from([r for r in (1, 4, 128) if chunk_tokens % r == 0]))
        window = draw(st.one_of(st.none(), st.sampled_from([8, 16, 64, 128, 1024])))
        if window is not None and min(chunk_tokens, window) % ratio:
            window = None
        rows_per_block = draw(st.sampled_from([1, 16, 64, 128, 256, 512]))  # above 128: the DMA count caps
        skip = draw(st.sampled_from([False, False, False, True]))
        groups.append(GroupSpec(rows_per_block * ratio, ratio, window, skip, "state" if skip else ""))
        rows = rows_per_chunk(chunk_tokens, ratio, window)
        num_blocks = -(-(num_chunks * rows + rows_per_block) // rows_per_block) + draw(st.integers(0, 2))
        for _ in range(draw(st.integers(1, 3))):
            nz_unit = 0
            if soc == "310p":
                dtype, size = draw(st.sampled_from([d for d in DTYPES if d[0] != torch.bfloat16]))
                if draw(st.booleans()) and size in (2, 4):
                    nz_unit = 16 * size
                    row_bytes = nz_unit * draw(st.integers(1, 8))
                else:
                    row_bytes = 32 * draw(st.integers(1, 40))
            else:
                dtype, size = draw(st.sampled_from(DTYPES))
                if size in (2, 4) and draw(st.integers(0, 7)) == 0:  # FRACTAL_NZ pages are legal on A2/A3 too
                    nz_unit = 16 * size
                    row_bytes = nz_unit * draw(st.integers(1, 8))
                else:
                    row_bytes = draw(st.one_of(st.sampled_from(ODD_ROW_BYTES),
                                               st.integers(1, 300).map(lambda n, size=size: n * size)))
            pad = draw(st.sampled_from([0, 0, 13, 32, 512]))
            raw_planes.append(allocate(num_blocks, rows_per_block, row_bytes, pad, g, generator, nz_unit, dtype))
        holes = draw(st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0]))
        shuffles = draw(st.sampled_from([0, 0, 1, 5]))
        matrix = _slot_matrix(rng, num_chunks, rows, rows_per_block, num_blocks, holes, shuffles)
        slots.append(None if skip and draw(st.booleans()) else matrix)
    return Case(Geometry(groups, raw_planes, chunk_tokens), slots, num_chunks, seed)


@dataclass
class Placement:
    """Two planes' pages placed in one buffer: block bytes, stride, block count, start offset and group of each."""

    block_bytes: tuple[int, int]
    stride: tuple[int, int]
    num_blocks: tuple[int, int]
    offset: tuple[int, int]
    group: tuple[int, int]

    @property
    def buffer_bytes(self) -> int:
        return max(o + (n - 1) * s + b for o, s, n, b in zip(self.offset, self.stride, self.num_blocks,
                                                              self.block_bytes))


@st.composite
def placements(draw: st.DrawFn) -> Placement:
    """Pairs of combs that interleave, touch, share a byte or a block id, with equal or different strides."""
    block_bytes = (draw(st.integers(1, 24)), draw(st.integers(1, 24)))
    pads = (draw(st.integers(0, 40)), draw(st.integers(0, 40)))
    stride_a = block_bytes[0] + pads[0]
    same_stride = draw(st.booleans()) and block_bytes[1] <= stride_a
    stride = (stride_a, stride_a if same_stride else block_bytes[1] + pads[1])
    group_b = draw(st.integers(0, 1))
    blocks_a = draw(st.integers(1, 6))
    num_blocks = (blocks_a, blocks_a if group_b == 0 else draw(st.integers(1, 6)))  # one group: one block count
    offset_b = draw(st.integers(0, stride_a * num_blocks[0] + 8))
    return Placement(block_bytes, stride, num_blocks, (0, offset_b), (0, group_b))
