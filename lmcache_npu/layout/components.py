"""From what vLLM / vllm-ascend pass to ``register_kv_caches`` to paged byte components (DESIGN §6).

A layer's value may be a Tensor (CUDA flash ``[nb, 2, bs, h, d]`` or ``[2, nb, bs, h, d]``, CUDA MLA
``[nb, bs, d]``), a tuple (Ascend split K/V, MLA nope/rope, DSA 2-4 tensors, 310P FRACTAL_NZ K/V), or a
list (DeepSeek-V4 ``as_strided`` views into shared raw storage, mamba state tensors). Each becomes
one or more :class:`Component`: a uint8 view ``(num_blocks, rows_per_block * row_bytes)`` whose first
stride is the block stride in bytes, ready to be a :class:`~lmcache_npu.ops.Plane`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch

from ..ops import PageLayout

KVValue = Union[torch.Tensor, Sequence[torch.Tensor]]
NZ_ELEMENTS = 16  # a FRACTAL_NZ unit holds 16 elements of one row


@dataclass(frozen=True, eq=False)
class Component:
    """One paged tensor component: block b's rows are `rows_per_block * row_bytes` bytes at b * block stride."""

    pages: torch.Tensor  # uint8 (num_blocks, rows_per_block * row_bytes), strides (block_stride_bytes, 1)
    rows_per_block: int
    row_bytes: int
    dtype: torch.dtype
    layout: PageLayout = PageLayout.ND
    nz_unit_bytes: int = 0
    layers: list[str] = field(default_factory=list)  # every layer name registered with this memory
    index: int = 0  # position inside the first layer's value

    @property
    def num_blocks(self) -> int:
        return int(self.pages.shape[0])

    @property
    def block_stride_bytes(self) -> int:
        return int(self.pages.stride(0)) if self.num_blocks > 1 else int(self.pages.shape[1])

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Identity of the memory: (storage, first byte, block stride, block bytes)."""
        p = self.pages
        return (p.untyped_storage().data_ptr(), p.data_ptr(), self.block_stride_bytes, int(p.shape[1]))


def _bytes_view(t: torch.Tensor, where: str) -> tuple[torch.Tensor, int]:
    """The tensor's storage as uint8 and the byte offset of element 0."""
    if t.dim() < 1:
        raise ValueError(f"{where}: a KV cache tensor needs a block dimension, got a scalar")
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw, t.storage_offset() * t.element_size()


