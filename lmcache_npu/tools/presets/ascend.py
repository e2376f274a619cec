"""Ascend presets: vllm-ascend 0.23 spec classes, its grouping, and tensors shaped as its NPU model runner does.

Facts read from vllm-ascend v0.23.0 (not imported: it needs CANN):
* `vllm_ascend/core/kv_cache_interface.py`: `AscendMLAAttentionSpec` counts a block in stored rows (a c4 block of
  128 rows covers 512 tokens) and sizes DSA / LI-C8 pages; `AscendSlidingWindowMLASpec` stores one row per token.
* `vllm_ascend/models/deepseek_v4.py`, `models/layer/attention/layer.py`: DeepSeek-V4 block sizes at block 128 are
  [MLA 128, SWA 128, c4 state 8, c128 state 32] and padded pages [16640, 131072]. On Ascend 950 (A5) they are
  [128, 128, 8, 16] and [16896, 81920]; the MLA and SWA caches are fp8 rows of head_dim + 128 B, the indexer keys fp8
  with fp32 scales (`core/kv_cache_interface.py`'s A5 C8 dtypes).
* `vllm_ascend/worker/model_runner_v1.py` `_reshape_kv_cache_tensors` / `_adjust_kv_layout`: on A5 an indexer layer
  is registered as three views of its page: keys at 0, scales after them, and a "full" view [nb, bs, 1, head_dim +
  4] that starts at 0 again and so covers both (`overlap_full_kv_cache`).
* `vllm_ascend/patch/platform/patch_kv_cache_utils.py`: DeepSeek-V4 groups are [c4 MLA + indexer, c128 MLA,
  sliding-window groups by block size split into layer tuples], one raw tensor per (tuple, page size).
* `vllm_ascend/worker/model_runner_v1.py`: dense and MLA caches are split K/V (nope/rope) allocations, LI-C8 puts the
  indexer keys and their scales in one allocation one after the other, DeepSeek-V4 layers get strided views into
  the shared raw tensor, hybrid mamba models carve conv/ssm and K/V regions from one raw tensor.
* `vllm_ascend/patch/platform/patch_mamba_config.py`: hybrid block size = 128 x ceil(ssm page / (128 x K bytes per
  token)), mamba page = attention page + conv page.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .catalog import MLA, Attention, DeepseekV4, GatedDeltaNet, Model

ASCEND_BLOCK = 128
KERNEL_BLOCK = 128  # the Ascend FlashAttention backend's supported kernel block size
DSV4_BLOCKS = {"mla": 128, "swa": 128, "c4_state": 8, "c128_state": 32}  # at cache_config.block_size 128
DSV4_PADDED_PAGES = (16640, 131072)  # indexer page, MLA page
DSV4_BLOCKS_A5 = {"mla": 128, "swa": 128, "c4_state": 8, "c128_state": 16}  # Ascend 950, block_size 128
DSV4_PADDED_PAGES_A5 = (16896, 81920)
DSV4_A5_EXTRA_HEAD = 128  # A5 MLA/SWA rows: head_dim + 128 B (fp8)
DSV4_FP8 = torch.float8_e4m3fn
NZ = 16  # FRACTAL_NZ: 16 elements per unit


def _stand_in_classes() -> tuple[type, type]:
    """Faithful stand-ins for vllm-ascend's spec classes: same names, fields and page arithmetic."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    def _merge(cls: type, specs: list[Any]) -> Any:
        if any(s != specs[0] for s in specs):
            raise ValueError(f"{cls.__name__}: layers of one group must share one spec")
        return specs[0]

    @dataclass(frozen=True, kw_only=True)
    class AscendMLAAttentionSpec(MLAAttentionSpec):
        scale_dim: int = 0
        scale_dtype: torch.dtype = torch.int8
        sparse_head_dim: Optional[tuple[int, ...]] = None
        cache_sparse_li_c8: bool = False
        c8_k_cache_dtype: torch.dtype = field(default=torch.int8)
        c8_k_scale_cache_dtype: torch.dtype = field(default=torch.float16)

        @property
        def page_size_bytes(self) -> int:
            rows = self.block_size * self.num_kv_heads  # one row per stored entry, never divided by the ratio
            if self.cache_sparse_li_c8:
                k_dim, v_dim, index_dim = self.sparse_head_dim  # type: ignore[misc]
                return rows * ((k_dim + v_dim) * self.dtype.itemsize + index_dim * self.c8_k_cache_dtype.itemsize
                               + self.c8_k_scale_cache_dtype.itemsize)
            return rows * (self.head_size * self.dtype.itemsize + self.scale_dim * self.scale_dtype.itemsize)

        merge = classmethod(_merge)

    @dataclass(frozen=True, kw_only=True)
    class AscendSlidingWindowMLASpec(SlidingWindowMLASpec):
        def __post_init__(self) -> None:  # no alignment padding on Ascend
            return None

        @property
        def storage_block_size(self) -> int:
            return self.block_size

        @property
        def real_page_size_bytes(self) -> int:
            return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

        merge = classmethod(_merge)

    return AscendMLAAttentionSpec, AscendSlidingWindowMLASpec


