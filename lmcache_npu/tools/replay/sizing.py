"""Sizing the device KV cache from the workload: the regime offload exists for is a working set several times what
the device holds, so `--kv-cache-memory auto` picks the memory that makes it `ratio` times, and the replay prints the
ratio the engine actually got (vLLM's own token capacity, which counts sliding-window groups its own way)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .workload import Conversation

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


def working_set_tokens(conversations: Sequence[Conversation]) -> int:
    """Distinct tokens whose KV a perfect cache would keep: each shared system prompt once, plus every turn's user
    message and answer (what later turns re-send)."""
    systems = {c.system for c in conversations}
    return sum(len(s) for s in systems) + sum(len(t.user) + t.output_tokens for c in conversations for t in c.turns)


def longest_request_tokens(conversations: Sequence[Conversation]) -> int:
    """The longest context one request needs on the device (its last turn, answer included)."""
    return max(len(c.system) + sum(len(t.user) + t.output_tokens for t in c.turns) for c in conversations)


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V bytes one token takes over every attention layer of the model in `model_dir` (its config.json):
    an upper bound for sliding-window layers, which vLLM keeps only a window of."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    layers = config.get("num_hidden_layers")
    heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    head_dim = config.get("head_dim") or (config["hidden_size"] // config["num_attention_heads"])
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"no byte width for dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if not layers or not heads:
        raise ValueError(f"{model_dir}/config.json: needs num_hidden_layers and num_key_value_heads to size the KV "
                         f"cache (pass --kv-cache-memory in bytes instead)")
    return 2 * int(layers) * int(heads) * int(head_dim) * DTYPE_BYTES[name]


def kv_memory_for(conversations: Sequence[Conversation], ratio: float, bytes_per_token: int, max_model_len: int = 0,
                  block_tokens: int = 256) -> int:
    """Device KV bytes for a working set `ratio` times the capacity, never below two of the longest request nor 1.5
    of `max_model_len` (vLLM refuses a cache that cannot hold one request, and counts bytes per token a little above
    this estimate for small models), rounded up to whole `block_tokens`."""
    if ratio < 1:
        raise ValueError(f"--working-set-ratio must be >= 1, got {ratio}")
    tokens = max(working_set_tokens(conversations) / ratio, 2 * longest_request_tokens(conversations),
                 1.5 * max_model_len)
    return int(-(-tokens // block_tokens) * block_tokens * bytes_per_token)


def device_capacity_tokens(engine: Any) -> int:
    """The tokens vLLM says its KV cache holds (its group-aware capacity), 0 when this vLLM does not say."""
    for owner in (engine.engine_core, engine.llm.llm_engine):
        config = getattr(owner, "vllm_config", None)
        tokens = getattr(getattr(config, "cache_config", None), "kv_cache_size_tokens", None)
        if tokens:
            return int(tokens)
    return 0
