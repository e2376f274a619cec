"""The models the presets describe: per-layer attention facts from their published configs, device-neutral."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class Attention:
    """Standard (GQA) attention; a sliding window makes it a sliding-window layer."""

    kv_heads: int
    head_dim: int
    sliding_window: Optional[int] = None


@dataclass(frozen=True)
class MLA:
    """DeepSeek MLA latent (nope) + rope; `indexer` adds the DeepSeek-V3.2 DSA lightning-indexer cache."""

    kv_lora_rank: int = 512
    rope_dim: int = 64
    indexer: bool = False
    index_head_dim: int = 128


@dataclass(frozen=True)
class GatedDeltaNet:
    """Qwen3-Next linear attention: a conv state and a recurrent (temporal) state per request."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int


Layer = Union[Attention, MLA, GatedDeltaNet]


@dataclass(frozen=True)
class DeepseekV4:
    """DeepSeek-V4: per layer an SWA cache; c4 layers add compressed MLA + indexer, c128 layers compressed MLA.

    `ascend_950` selects vllm-ascend's Ascend 950 (A5) caches: fp8 MLA/SWA rows of head_dim + 128 bytes, an fp8
    indexer with fp32 scales registered as three views (keys, scales, and a "full" view over both), the A5 block
    sizes and padded pages. `mtp_compress_ratios` adds one MTP (speculative decoding) layer per entry, named
    `mtp.{j}` as vllm-ascend's DeepSeek-V4 MTP model names them."""

    compress_ratios: tuple[int, ...]  # 0: SWA only
    window: int = 128
    head_dim: int = 512
    index_head_dim: int = 128
    ascend_950: bool = False
    mtp_compress_ratios: tuple[int, ...] = ()


@dataclass(frozen=True)
class Model:
    name: str
    layers: Union[tuple[tuple[str, Layer], ...], DeepseekV4]
    notes: str
    dtype: torch.dtype = torch.bfloat16
    families: tuple[str, ...] = ("ascend", "cuda", "cpu")  # cpu: vLLM's CPU attention backends
    fractal_nz: bool = False  # 310P K/V pages
    mtp_layers: int = 0  # the last entries of a layer tuple are MTP (speculative decoding) layers


def with_mtp(model: Model, count: int = 1) -> Model:
    """The model served with `count` MTP layers (speculative decoding with method "mtp"), as the engine registers
    them: DeepSeek-V3/V3.2 MTP layers are decoder layers `model.layers.{n + j}` (n = num_hidden_layers) with the
    model's own MLA spec, so they join the target's MLA group; DeepSeek-V4's are `mtp.{j}` with an SWA cache only
    (the config's compress_ratios stop at num_hidden_layers), in a sliding-window group that vLLM flags
    `is_eagle_group` (its DeepSeek-V4 rule: the group holding the last layer). Modelled on Ascend for DeepSeek-V4."""
    if count < 1:
        raise ValueError(f"with_mtp: count must be >= 1, got {count}")
    layers = model.layers
    if isinstance(layers, DeepseekV4):
        if layers.mtp_compress_ratios:
            raise ValueError(f"{model.name} already has {len(layers.mtp_compress_ratios)} MTP layer(s)")
        return Model(f"{model.name}-mtp", replace(layers, mtp_compress_ratios=(0,) * count),
                     f"{model.notes} + {count} MTP layer(s) (SWA only)", model.dtype, ("ascend",), model.fractal_nz)
    if model.mtp_layers or not layers or not all(isinstance(layer, MLA) for _, layer in layers):
        raise ValueError(f"with_mtp: {model.name} is not a DeepSeek MLA model without MTP layers (MTP layers are "
                         "modelled for deepseek-v3, deepseek-v3.2 and deepseek-v4 only)")
    first = _mtp_index(layers)
    extra = tuple((f"model.layers.{first + j}.self_attn.attn", layers[-1][1]) for j in range(count))
    return Model(f"{model.name}-mtp", layers + extra, f"{model.notes} + {count} MTP layer(s) in the MLA group",
                 model.dtype, model.families, model.fractal_nz, mtp_layers=count)