def ascend_spec_classes() -> tuple[type, type]:
    """vllm-ascend's own classes where it imports (an Ascend host), the stand-ins elsewhere."""
    try:
        from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec, AscendSlidingWindowMLASpec

        return AscendMLAAttentionSpec, AscendSlidingWindowMLASpec
    except Exception:  # noqa: BLE001 - vllm_ascend fails to import in many ways without CANN
        return _stand_in_classes()


def _hybrid_block_and_pages(model: Model) -> tuple[int, int, tuple[Any, ...], tuple[torch.dtype, ...]]:
    """(block size, page bytes, mamba shapes, dtypes) as vllm-ascend's patched hybrid config derives them."""
    from .cuda import gdn_states

    attn, shapes, dtypes = gdn_states(model)
    sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
    ssm_page, conv_page = max(sizes), min(sizes)
    k_per_token = attn.kv_heads * attn.head_dim * model.dtype.itemsize
    block = KERNEL_BLOCK * math.ceil(ssm_page / (KERNEL_BLOCK * k_per_token))
    if block * k_per_token != ssm_page:
        raise ValueError(f"{model.name}: the ssm state ({ssm_page} B) is not a whole number of K blocks")
    return block, 2 * block * k_per_token + conv_page, shapes, dtypes


def ascend_specs(model: Model) -> dict[str, Any]:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    mla_cls, swa_cls = ascend_spec_classes()
    if isinstance(model.layers, DeepseekV4):
        return _dsv4_specs(model.layers, mla_cls, swa_cls)
    hybrid = any(isinstance(x, GatedDeltaNet) for _, x in model.layers)
    block, page, shapes, dtypes = _hybrid_block_and_pages(model) if hybrid else (ASCEND_BLOCK, None, (), ())
    specs: dict[str, Any] = {}
    for name, layer in model.layers:
        if isinstance(layer, Attention):
            common = dict(block_size=block, num_kv_heads=layer.kv_heads, head_size=layer.head_dim, dtype=model.dtype,
                          page_size_padded=page)
            specs[name] = (SlidingWindowSpec(sliding_window=layer.sliding_window, **common) if layer.sliding_window
                           else FullAttentionSpec(**common))
        elif isinstance(layer, MLA) and layer.indexer:
            dims = (layer.kv_lora_rank, layer.rope_dim, layer.index_head_dim)
            specs[name] = mla_cls(block_size=block, num_kv_heads=1, head_size=sum(dims), dtype=model.dtype,
                                  sparse_head_dim=dims, cache_sparse_li_c8=True)
        elif isinstance(layer, MLA):
            specs[name] = mla_cls(block_size=block, num_kv_heads=1, head_size=layer.kv_lora_rank + layer.rope_dim,
                                  dtype=model.dtype)
        elif isinstance(layer, GatedDeltaNet):
            specs[name] = MambaSpec(block_size=block, shapes=shapes, dtypes=dtypes, page_size_padded=page,
                                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    return specs


@dataclass(frozen=True)
class _Dsv4Device:
    """What vllm-ascend's DeepSeek-V4 caches are on one SoC family: block sizes, padded pages, dtypes, row sizes."""

    blocks: dict[str, int]
    padded_pages: tuple[int, int]  # indexer page, MLA page
    kv_dtype: torch.dtype  # MLA and SWA rows
    index_dtype: torch.dtype
    index_scale_dtype: torch.dtype
    extra_head: int  # columns added to MLA and SWA rows (A5: 128 more fp8 bytes)


def dsv4_device(v4: DeepseekV4) -> _Dsv4Device:
    """A2/A3 or Ascend 950 (A5) caches of a DeepSeek-V4 model."""
    if v4.ascend_950:
        return _Dsv4Device(DSV4_BLOCKS_A5, DSV4_PADDED_PAGES_A5, DSV4_FP8, DSV4_FP8, torch.float32,
                           DSV4_A5_EXTRA_HEAD)
    return _Dsv4Device(DSV4_BLOCKS, DSV4_PADDED_PAGES, torch.bfloat16, torch.int8, torch.float16, 0)


def _dsv4_layers(v4: DeepseekV4) -> list[tuple[str, int]]:
    """(attention prefix, compress ratio) per layer: the model's layers, then its MTP layers (`mtp.{j}`)."""
    main = [(f"model.layers.{i}.self_attn", r) for i, r in enumerate(v4.compress_ratios)]
    return main + [(f"mtp.{j}.self_attn", r) for j, r in enumerate(v4.mtp_compress_ratios)]


def _dsv4_specs(v4: DeepseekV4, mla_cls: type, swa_cls: type) -> dict[str, Any]:
    dev = dsv4_device(v4)
    indexer_page, mla_page = dev.padded_pages
    cached_head = v4.head_dim + dev.extra_head
    specs: dict[str, Any] = {}
    for attn, ratio in _dsv4_layers(v4):
        if ratio not in (0, 1, 4, 128):
            raise ValueError(f"layer {attn}: DeepSeek-V4 compress ratio {ratio}; vllm-ascend supports 4 and 128 "
                             "(0 or 1: SWA only)")
        ratio = 0 if ratio == 1 else ratio
        if ratio:
            specs[attn] = mla_cls(block_size=dev.blocks["mla"], num_kv_heads=1, head_size=cached_head,
                                  dtype=dev.kv_dtype, compress_ratio=ratio, model_version="deepseek_v4")
        if ratio == 4:
            specs[f"{attn}.indexer.k_cache"] = mla_cls(
                block_size=dev.blocks["mla"], num_kv_heads=1, head_size=v4.index_head_dim, dtype=dev.index_dtype,
                compress_ratio=4, model_version="deepseek_v4", scale_dim=1, scale_dtype=dev.index_scale_dtype)
        if ratio:
            coff = 2 if ratio == 4 else 1
            specs[f"{attn}.compressor.state_cache"] = swa_cls(
                block_size=dev.blocks["c4_state" if ratio == 4 else "c128_state"], num_kv_heads=1,
                head_size=2 * coff * v4.head_dim, dtype=torch.float32, sliding_window=coff * ratio,
                page_size_padded=mla_page)
        if ratio == 4:
            specs[f"{attn}.indexer.compressor.state_cache"] = swa_cls(
                block_size=dev.blocks["c4_state"], num_kv_heads=1, head_size=2 * 2 * v4.index_head_dim,
                dtype=torch.float32, sliding_window=8, page_size_padded=indexer_page)
        specs[f"{attn}.swa_cache"] = swa_cls(block_size=dev.blocks["swa"], num_kv_heads=1, head_size=cached_head,
                                             dtype=dev.kv_dtype, sliding_window=v4.window,
                                             model_version="deepseek_v4")
    return specs


def _dsv4_kv_cache_config(specs: dict[str, Any], num_blocks: int) -> Any:
    """vllm-ascend 0.23's DeepSeek-V4 grouping: c4 and c128 MLA groups first, then sliding-window groups
    by block size, split round-robin into as many groups as it takes to fit one common layer-tuple count."""
    from vllm.v1.core.kv_cache_utils import _approximate_gcd
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        UniformTypeKVCacheSpecs,
    )

    by_ratio: dict[int, dict[str, Any]] = defaultdict(dict)
    by_block: dict[int, dict[str, Any]] = defaultdict(dict)
    for name, spec in specs.items():
        if isinstance(spec, SlidingWindowMLASpec):
            by_block[spec.block_size][name] = spec
        elif isinstance(spec, MLAAttentionSpec):
            by_ratio[spec.compress_ratio][name] = spec
    mla = [UniformTypeKVCacheSpecs(block_size=next(iter(d.values())).block_size, kv_cache_specs=d)
           for _, d in sorted(by_ratio.items(), key=lambda kv: (kv[0] != 4, kv[0]))]
    windowed = [UniformTypeKVCacheSpecs(block_size=b, kv_cache_specs=d) for b, d in by_block.items()]

    def tuples(u: Any) -> int:  # layers per page size: every page size of a group has as many layers
        counts = defaultdict(int)
        for s in u.kv_cache_specs.values():
            counts[s.page_size_bytes] += 1
        return max(counts.values())

    counts = [tuples(u) for u in (*mla, *windowed)]
    per_group = _approximate_gcd(counts, lower_bound=counts[0])
    groups = [KVCacheGroupSpec(list(u.kv_cache_specs), u) for u in mla]
    for u in windowed:
        by_page: dict[int, list[str]] = defaultdict(list)
        for name, s in u.kv_cache_specs.items():
            by_page[s.page_size_bytes].append(name)
        rows = list(zip(*by_page.values()))  # one layer of each page size per tuple
        splits = math.ceil(len(rows) / per_group)
        for i in range(splits):
            names = [n for row in rows[i::splits] for n in row]
            groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs(block_size=u.block_size,
                                                                         kv_cache_specs={n: specs[n] for n in names})))
    page_sizes = sorted({s.page_size_bytes for s in mla[0].kv_cache_specs.values()})
    buckets = []
    for g in groups:
        b: dict[int, list[str]] = defaultdict(list)
        for n in g.layer_names:
            b[g.kv_cache_spec.kv_cache_specs[n].page_size_bytes].append(n)
        buckets.append(b)
    slots = max(len(v) for b in buckets for v in b.values())
    tensors = [KVCacheTensor(size=ps * num_blocks, shared_by=[b[ps][t] for b in buckets if t < len(b.get(ps, []))])
               for t in range(slots) for ps in page_sizes]
    last = next(reversed(specs))
    if last.startswith("mtp."):  # vLLM's DeepSeek-V4 rule: the group holding the last (MTP) layer drafts
        for g in groups:
            g.is_eagle_group = last in g.layer_names
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def ascend_kv_cache_config(model: Model, num_blocks: int) -> Any:
    specs = ascend_specs(model)
    if isinstance(model.layers, DeepseekV4):
        return _dsv4_kv_cache_config(specs, num_blocks)
    from .cuda import cuda_kv_cache_config  # vllm-ascend leaves every other model to vLLM's own grouping

    return cuda_kv_cache_config(specs, num_blocks)


