"""Small models made on this machine, never downloaded: a Hugging Face config, its own random init, safetensors.

vLLM's `dummy` weights are uniform in +-1e-3, which leaves the logits almost flat; `from_config` initialises like
training does, so the next token depends on every byte of the prefix's KV and a wrong load shows in the tokens.
Each recipe keeps one architecture's KV-cache shape (groups, windows, sinks, MLA latent, recurrent state) at a size
a 2-core CPU runs in seconds. A model is made once per recipe and seed and reused from `cache_dir`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

VOCAB = 2048
HIDDEN = 256


@dataclass(frozen=True)
class Recipe:
    """One architecture: the transformers config class, its arguments, and what it exercises."""

    name: str
    config_class: str
    arguments: dict[str, Any]
    exercises: str
    dtype: str = "float32"

    def config(self) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**self.arguments)

    def fingerprint(self, seed: int) -> str:
        text = json.dumps([self.config_class, self.arguments, self.dtype, seed], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _attention(layers: int, **extra: Any) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
            **extra}


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("llama", "LlamaConfig", _attention(2), "one full-attention KV-cache group"),
    Recipe("gemma3", "Gemma3TextConfig",
           _attention(4, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=32,
                      query_pre_attn_scalar=64),
           "sliding-window (32 tokens: less than a block and a chunk) and full layers: two KV-cache groups"),
    Recipe("gpt-oss", "GptOssConfig",
           _attention(4, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                      layer_types=["sliding_attention", "full_attention"] * 2),
           "attention sinks, alternating sliding-window (64) and full layers, a mixture of experts",
           dtype="bfloat16"),
    Recipe("deepseek-mla", "DeepseekV2Config",
           {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 512, "moe_intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
            "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "max_position_embeddings": 4096},
           "MLA: one latent (512) + rope (64) row per token, DeepSeek-V2-Lite's shape"),
    Recipe("qwen3-next", "Qwen3NextConfig",
           {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128, "full_attention_interval": 4,
            "max_position_embeddings": 4096},
           "Gated DeltaNet (conv + recurrent state per block) beside full attention: a mamba hybrid"),
)}


def default_cache_dir() -> Path:
    root = os.environ.get("LMCACHE_NPU_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmcache-npu", "models")
    return Path(root)


def make_model(name: str, cache_dir: Optional[Path] = None, seed: int = 0,
               progress: Optional[Callable[[str], None]] = None) -> Path:
    """The directory of recipe `name` (config.json + safetensors), made on first use."""
    if name not in RECIPES:
        raise ValueError(f"unknown model recipe {name!r}; choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    target = (cache_dir or default_cache_dir()) / f"{name}-{recipe.fingerprint(seed)}"
    if (target / "config.json").exists():
        return target
    if progress is not None:
        progress(f"making the {name} model ({recipe.exercises})")
    import torch
    from transformers import AutoModelForCausalLM

    config = recipe.config()
    config.torch_dtype = recipe.dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, recipe.dtype))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        os.replace(staging, target)  # another process may have made it meanwhile: theirs is identical
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("made model %s in %s", name, target)
    return target
