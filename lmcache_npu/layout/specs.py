"""What one layer's vLLM KV-cache spec means for offload, in either spec-attribute era (DESIGN §6).

vLLM 0.23-0.28 name the compression `compress_ratio`; vLLM >= 0.29 call it `tokens_per_state` and add
`prefix_cacheable`. vllm-ascend's spec classes count a compressed block in compressed rows (a c4 block
of 128 rows holds 512 tokens) where upstream counts tokens (a c4 block of 256 tokens holds 64 rows).
Spec classes are recognised by the exact names in their MRO, so the reader needs neither vLLM nor
vllm-ascend importable, and a class it does not know is an error rather than a guess.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional

import torch


class SpecKind(str, enum.Enum):
    FULL_ATTENTION = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    COMPRESSOR_STATE = "compressor_state"
    CROSS_ATTENTION = "cross_attention"
    ENCODER_ONLY = "encoder_only"
    HIDDEN_STATE = "hidden_state"
    CIRCULAR_BUFFER = "circular_buffer"


# Kinds whose bytes never come from the prompt prefix: always skipped, whatever the policy says.
NEVER_REUSED: dict[SpecKind, str] = {
    SpecKind.CROSS_ATTENTION: "cross-attention KV is computed from the encoder output, not from the prompt prefix",
    SpecKind.ENCODER_ONLY: "encoder-only attention keeps no KV across requests",
    SpecKind.HIDDEN_STATE: "hidden-state capture for extract_hidden_states, not KV the model reads back",
    SpecKind.CIRCULAR_BUFFER: "a per-request ring of keys still being compressed, not prefix KV",
}


@dataclass(frozen=True)
class SpecClass:
    kind: SpecKind
    rows_count_tokens: bool  # upstream: block_size counts tokens; vllm-ascend compressed specs: it counts rows


# Exact class names, most derived first; a subclass we do not list is refused (its block semantics may differ).
KNOWN_SPEC_CLASSES: dict[str, SpecClass] = {
    "FullAttentionSpec": SpecClass(SpecKind.FULL_ATTENTION, True),
    "TQFullAttentionSpec": SpecClass(SpecKind.FULL_ATTENTION, True),
    "SinkFullAttentionSpec": SpecClass(SpecKind.FULL_ATTENTION, True),
    "RSWASpec": SpecClass(SpecKind.FULL_ATTENTION, True),  # >= 0.29: prefill tokens stay globally visible
    "MLAAttentionSpec": SpecClass(SpecKind.MLA, True),
    "HiddenStateCacheSpec": SpecClass(SpecKind.HIDDEN_STATE, True),
    "SlidingWindowSpec": SpecClass(SpecKind.SLIDING_WINDOW, True),
    "SlidingWindowMLASpec": SpecClass(SpecKind.SLIDING_WINDOW_MLA, True),
    "ChunkedLocalAttentionSpec": SpecClass(SpecKind.CHUNKED_LOCAL, True),
    "MambaSpec": SpecClass(SpecKind.MAMBA, True),
    "CrossAttentionSpec": SpecClass(SpecKind.CROSS_ATTENTION, True),
    "EncoderOnlyAttentionSpec": SpecClass(SpecKind.ENCODER_ONLY, True),
    "CircularBufferSpec": SpecClass(SpecKind.CIRCULAR_BUFFER, True),
    # vllm-ascend (vllm_ascend/core/kv_cache_interface.py): a block holds block_size stored rows.
    "AscendMLAAttentionSpec": SpecClass(SpecKind.MLA, False),
    "AscendSlidingWindowMLASpec": SpecClass(SpecKind.SLIDING_WINDOW_MLA, False),
}
CONTAINER_SPEC_CLASS = "UniformTypeKVCacheSpecs"


def spec_class_name(spec: Any) -> str:
    return type(spec).__name__


def _known_class(layer: str, spec: Any) -> SpecClass:
    name = spec_class_name(spec)
    if name in KNOWN_SPEC_CLASSES:
        return KNOWN_SPEC_CLASSES[name]
    bases = [c.__name__ for c in type(spec).__mro__[1:] if c.__name__ in KNOWN_SPEC_CLASSES]
    hint = f" (it derives from {bases[0]}, but a subclass may count blocks differently)" if bases else ""
    raise ValueError(
        f"layer {layer}: unknown KV-cache spec class {name}{hint}; known classes are "
        f"{', '.join(sorted(KNOWN_SPEC_CLASSES))}"
    )


def _compress_ratio(layer: str, spec: Any) -> int:
    """vLLM <= 0.28 `compress_ratio`, >= 0.29 `tokens_per_state`; 1 when the spec has neither."""
    ratio: Any = getattr(spec, "compress_ratio", None)
    if ratio is None:
        try:
            ratio = getattr(spec, "tokens_per_state", 1)
        except NotImplementedError:
            ratio = 1
    if isinstance(ratio, Fraction):
        if ratio.denominator != 1:
            raise ValueError(f"layer {layer}: tokens_per_state {ratio} stores several states per token; a chunk "
                             "row is one token or one compressed entry")
        ratio = ratio.numerator
    ratio = int(ratio)
    if ratio < 1:
        raise ValueError(f"layer {layer}: compress ratio must be >= 1, got {ratio}")
    return ratio


def _prefix_cacheable(spec: Any) -> bool:
    try:
        return bool(getattr(spec, "prefix_cacheable", True))
    except NotImplementedError:
        return True


@dataclass(frozen=True)
class LayerSpec:
    """One layer's spec, normalised: how many tokens a block covers and how many rows it stores."""

    layer: str
    spec_class: str
    kind: SpecKind
    block_size: int  # the spec's own block_size (the scheduler's unit for this group)
    tokens_per_block: int
    rows_per_block: int
    compress_ratio: int  # tokens per stored row
    sliding_window: Optional[int]
    dtype: Optional[torch.dtype]
    prefix_cacheable: bool
    cache_dtype: Optional[str] = None
    model_version: Optional[str] = None
    mamba_cache_mode: Optional[str] = None
    transferable: bool = True  # False: vLLM >= 0.32 excludes its group from KV transfer (enable_kv_transfer)

    @property
    def rows_are_tokens(self) -> bool:
        """False for DeepSeek-V4 fp8_ds_mla pages ([bs x 576 B data][bs x 8 B scales]): only whole blocks move."""
        return not (self.cache_dtype == "fp8_ds_mla" and self.model_version == "deepseek_v4")