def _mtp_index(layers: tuple[tuple[str, Layer], ...]) -> int:
    """num_hidden_layers of the full model: one past the highest `model.layers.{i}` index (names survive trims)."""
    return 1 + max(int(name.split(".")[2]) for name, _ in layers)


def _stack(prefix: str, layers: list[Layer]) -> tuple[tuple[str, Layer], ...]:
    return tuple((prefix.format(i=i), layer) for i, layer in enumerate(layers))


def _dense(name: str, num_layers: int, kv_heads: int, head_dim: int, notes: str, **kw) -> Model:
    return Model(name, _stack("model.layers.{i}.self_attn.attn", [Attention(kv_heads, head_dim)] * num_layers),
                 notes, **kw)


def _gemma3_27b() -> Model:
    # 62 layers, every 6th global (sliding_window_pattern 6), 16 KV heads x 128, window 1024.
    layers: list[Layer] = [Attention(16, 128, None if (i + 1) % 6 == 0 else 1024) for i in range(62)]
    return Model("gemma3-27b", _stack("model.layers.{i}.self_attn.attn", layers),
                 "62 layers: 52 sliding-window (1024) + 10 global, 16 KV heads x 128, bf16")


def _gpt_oss_120b() -> Model:
    layers: list[Layer] = [Attention(8, 64, 128 if i % 2 == 0 else None) for i in range(36)]
    return Model("gpt-oss-120b", _stack("model.layers.{i}.attn.attn", layers),
                 "36 layers alternating sliding-window 128 / full, 8 KV heads x 64, bf16")


def _qwen3_next_80b() -> Model:
    names: list[tuple[str, Layer]] = []
    for i in range(48):  # full_attention_interval 4: layers 3, 7, ... are gated full attention
        if i % 4 == 3:
            names.append((f"model.layers.{i}.self_attn.attn", Attention(2, 256)))
        else:
            names.append((f"model.layers.{i}.linear_attn", GatedDeltaNet(16, 32, 128, 128, 4)))
    return Model("qwen3-next-80b", tuple(names),
                 "48 layers: 36 Gated DeltaNet (conv + recurrent state) + 12 full attention (2 KV heads x 256)")


# HF config: 43 layers, compress_ratios [0, 0, 4, 128, 4, 128, ...]
_FLASH_RATIOS = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(41))


def _deepseek_v4_flash() -> Model:
    # the MTP layer is not served here (the A2/A3 preset models serving without speculative decoding)
    return Model("deepseek-v4-flash", DeepseekV4(_FLASH_RATIOS),
                 "43 layers: SWA cache (window 128) on every layer, 21 c4 (MLA + indexer) and 20 c128 MLA layers",
                 families=("ascend", "cuda"))


def _deepseek_v4_flash_a5() -> Model:
    # vllm-ascend 0.23 on Ascend 950 (models/deepseek_v4.py, models/layer/attention/layer.py): fp8 caches, block
    # table [128, 128, 8, 16], padded pages [16896, 81920]. Its 950 deployment guides serve with MTP: one MTP layer,
    # SWA only (the config's compress_ratios list stops at num_hidden_layers; vLLM and vllm-ascend read 0 past it).
    return Model("deepseek-v4-flash-a5", DeepseekV4(_FLASH_RATIOS, ascend_950=True, mtp_compress_ratios=(0,)),
                 "Ascend 950: 43 layers + 1 MTP layer; fp8 SWA and MLA rows of 512 + 128 B, fp8 indexer keys with "
                 "fp32 scales (three views, the overlapping full view stored once), padded pages 16896 / 81920",
                 families=("ascend",))