def _strided(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, page_bytes: int,
             offset_bytes: int = 0) -> torch.Tensor:
    """A [num_blocks, ...] view whose blocks are `page_bytes` apart (vllm-ascend's `_adjust_kv_layout`)."""
    inner = torch.empty(shape, device="meta").stride()
    return torch.as_strided(raw.view(dtype), shape, (page_bytes // dtype.itemsize, *inner[1:]),
                            (raw.storage_offset() + offset_bytes) // dtype.itemsize)


def _region(raw: torch.Tensor, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [num_blocks, ...] region starting `start` bytes into `raw`."""
    size = math.prod(shape) * dtype.itemsize
    return raw[start:start + size].view(dtype).view(shape)


def _kernel_shape(nb: int, block: int, heads: int, dim: int) -> tuple[int, ...]:
    split = block // KERNEL_BLOCK if block > KERNEL_BLOCK else 1
    return (nb * split, block // split, heads, dim)


def ascend_kv_caches(model: Model, kv_cache_config: Any, generator: torch.Generator,
                     device: torch.device = torch.device("cpu")) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Every layer's registered value, shaped as vllm-ascend's NPU model runner shapes it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs: dict[str, Any] = {}
    for g in kv_cache_config.kv_cache_groups:
        for n in g.layer_names:
            specs[n] = g.kv_cache_spec.kv_cache_specs[n] if hasattr(g.kv_cache_spec, "kv_cache_specs") \
                else g.kv_cache_spec
    layers = {} if isinstance(model.layers, DeepseekV4) else dict(model.layers)
    caches: dict[str, Any] = {}
    raws: list[torch.Tensor] = []

    def alloc(size: int) -> torch.Tensor:
        raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator).to(device)
        raws.append(raw)
        return raw

    nb = kv_cache_config.num_blocks
    for tensor in kv_cache_config.kv_cache_tensors:
        shared = tensor.shared_by
        if isinstance(model.layers, DeepseekV4):
            raw = alloc(tensor.size)
            for name in shared:
                s = specs[name]
                page = s.page_size_bytes
                if getattr(s, "scale_dim", 0):
                    key_shape = (nb, s.block_size, 1, s.head_size)
                    caches[name] = [_strided(raw, key_shape, s.dtype, page),
                                    _strided(raw, (nb, s.block_size, 1, s.scale_dim), s.scale_dtype, page,
                                             s.block_size * s.head_size * s.dtype.itemsize)]
                    if model.layers.ascend_950:  # the "full" view: keys and scales again, from the page's start
                        full = s.head_size + s.scale_dim * s.scale_dtype.itemsize // s.dtype.itemsize
                        caches[name].append(_strided(raw, (nb, s.block_size, 1, full), s.dtype, page))
                else:
                    caches[name] = [_strided(raw, (nb, s.block_size, 1, s.head_size), s.dtype, page)]
            continue
        if any(isinstance(specs[n], MambaSpec) for n in shared):
            raw = alloc(tensor.size)
            for name in shared:
                s = specs[name]
                if isinstance(s, MambaSpec):
                    states, start = [], 0
                    for shape, dtype in zip(s.shapes, s.dtypes):
                        states.append(_region(raw, start, (nb, *shape), dtype))
                        start += nb * math.prod(shape) * dtype.itemsize
                    caches[name] = states
                else:  # K and V regions after the conv padding, in kernel blocks
                    shape = _kernel_shape(nb, s.block_size, s.num_kv_heads, s.head_size)
                    k_bytes = math.prod(shape) * s.dtype.itemsize
                    pad = tensor.size - 2 * k_bytes
                    caches[name] = (_region(raw, pad, shape, s.dtype), _region(raw, pad + k_bytes, shape, s.dtype))
            continue
        s = specs[shared[0]]
        layer = layers[shared[0]]
        if isinstance(layer, MLA) and layer.indexer:  # LI-C8: nope, rope; indexer keys then scales in one allocation
            rows = nb * s.block_size
            k_dim, v_dim, index_dim = s.sparse_head_dim
            index_raw = alloc(rows * index_dim + rows * 2)
            value: Any = (_region(alloc(rows * k_dim * 2), 0, (nb, s.block_size, 1, k_dim), s.dtype),
                          _region(alloc(rows * v_dim * 2), 0, (nb, s.block_size, 1, v_dim), s.dtype),
                          _region(index_raw, 0, (nb, s.block_size, 1, index_dim), torch.int8),
                          _region(index_raw, rows * index_dim, (nb, s.block_size, 1, 1), torch.float16))
        elif isinstance(layer, MLA):
            rows = nb * s.block_size
            value = (_region(alloc(rows * layer.kv_lora_rank * 2), 0, (nb, s.block_size, 1, layer.kv_lora_rank),
                             s.dtype),
                     _region(alloc(rows * layer.rope_dim * 2), 0, (nb, s.block_size, 1, layer.rope_dim), s.dtype))
        elif model.fractal_nz:  # 310P: K and V in the private FRACTAL_NZ format [nb, H*hd/16, bs, 16]
            shape = (nb, s.num_kv_heads * s.head_size // NZ, s.block_size, NZ)
            value = tuple(_region(alloc(tensor.size // 2), 0, shape, s.dtype) for _ in range(2))
        else:  # dense attention: separate K and V allocations, split into kernel blocks
            shape = _kernel_shape(nb, s.block_size, s.num_kv_heads, s.head_size)
            value = tuple(_region(alloc(tensor.size // 2), 0, shape, s.dtype) for _ in range(2))
        for name in shared:  # every layer sharing the KVCacheTensor gets the same tensors (disjoint block ids)
            caches[name] = value
    return caches, raws
