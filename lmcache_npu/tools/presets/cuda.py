"""CUDA and CPU presets: upstream vLLM 0.23 spec classes, vLLM's own grouping, tensors shaped as its model runners.

The groups and KVCacheTensors come from vLLM's `get_kv_cache_groups` / `get_kv_cache_config_from_groups`;
each layer's view follows `GPUModelRunner._reshape_kv_cache_tensors`: FlashAttention `[nb, 2, bs, h, d]`,
MLA `[nb, storage_bs, head]` with padded pages as strided views, mamba states as strided views in one page.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

from .catalog import MLA, Attention, DeepseekV4, GatedDeltaNet, Model

CUDA_BLOCK = 16  # FlashAttention's default block size
CPU_BLOCK = 128  # the CPU platform's default block size
CPU_MLA_BLOCK = 16  # the CPU MLA decode kernel's only block size
DSV4_BLOCK = 256  # DeepSeek-V4 on CUDA: a c4 block of 256 tokens holds 64 compressed rows
DSV4_SWA_BLOCK = 64


def _vllm_config(num_blocks: int) -> Any:
    """The parts of VllmConfig that vLLM's grouping functions read."""
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        cache_config=types.SimpleNamespace(num_gpu_blocks_override=num_blocks),
    )


def gdn_states(model: Model) -> tuple[Attention, tuple[Any, ...], tuple[torch.dtype, ...]]:
    """A hybrid model's attention layer and its Gated DeltaNet state shapes and dtypes, from vLLM's calculators."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    layers = dict(model.layers)  # type: ignore[arg-type]
    attn = next(x for x in layers.values() if isinstance(x, Attention))
    gdn = next(x for x in layers.values() if isinstance(x, GatedDeltaNet))
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, gdn.num_k_heads, gdn.num_v_heads,
                                                                  gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(model.dtype, "auto", "auto")
    return attn, shapes, dtypes


def _hybrid_block_and_page(model: Model) -> tuple[int, int, tuple[Any, ...], tuple[torch.dtype, ...]]:
    """(attention block size, padded mamba page, shapes, dtypes) as vLLM's Platform._align_hybrid_block_size
    picks them: the smallest 16-token multiple whose attention page holds the mamba state."""
    attn, shapes, dtypes = gdn_states(model)
    mamba_page = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    per_token = 2 * attn.kv_heads * attn.head_dim * model.dtype.itemsize
    block = CUDA_BLOCK * math.ceil(mamba_page / (CUDA_BLOCK * per_token))
    return block, block * per_token, shapes, dtypes


def cuda_specs(model: Model, attention_block: int = CUDA_BLOCK, mla_block: int = CUDA_BLOCK * 4) -> dict[str, Any]:
    """The model's layer specs as vLLM builds them; the CPU family differs only in its block sizes."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    if isinstance(model.layers, DeepseekV4):
        return _dsv4_specs(model.layers, MLAAttentionSpec, SlidingWindowMLASpec)
    dtype = model.dtype
    has_mamba = any(isinstance(x, GatedDeltaNet) for _, x in model.layers)
    block, mamba_page, shapes, dtypes = _hybrid_block_and_page(model) if has_mamba else (attention_block, 0, (), ())
    specs: dict[str, Any] = {}
    for name, layer in model.layers:
        if isinstance(layer, Attention) and layer.sliding_window:
            specs[name] = SlidingWindowSpec(block_size=block, num_kv_heads=layer.kv_heads, head_size=layer.head_dim,
                                            dtype=dtype, sliding_window=layer.sliding_window)
        elif isinstance(layer, Attention):
            specs[name] = FullAttentionSpec(block_size=block, num_kv_heads=layer.kv_heads, head_size=layer.head_dim,
                                            dtype=dtype)
        elif isinstance(layer, MLA) and layer.indexer:
            # DeepSeek-V3.2 on FlashMLA-sparse: 656 B fp8 rows; the indexer keeps fp8 keys + an fp32 scale (132 B).
            specs[name] = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=layer.kv_lora_rank +
                                           layer.rope_dim, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
            specs[name.replace(".attn", ".indexer.k_cache")] = MLAAttentionSpec(
                block_size=64, num_kv_heads=1, head_size=layer.index_head_dim + 4, dtype=torch.uint8)
        elif isinstance(layer, MLA):
            specs[name] = MLAAttentionSpec(block_size=mla_block, num_kv_heads=1,
                                           head_size=layer.kv_lora_rank + layer.rope_dim, dtype=dtype)
        elif isinstance(layer, GatedDeltaNet):
            specs[name] = MambaSpec(block_size=block, shapes=shapes, dtypes=dtypes, page_size_padded=mamba_page,
                                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    return specs


def _dsv4_specs(v4: DeepseekV4, mla_cls: type, swa_cls: type) -> dict[str, Any]:
    """vLLM's DeepSeek-V4 layers with the FlashInfer bf16 cache (rows are whole tokens)."""
    specs: dict[str, Any] = {}
    for i, ratio in enumerate(v4.compress_ratios):
        attn = f"model.layers.{i}.attn"
        specs[f"{attn}.swa_cache"] = swa_cls(block_size=DSV4_SWA_BLOCK, num_kv_heads=1, head_size=v4.head_dim,
                                             dtype=torch.bfloat16, sliding_window=v4.window, cache_dtype_str="auto",
                                             model_version="deepseek_v4")
        if ratio == 0:
            continue
        coff = 2 if ratio == 4 else 1
        specs[attn] = mla_cls(block_size=DSV4_BLOCK, num_kv_heads=1, head_size=v4.head_dim, dtype=torch.bfloat16,
                              compress_ratio=ratio, cache_dtype_str="auto", model_version="deepseek_v4")
        specs[f"{attn}.compressor.state_cache"] = swa_cls(
            block_size=4 if ratio == 4 else 8, num_kv_heads=1, head_size=2 * coff * v4.head_dim,
            dtype=torch.float32, sliding_window=coff * ratio)
        if ratio == 4:
            specs[f"{attn}.indexer.k_cache"] = mla_cls(block_size=DSV4_BLOCK, num_kv_heads=1,
                                                       head_size=v4.index_head_dim + 4, dtype=torch.uint8,
                                                       compress_ratio=4, alignment=576)
            specs[f"{attn}.indexer.compressor.state_cache"] = swa_cls(
                block_size=4, num_kv_heads=1, head_size=2 * coff * v4.index_head_dim, dtype=torch.float32,
                sliding_window=coff * ratio)
    return specs


def cuda_kv_cache_config(specs: dict[str, Any], num_blocks: int) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    config = _vllm_config(num_blocks)
    groups = get_kv_cache_groups(config, dict(specs))
    return get_kv_cache_config_from_groups(config, groups, available_memory=1 << 40)


def _layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            out[name] = spec.kv_cache_specs[name] if hasattr(spec, "kv_cache_specs") else spec
    return out


def cuda_kv_caches(kv_cache_config: Any, generator: torch.Generator, device: torch.device = torch.device("cpu"),
                   cpu_attention: bool = False) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One raw int8 buffer per KVCacheTensor, viewed per layer as vLLM's GPU model runner views it;
    `cpu_attention`: attention layers as the CPU attention backend shapes them, `[nb, H, bs, 2 * D]`."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

    specs = _layer_specs(kv_cache_config)
    caches: dict[str, Any] = {}
    raws: list[torch.Tensor] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.randint(-128, 128, (tensor.size,), dtype=torch.int8, generator=generator).to(device)
        raws.append(raw)
        for name in tensor.shared_by:
            spec = specs[name]
            nb = tensor.size // spec.page_size_bytes
            if isinstance(spec, MambaSpec):
                states, offset = [], 0
                for shape, dtype in zip(spec.shapes, spec.dtypes):
                    per_page = spec.page_size_bytes // dtype.itemsize
                    inner = torch.empty((nb, *shape), device="meta").stride()
                    states.append(torch.as_strided(raw.view(dtype), (nb, *shape), (per_page, *inner[1:]),
                                                   offset // dtype.itemsize))
                    offset += inner[0] * dtype.itemsize
                caches[name] = states
                continue
            assert isinstance(spec, AttentionSpec)
            dtype = spec.dtype
            if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
                # one row per stored entry: 656 B (V3.2 fp8), 584 B (V4 fp8), else head_size elements
                row = spec.real_page_size_bytes // spec.storage_block_size // dtype.itemsize
                shape: tuple[int, ...] = (nb, spec.storage_block_size, row)
            elif cpu_attention:
                shape = (nb, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
            else:
                shape = (nb, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
            strides = list(torch.empty(shape, device="meta").stride())
            strides[0] = spec.page_size_bytes // dtype.itemsize
            caches[name] = torch.as_strided(raw.view(dtype), shape, strides)
    return caches, raws


def cpu_attention_backends(kv_cache_config: Any) -> dict[str, str]:
    """The backend vLLM's CPU platform picks per layer: CPU_ATTN for attention, CPU_MLA for MLA."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    backends = {}
    for name, spec in _layer_specs(kv_cache_config).items():
        if isinstance(spec, MLAAttentionSpec):
            backends[name] = "CPU_MLA"
        elif isinstance(spec, AttentionSpec):
            backends[name] = "CPU_ATTN"
    return backends
