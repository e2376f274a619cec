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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .staging import publish_directory

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
    engine_settings: dict[str, Any] = field(default_factory=dict)  # what vLLM's CPU backend needs to serve it

    def config(self) -> Any:
        import transformers

        if self.config_class == "AutoConfig":  # a config file's own keys, model_type among them
            arguments = dict(self.arguments)
            return transformers.AutoConfig.for_model(arguments.pop("model_type"), **arguments)
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
    Recipe("gemma3-demo", "Gemma3TextConfig",
           {"vocab_size": VOCAB, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 256,
            "query_pre_attn_scalar": 64},
           "the replay's model: Gemma-3's five sliding-window (256) layers per full one, large enough that a "
           "prefill costs more than loading its KV"),
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
            "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128, "full_attention_interval": 4,
            "max_position_embeddings": 4096},
           "Gated DeltaNet (conv + recurrent state per block) beside full attention: a mamba hybrid",
           dtype="bfloat16",  # vLLM's CPU GDN kernels take bf16 activations, and fp32 states without AMX
           # `align` keeps a state at every block boundary, and vLLM turns it off without its own prefix cache
           engine_settings={"prefix_caching": True,
                            "engine_args": {"mamba_cache_mode": "align", "mamba_ssm_cache_dtype": "float32"}}),
)}


def default_cache_dir() -> Path:
    root = os.environ.get("LMCACHE_NPU_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmcache-npu", "models")
    return Path(root)


def model_vocab(model_dir: str | os.PathLike[str], most: int) -> int:
    """The token ids a workload may use on the model in `model_dir`: its vocabulary, at most `most`."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model directory {model_dir}: no readable config.json ({exc})") from exc
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"model directory {model_dir}: config.json has no vocab_size")
    return min(vocab, most)


def recipe_from_config_file(path: str | os.PathLike[str]) -> Recipe:
    """A Hugging Face config.json (any architecture vLLM serves) as a recipe: its weights are made here."""
    try:
        arguments = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model config {path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(arguments, dict) or not isinstance(arguments.get("model_type"), str):
        raise ValueError(f"model config {path}: needs a \"model_type\" (a Hugging Face config.json)")
    dtype = str(arguments.get("torch_dtype") or arguments.get("dtype") or "float32")
    arguments = {k: v for k, v in arguments.items() if k not in ("architectures", "torch_dtype", "dtype")}
    return Recipe(Path(path).stem, "AutoConfig", arguments, f"the model of {path}", dtype=dtype)


def resolve_recipe(name: str | Recipe) -> Recipe:
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown model recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def make_model(name: str | Recipe, cache_dir: Optional[Path] = None, seed: int = 0,
               progress: Optional[Callable[[str], None]] = None) -> Path:
    """The directory of recipe `name` (config.json + safetensors), made on first use."""
    recipe = resolve_recipe(name)
    name = recipe.name
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
    publish_directory(target, model.save_pretrained, "config.json")
    logger.info("made model %s in %s", name, target)
    return target
