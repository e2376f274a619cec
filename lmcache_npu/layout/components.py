"""From what vLLM / vllm-ascend pass to ``register_kv_caches`` to paged byte components (DESIGN §6).

A layer's value may be a Tensor (CUDA flash ``[nb, 2, bs, h, d]`` or ``[2, nb, bs, h, d]``, CUDA MLA
``[nb, bs, d]``), a tuple (Ascend split K/V, MLA nope/rope, DSA 2-4 tensors, 310P FRACTAL_NZ K/V), or a
list (DeepSeek-V4 ``as_strided`` views into shared raw storage, mamba state tensors). Each becomes
one or more :class:`Component`: a uint8 view ``(num_blocks, rows_per_block * row_bytes)`` whose first
stride is the block stride in bytes, ready to be a :class:`~lmcache_npu.ops.Plane`.

A view whose every byte other views of the same scope already address, block for block (vllm-ascend's A5 indexer
registers keys, scales and a "full" view over both), is not a component of its own: `drop_covering_views` stores
its bytes once, as the rows of the views it covers, and a load that writes those rows fills it too.

A token's row must be contiguous inside a component. Where it is not, the layer becomes one component per KV head:
token-major shapes with head-major strides (HND caches), and the attention backends whose tensors do not name their
dims (`BACKEND_PACKINGS`: vLLM's CPU attention keeps, per block and head, the block's K rows then its V rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch

from ..ops import PageLayout

KVValue = Union[torch.Tensor, Sequence[torch.Tensor]]
NZ_ELEMENTS = 16  # a FRACTAL_NZ unit holds 16 elements of one row


class KVPacking(str, Enum):
    """How a layer's registered tensor packs its rows, where its shape alone does not say."""

    STANDARD = "standard"  # the shape names the dims (flash, Ascend tuples, MLA, mamba states)
    CPU_ATTENTION = "cpu_attention"  # [nb, H, bs, 2*D] holding, per (block, head), bs K rows then bs V rows
    HEAD_MAJOR = "head_major"  # [nb, H, bs, C] views (vLLM >= 0.29's [B, H, N, C]): one component per head


# attention backend name (`AttentionBackend.get_name()`) -> packing; a backend not listed is STANDARD
BACKEND_PACKINGS: dict[str, KVPacking] = {
    "CPU_ATTN": KVPacking.CPU_ATTENTION,
    "CPU_MLA": KVPacking.HEAD_MAJOR,
    "AMX_MLA": KVPacking.HEAD_MAJOR,
}


def packing_of(backend_name: Optional[str]) -> KVPacking:
    return BACKEND_PACKINGS.get(backend_name or "", KVPacking.STANDARD)


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
    index: int = 0  # position among the first layer's components (payload order)
    role: str = ""  # what the component holds where the layer's value does not say it (k0, v0, ...)

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


def _cpu_attention_parts(t: torch.Tensor, rows_per_block: int, where: str) -> list[tuple[torch.Tensor, str]]:
    """vLLM's CPU attention `[nb, H, bs, 2*D]`, which it reads as `[nb, H, 2*bs, D]` split in two along the rows:
    per head a K component and a V component `[nb, bs, D]`."""
    if t.dim() != 4 or t.shape[2] != rows_per_block or t.shape[3] % 2:
        raise ValueError(f"{where}: the CPU attention backend's cache is [num_blocks, kv_heads, {rows_per_block}, "
                         f"2 * head_size], got shape {tuple(t.shape)}")
    head_size = t.shape[3] // 2
    if t.stride(3) != 1 or t.stride(2) != 2 * head_size:
        raise ValueError(f"{where}: a (block, head) of the CPU attention cache must be contiguous, strides "
                         f"{tuple(t.stride())}")
    rows = torch.as_strided(t, (t.shape[0], t.shape[1], 2 * rows_per_block, head_size),
                            (t.stride(0), t.stride(1), head_size, 1), t.storage_offset())
    parts = []
    for head in range(t.shape[1]):
        parts.append((rows[:, head, :rows_per_block], f"k{head}"))
        parts.append((rows[:, head, rows_per_block:], f"v{head}"))
    return parts


def _split_heads(part: torch.Tensor, rows_per_block: int, role: str) -> list[tuple[torch.Tensor, str]]:
    """A token-major `[nb, bs, H, D]` part whose rows are not contiguous (head-major strides): one part per head
    when each head's rows are; else the part as it is (paged_component then names the rule it breaks)."""
    if part.dim() != 4 or rows_per_block == 1 or part.shape[1] != rows_per_block or _contiguous_tail(part, 1):
        return [(part, role)]
    heads = [part[:, :, h] for h in range(part.shape[2])]
    if not all(_contiguous_tail(h, 1) for h in heads):
        return [(part, role)]
    return [(h, f"{role}.h{i}" if role else f"h{i}") for i, h in enumerate(heads)]


def _head_major_parts(t: torch.Tensor, rows_per_block: int) -> list[tuple[torch.Tensor, str]]:
    """`[nb, H, bs, C]`: one `[nb, bs, C]` part per head; other ranks are read as standard."""
    if t.dim() != 4 or t.shape[2] != rows_per_block or rows_per_block == 1:
        return [(t, "")]
    if t.shape[1] == 1:
        return [(t[:, 0], "")]
    return [(t[:, h], f"h{h}") for h in range(t.shape[1])]


