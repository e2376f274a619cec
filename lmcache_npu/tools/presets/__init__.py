"""Presets: real models as vLLM (CUDA, CPU) and vllm-ascend (Ascend) hand them to a connector, through layout discovery.

Each preset builds the KVCacheConfig from vLLM 0.23 spec classes (vllm-ascend's own classes where vllm-ascend
is importable, faithful stand-ins otherwise) and allocates small tensors exactly as the model runner shapes
them, then runs `discover_layout` on them: the plan a real `register_kv_caches` would produce, in miniature.
Building a preset needs vLLM installed; `discover_layout` itself does not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...layout.discovery import (
    DEFAULT_SKIP_SPEC_KINDS,
    KVLayout,
    LayoutPolicy,
    default_chunk_tokens,
    discover_layout,
    token_granularity,
)
from .catalog import MODELS, DeepseekV4, Model

DEVICE_FAMILIES = ("ascend", "cuda", "cpu")


@dataclass
class PresetKV:
    """What vLLM hands a connector for one preset: the config, the registered tensors, their raw buffers."""

    model: Model
    device_family: str
    kv_cache_config: Any
    kv_caches: dict[str, Any]
    allocations: list[torch.Tensor]
    attention_backends: dict[str, str] = dataclasses.field(default_factory=dict)  # layer -> backend, where it matters

    @property
    def default_chunk_tokens(self) -> int:
        """256, or the recurrent state interval when a mamba group needs a coarser chunk."""
        return default_chunk_tokens(token_granularity(self.kv_cache_config))


def preset_names() -> list[str]:
    return list(MODELS)


def get_model(name: "str | Model", device_family: str, max_layers: Optional[int] = None) -> Model:
    """A preset's model; `max_layers` keeps its first layers only (tests scale models down, keeping the mix of layer
    kinds the first layers have), and every MTP layer."""
    if isinstance(name, Model):  # a model read from a config.json (model_from_hf_config)
        model = name
    elif name not in MODELS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(MODELS)}")
    else:
        model = MODELS[name]
    if device_family not in DEVICE_FAMILIES:
        raise ValueError(f"unknown device family {device_family!r}; choose one of {', '.join(DEVICE_FAMILIES)}")
    if device_family not in model.families:
        raise ValueError(f"preset {name} exists only for {', '.join(model.families)}")
    if max_layers is not None:
        if max_layers < 1:
            raise ValueError(f"max_layers must be >= 1, got {max_layers}")
        layers = model.layers
        mtp = layers[len(layers) - model.mtp_layers:] if not isinstance(layers, DeepseekV4) and model.mtp_layers \
            else ()  # MTP layers are kept whole: a trimmed model still drafts
        kept = (dataclasses.replace(layers, compress_ratios=layers.compress_ratios[:max_layers])
                if isinstance(layers, DeepseekV4) else layers[:min(max_layers, len(layers) - len(mtp))] + mtp)
        model = dataclasses.replace(model, layers=kept)
    return model


def build_preset(name: "str | Model", device_family: str = "ascend", num_blocks: int = 8, seed: int = 0,
                 device: torch.device = torch.device("cpu"), max_layers: Optional[int] = None) -> PresetKV:
    """Allocates the preset's KV caches (random bytes) with `num_blocks` blocks per group on `device`."""
    model = get_model(name, device_family, max_layers)
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is vLLM's null block), got {num_blocks}")
    generator = torch.Generator().manual_seed(seed)
    if device_family == "cuda":
        from .cuda import cuda_kv_cache_config, cuda_kv_caches, cuda_specs

        config = cuda_kv_cache_config(cuda_specs(model), num_blocks)
        caches, raws = cuda_kv_caches(config, generator, device)
    elif device_family == "cpu":
        from .cuda import (
            CPU_BLOCK,
            CPU_MLA_BLOCK,
            cpu_attention_backends,
            cuda_kv_cache_config,
            cuda_kv_caches,
            cuda_specs,
        )

        config = cuda_kv_cache_config(cuda_specs(model, CPU_BLOCK, CPU_MLA_BLOCK), num_blocks)
        caches, raws = cuda_kv_caches(config, generator, device, cpu_attention=True)
        return PresetKV(model, device_family, config, caches, raws, cpu_attention_backends(config))
    else:
        from .ascend import ascend_kv_cache_config, ascend_kv_caches

        config = ascend_kv_cache_config(model, num_blocks)
        caches, raws = ascend_kv_caches(model, config, generator, device)
    return PresetKV(model, device_family, config, caches, raws)


def preset_layout(name: "str | Model", device_family: str = "ascend", chunk_tokens: Optional[int] = None, num_blocks: int = 8,
                  skip_spec_kinds: Sequence[str] = DEFAULT_SKIP_SPEC_KINDS, seed: int = 0,
                  device: torch.device = torch.device("cpu")) -> tuple[KVLayout, PresetKV]:
    """The layout discovery makes of a preset, and the preset itself."""
    preset = build_preset(name, device_family, num_blocks, seed, device)
    policy = LayoutPolicy(chunk_tokens=chunk_tokens or preset.default_chunk_tokens,
                          skip_spec_kinds=tuple(skip_spec_kinds), fractal_nz=preset.model.fractal_nz)
    return discover_layout(preset.kv_cache_config, preset.kv_caches, policy, preset.attention_backends), preset
