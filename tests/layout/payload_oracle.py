"""Reads a token's KV bytes straight from the tensors vLLM registered, by their own indexing (not by planes).

Used to check that a plan built by layout discovery addresses exactly those bytes.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import torch

from lmcache_npu.layout.discovery import KVLayout, LayoutGroup, PlaneInfo


def payload_tensor(value, plane: PlaneInfo) -> tuple[torch.Tensor, bool]:
    """The registered tensor behind a plane, and whether it is a CUDA flash `[nb, 2, bs, h, d]` tensor."""
    if isinstance(value, torch.Tensor):
        flash = value.dim() == 5 and value.shape[1] == 2
        return value, flash
    return value[plane.payload_index], False


def rows_of(value, plane: PlaneInfo, group: LayoutGroup, blocks: np.ndarray, rows: np.ndarray,
            backend: Optional[str] = None) -> torch.Tensor:
    """(n, row_bytes) uint8: row `rows[i]` of physical block `blocks[i]` of the plane's payload tensor; `backend`
    is the layer's attention backend where it reads its tensor its own way."""
    t, flash = payload_tensor(value, plane)
    b = torch.from_numpy(blocks)
    r = torch.from_numpy(rows)
    if backend == "CPU_ATTN":  # vLLM's cpu_attn.py: view [nb, H, 2 * bs, D], K the first bs rows, V the next bs
        num_blocks, heads, block_size, packed = t.shape
        key_cache, value_cache = t.view(num_blocks, heads, 2 * block_size, packed // 2).chunk(2, dim=2)
        head, is_value = divmod(plane.payload_index, 2)
        picked = (value_cache if is_value else key_cache)[b, head, r]
    elif plane.layout == "fractal_nz":  # [nb, cols, bs, 16]: a row is one 16-element unit from every column
        picked = t[b, :, r, :]
    elif group.recurrent:  # [nb, *state]: one state per block
        picked = t[b]
    elif flash:  # [nb, 2, bs, h, d]
        picked = t[b, plane.payload_index, r]
    else:  # [nb * split, kernel_rows, ...] with adjacent kernel blocks forming one logical block
        kernel_rows = t.shape[1]
        split = group.rows_per_block // kernel_rows
        picked = t[b * split + r // kernel_rows, r % kernel_rows]
    return picked.contiguous().reshape(len(blocks), -1).view(torch.uint8).clone()


def expected_object_segments(layout: KVLayout, kv_caches, slots,
                             backends: Optional[Mapping[str, str]] = None) -> dict[str, torch.Tensor]:
    """Per moved plane: (chunks, rows_per_chunk, row_bytes) of what a store must write (zeros for -1 slots)."""
    out = {}
    for g in layout.groups:
        if g.skipped:
            continue
        matrix = slots[g.index]
        flat = matrix.reshape(-1)
        live = flat >= 0
        for plane in g.planes:
            value = kv_caches[plane.layers[0]]
            got = rows_of(value, plane, g, flat[live] // g.rows_per_block, flat[live] % g.rows_per_block,
                          (backends or {}).get(plane.layers[0]))
            full = torch.zeros((flat.size, plane.row_bytes), dtype=torch.uint8)
            full[torch.from_numpy(live)] = got
            out[plane.name] = full.reshape(matrix.shape[0], matrix.shape[1], plane.row_bytes)
    return out