MODELS: dict[str, Model] = {m.name: m for m in (
    _dense("llama3-8b", 32, 8, 128, "32 layers, 8 KV heads x 128, bf16"),
    _dense("qwen3-32b", 64, 8, 128, "64 layers, 8 KV heads x 128, bf16"),
    Model("deepseek-v3", _stack("model.layers.{i}.self_attn.attn", [MLA()] * 61),
          "61 MLA layers: latent 512 + rope 64, bf16"),
    Model("deepseek-v3.2-c8", _stack("model.layers.{i}.self_attn.attn", [MLA(indexer=True)] * 61),
          "61 MLA layers with the DSA lightning indexer (int8 keys + fp16 scale on Ascend LI-C8, fp8 on CUDA)",
          families=("ascend", "cuda")),
    _deepseek_v4_flash(),
    _deepseek_v4_flash_a5(),
    _gemma3_27b(),
    _gpt_oss_120b(),
    _qwen3_next_80b(),
    _dense("llama3-8b-310p", 32, 8, 128, "Atlas 300I Duo (310P), kernels-only (vllm-ascend refuses KV connectors on "
           "310P): FRACTAL_NZ K/V [nb, H*hd/16, bs, 16], fp16",
           dtype=torch.float16, families=("ascend",), fractal_nz=True),
)}


DTYPES_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_from_hf_config(config: dict, name: str = "config.json") -> Model:
    """A Hugging Face config.json as a catalog model (the KV-relevant fields only): dense and GQA attention, sliding
    windows per layer (`layer_types`, Gemma's `sliding_window_pattern`), MLA (DeepSeek V2/V3, with the V3.2 indexer),
    DeepSeek-V4 compression ratios and Qwen3-Next linear attention. Unknown shapes raise ValueError naming the field."""
    text = config.get("text_config", config)
    layers_n = int(text["num_hidden_layers"])
    dtype = DTYPES_BY_NAME.get(str(text.get("torch_dtype", text.get("dtype", "bfloat16"))), torch.bfloat16)
    if "compress_ratios" in text:
        ratios = tuple(int(r) for r in text["compress_ratios"][:layers_n])
        return Model(name, DeepseekV4(ratios, int(text.get("sliding_window", 128))),
                     f"DeepSeek-V4 shape: {layers_n} layers, compress ratios {sorted(set(ratios))}")
    if "kv_lora_rank" in text:
        mla = MLA(int(text["kv_lora_rank"]), int(text.get("qk_rope_head_dim", 64)), "index_topk" in text,
                  int(text.get("index_head_dim", 128)))
        return Model(name, _stack("model.layers.{i}.self_attn.attn", [mla] * layers_n),
                     f"{layers_n} MLA layers: latent {mla.kv_lora_rank} + rope {mla.rope_dim}"
                     + (", DSA indexer" if mla.indexer else ""), dtype=dtype)
    heads = int(text.get("num_attention_heads", 0))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text["hidden_size"]) // heads if heads else 0))
    if not kv_heads or not head_dim:
        raise ValueError(f"{name}: needs num_key_value_heads (or num_attention_heads) and head_dim or hidden_size")
    kinds = list(text.get("layer_types") or [])
    if not kinds and text.get("full_attention_interval"):
        interval = int(text["full_attention_interval"])
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers_n)]
    if not kinds and text.get("sliding_window_pattern") and text.get("sliding_window"):
        pattern = int(text["sliding_window_pattern"])
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers_n)]
    if not kinds:
        window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
        kinds = ["sliding_attention" if window else "full_attention"] * layers_n
    layers: list[tuple[str, Layer]] = []
    for i, kind in enumerate(kinds[:layers_n]):
        if kind == "linear_attention":
            layers.append((f"model.layers.{i}.linear_attn", GatedDeltaNet(
                int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"]),
                int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"]),
                int(text.get("linear_conv_kernel_dim", 4)))))
        elif kind in ("sliding_attention", "full_attention"):
            window = int(text["sliding_window"]) if kind == "sliding_attention" else None
            layers.append((f"model.layers.{i}.self_attn.attn", Attention(kv_heads, head_dim, window)))
        else:
            raise ValueError(f"{name}: layer {i} has layer type {kind!r}; known: full_attention, sliding_attention, "
                             "linear_attention")
    return Model(name, tuple(layers), f"{layers_n} layers: {', '.join(sorted(set(kinds)))}; {kv_heads} KV heads x "
                 f"{head_dim}", dtype=dtype)