def layer_components(layer: str, value: KVValue, rows_per_block: int, fractal_nz: bool = False,
                     packing: KVPacking = KVPacking.STANDARD) -> list[Component]:
    """Every paged component of one layer's registered value, in payload order."""
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if packing == KVPacking.CPU_ATTENTION:
            parts = _cpu_attention_parts(value, rows_per_block, f"layer {layer}")
        elif packing == KVPacking.HEAD_MAJOR:
            parts = _head_major_parts(value, rows_per_block)
        elif value.dim() == 5 and shape[1] == 2 and shape[2] == rows_per_block:  # CUDA flash [nb, 2, bs, h, d]
            parts = [(value[:, 0], "k"), (value[:, 1], "v")]
        elif value.dim() == 5 and shape[0] == 2 and shape[2] == rows_per_block:  # [2, nb, bs, h, d]
            parts = [(value[0], "k"), (value[1], "v")]
        else:  # MLA [nb, bs, d], a single padded cache, or one state tensor
            parts = [(value, "")]
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        parts = [(t, "") for t in value]
    else:
        raise ValueError(f"layer {layer}: expected a Tensor or a tuple/list of Tensors, got {type(value).__name__}")
    if not fractal_nz and packing == KVPacking.STANDARD:
        parts = [split for t, role in parts for split in _split_heads(t, rows_per_block, role)]
    build = nz_component if fractal_nz else paged_component
    components = []
    for i, (t, role) in enumerate(parts):
        c = dataclasses.replace(build(t, rows_per_block, f"layer {layer}, tensor {i}", i), role=role, layers=[layer])
        components.append(c)
    return components


def collect_components(kv_caches: Mapping[str, KVValue], rows_per_block: Mapping[str, int],
                       fractal_nz: bool = False, scope: Optional[Mapping[str, Hashable]] = None,
                       packings: Optional[Mapping[str, KVPacking]] = None) -> list[Component]:
    """Components of every layer, deduplicated: views of the same bytes become one component naming all layers.

    `scope` (layer -> key, e.g. the plan group) limits deduplication to layers of one scope: vLLM lets layers of
    different groups share one allocation with disjoint block ids, and each group must keep its own plane.
    `packings` (layer -> packing) names the layers whose tensors do not say how their rows are packed.
    """
    missing = sorted(set(kv_caches) - set(rows_per_block))
    if missing:
        raise ValueError(f"layers {missing} have KV tensors but no KV-cache spec in any group")
    unique: dict[tuple[Hashable, tuple[int, int, int, int]], Component] = {}
    for layer, value in kv_caches.items():
        packing = (packings or {}).get(layer, KVPacking.STANDARD)
        for c in layer_components(layer, value, rows_per_block[layer], fractal_nz, packing):
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


@dataclass(frozen=True)
class CoveringView:
    """A registered view whose bytes, block for block, are exactly the bytes of other views of the same layers."""

    layers: tuple[str, ...]
    index: int  # payload position of the view in the first layer's value
    covered_by: tuple[tuple[str, int], ...]  # (layer, payload position) of the views holding its bytes, by address
    row_bytes: int
    dtype: torch.dtype


def _block_span(c: Component) -> tuple[int, int]:
    """[first byte, one past the last byte) of block 0."""
    start = int(c.pages.data_ptr())
    return start, start + int(c.pages.shape[1])


def _tiles(parts: Sequence[Component], start: int, end: int) -> bool:
    """The parts' block-0 spans, in address order, fill [start, end) with no gap and no overlap."""
    cursor = start
    for part in parts:
        first, last = _block_span(part)
        if first != cursor:
            return False
        cursor = last
    return cursor == end


def drop_covering_views(components: Sequence[Component], scope: Optional[Mapping[str, Hashable]] = None
                        ) -> tuple[list[Component], list[CoveringView]]:
    """Components without the views that only re-address other components' bytes, and those views.

    A view covers others when they share its storage, block stride and block count, and their blocks tile its
    block exactly. The covered views stay: their rows are the per-token rows the attention kernels write (a covering
    view's row i mixes several of them), so a chunk moves their rows and each byte once. Partial overlaps are left
    for the transfer plan to refuse with the planes named.
    """
    buckets: dict[tuple[Hashable, int, int, int], list[Component]] = defaultdict(list)
    for c in components:
        key = None if scope is None else scope[c.layers[0]]
        buckets[(key, c.pages.untyped_storage().data_ptr(), c.block_stride_bytes, c.num_blocks)].append(c)
    dropped: set[int] = set()
    views: list[CoveringView] = []
    for members in buckets.values():
        if len(members) < 3:  # a cover needs at least two views under it
            continue
        for c in sorted(members, key=lambda m: int(m.pages.shape[1])):  # narrowest first: nested covers all go
            start, end = _block_span(c)
            parts = sorted((o for o in members if o is not c and id(o) not in dropped
                            and start <= _block_span(o)[0] and _block_span(o)[1] <= end),
                           key=lambda o: _block_span(o)[0])
            if len(parts) >= 2 and _tiles(parts, start, end):
                dropped.add(id(c))
                under = tuple((p.layers[0], p.index) for p in parts)
                views.append(CoveringView(tuple(c.layers), c.index, under, c.row_bytes, c.dtype))
    return [c for c in components if id(c) not in dropped], views