def _contiguous_tail(t: torch.Tensor, first_dim: int) -> bool:
    """Dims first_dim.. are laid out row-major with no gaps."""
    expected = 1
    for dim in range(t.dim() - 1, first_dim - 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def paged_component(t: torch.Tensor, rows_per_block: int, where: str, index: int = 0) -> Component:
    """An ND tensor ``[num_blocks, rows_per_block, *row]`` (or ``[num_blocks, *state]`` when rows_per_block is 1).

    Blocks may be padded (block stride > block bytes) and split into kernel blocks
    (``[num_blocks * k, rows_per_block / k, *row]`` with adjacent kernel blocks), as vLLM and
    vllm-ascend allocate them; rows inside a block must be contiguous.
    """
    elem = t.element_size()
    if rows_per_block == 1:
        if not _contiguous_tail(t, 1):
            raise ValueError(f"{where}: the state of one block must be contiguous, strides {tuple(t.stride())}")
        row_bytes = math.prod(t.shape[1:]) * elem
        blocks, rows, stride = t.shape[0], 1, t.stride(0) * elem
    else:
        if t.dim() < 2:
            raise ValueError(f"{where}: expected [num_blocks, rows_per_block, ...], got shape {tuple(t.shape)}")
        if not _contiguous_tail(t, 1):
            raise ValueError(
                f"{where}: rows inside a block must be contiguous (token-major); strides {tuple(t.stride())} "
                f"for shape {tuple(t.shape)} are not (head-major HND caches are not supported)"
            )
        row_bytes = math.prod(t.shape[2:]) * elem
        kernel_rows = t.shape[1]
        blocks, rows, stride = t.shape[0], kernel_rows, t.stride(0) * elem
        if kernel_rows != rows_per_block:
            split = rows_per_block // kernel_rows if kernel_rows and rows_per_block % kernel_rows == 0 else 0
            if not split or t.shape[0] % split or stride != kernel_rows * row_bytes:
                raise ValueError(
                    f"{where}: {kernel_rows} rows per block does not match the group's {rows_per_block}, and the "
                    "blocks are not adjacent kernel blocks of one logical block"
                )
            blocks, rows, stride = t.shape[0] // split, rows_per_block, stride * split
    raw, offset = _bytes_view(t, where)
    block_bytes = rows * row_bytes
    pages = torch.as_strided(raw, (blocks, block_bytes), (stride if blocks > 1 else block_bytes, 1), offset)
    if stride < block_bytes and blocks > 1:
        raise ValueError(f"{where}: block stride {stride} B is smaller than a block's rows ({block_bytes} B)")
    return Component(pages, rows, row_bytes, t.dtype, index=index)


def nz_component(t: torch.Tensor, rows_per_block: int, where: str, index: int = 0) -> Component:
    """A 310P FRACTAL_NZ cache ``[num_blocks, cols, rows_per_block, 16]``: a row is `cols` units of 16 elements."""
    if t.dim() != 4 or t.shape[3] != NZ_ELEMENTS or t.shape[2] != rows_per_block:
        raise ValueError(f"{where}: expected a FRACTAL_NZ cache [nb, cols, {rows_per_block}, 16], "
                         f"got shape {tuple(t.shape)}")
    if not _contiguous_tail(t, 1):
        raise ValueError(f"{where}: an NZ block must be contiguous, strides {tuple(t.stride())}")
    unit = NZ_ELEMENTS * t.element_size()
    row_bytes = t.shape[1] * unit
    raw, offset = _bytes_view(t, where)
    block_bytes = rows_per_block * row_bytes
    stride = t.stride(0) * t.element_size() if t.shape[0] > 1 else block_bytes
    pages = torch.as_strided(raw, (t.shape[0], block_bytes), (stride, 1), offset)
    return Component(pages, rows_per_block, row_bytes, t.dtype, PageLayout.FRACTAL_NZ, unit, index=index)


def layer_components(layer: str, value: KVValue, rows_per_block: int, fractal_nz: bool = False) -> list[Component]:
    """Every paged component of one layer's registered value, in payload order."""
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if value.dim() == 5 and shape[1] == 2 and shape[2] == rows_per_block:  # CUDA flash [nb, 2, bs, h, d]
            parts = [value[:, 0], value[:, 1]]
        elif value.dim() == 5 and shape[0] == 2 and shape[2] == rows_per_block:  # [2, nb, bs, h, d]
            parts = [value[0], value[1]]
        else:  # MLA [nb, bs, d], a single padded cache, or one state tensor
            parts = [value]
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        parts = list(value)
    else:
        raise ValueError(f"layer {layer}: expected a Tensor or a tuple/list of Tensors, got {type(value).__name__}")
    build = nz_component if fractal_nz else paged_component
    components = [build(t, rows_per_block, f"layer {layer}, tensor {i}", i) for i, t in enumerate(parts)]
    for c in components:
        c.layers.append(layer)
    return components


def collect_components(kv_caches: Mapping[str, KVValue], rows_per_block: Mapping[str, int],
                       fractal_nz: bool = False, scope: Optional[Mapping[str, Hashable]] = None) -> list[Component]:
    """Components of every layer, deduplicated: views of the same bytes become one component naming all layers.

    `scope` (layer -> key, e.g. the plan group) limits deduplication to layers of one scope: vLLM lets layers of
    different groups share one allocation with disjoint block ids, and each group must keep its own plane.
    """
    missing = sorted(set(kv_caches) - set(rows_per_block))
    if missing:
        raise ValueError(f"layers {missing} have KV tensors but no KV-cache spec in any group")
    unique: dict[tuple[Hashable, tuple[int, int, int, int]], Component] = {}
    for layer, value in kv_caches.items():
        for c in layer_components(layer, value, rows_per_block[layer], fractal_nz):
            key = (None if scope is None else scope[layer], c.key)
            seen = unique.get(key)
            if seen is None:
                unique[key] = c
            elif (seen.rows_per_block, seen.row_bytes) != (c.rows_per_block, c.row_bytes):
                raise ValueError(
                    f"layer {layer}, tensor {c.index}: the same memory as layers {seen.layers} but with "
                    f"{c.rows_per_block} rows of {c.row_bytes} B instead of {seen.rows_per_block} rows of "
                    f"{seen.row_bytes} B"
                )
            else:
                seen.layers.append(layer)
    return list(unique.values())