def read_layer_spec(layer: str, spec: Any) -> LayerSpec:
    """Normalises one layer's spec; `spec` is the per-layer spec (unwrap UniformTypeKVCacheSpecs first)."""
    known = _known_class(layer, spec)
    block_size = int(getattr(spec, "block_size"))
    if block_size < 1:
        raise ValueError(f"layer {layer}: block_size must be >= 1, got {block_size}")
    dtype = getattr(spec, "dtype", None)
    window = getattr(spec, "sliding_window", None) if known.kind != SpecKind.FULL_ATTENTION else None
    if known.kind == SpecKind.CHUNKED_LOCAL:
        window = int(spec.attention_chunk_size)  # a token reads back at most one attention chunk
    if known.kind == SpecKind.MAMBA:
        # One state per block: the state after the block's last token (mamba_cache_mode "align"/"all").
        return LayerSpec(layer, spec_class_name(spec), SpecKind.MAMBA, block_size, block_size, 1, block_size,
                         None, None, _prefix_cacheable(spec),
                         mamba_cache_mode=str(getattr(spec, "mamba_cache_mode", "none")))
    ratio = _compress_ratio(layer, spec)
    if known.rows_count_tokens:
        if block_size % ratio:
            raise ValueError(f"layer {layer}: block_size {block_size} tokens is not a multiple of compress ratio "
                             f"{ratio}")
        tokens_per_block, rows_per_block = block_size, block_size // ratio
    else:
        tokens_per_block, rows_per_block = block_size * ratio, block_size
    kind = known.kind
    if kind == SpecKind.SLIDING_WINDOW_MLA and dtype == torch.float32:
        kind = SpecKind.COMPRESSOR_STATE  # fp32 per-token kv/score partial sums; confirmed against the layer below
    return LayerSpec(layer, spec_class_name(spec), kind, block_size, tokens_per_block, rows_per_block, ratio,
                     None if window is None else int(window), dtype, _prefix_cacheable(spec),
                     getattr(spec, "cache_dtype_str", None), getattr(spec, "model_version", None))


def layer_specs_of_group(group_index: int, group: Any) -> list[LayerSpec]:
    """Every layer of one KVCacheGroupSpec, unwrapping UniformTypeKVCacheSpecs (DeepSeek-V4 groups)."""
    spec = group.kv_cache_spec
    names = list(group.layer_names)
    if spec_class_name(spec) == CONTAINER_SPEC_CLASS:
        per_layer: Mapping[str, Any] = spec.kv_cache_specs
        missing = [n for n in names if n not in per_layer]
        if missing:
            raise ValueError(f"group {group_index}: layers {missing} have no spec in its UniformTypeKVCacheSpecs")
        specs = [read_layer_spec(n, per_layer[n]) for n in names]
    else:
        specs = [read_layer_spec(n, spec) for n in names]
    if getattr(group, "enable_kv_transfer", True) is False:  # a replica vLLM rebuilds from another group after a load
        specs = [dataclasses.replace(s, transferable=False) for s in specs]
    return specs


def is_compressor_state_layer(layer: str) -> bool:
    """The layer is a compressor's state cache (DeepSeek-V4 registers `...compressor.state_cache`)."""
    parts = layer.split(".")
    return parts[-1] == "state_cache" or "compressor" in parts[:-1]
