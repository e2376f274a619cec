"""vLLM 0.23 on this machine's CPU: the CPU platform keeps the hybrid KV-cache manager on (the CUDA wheel would
pick UnspecifiedPlatform here and turn it off). tests/conftest.py selects it before any test imports vLLM; this
module does the same for scripts that import the harness directly."""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import vllm.platforms as _platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

if not isinstance(_platforms._current_platform, CpuPlatform):
    _platforms._current_platform = CpuPlatform()

_MODEL_DIR: str | None = None


def tiny_model_dir() -> str:
    """A directory holding a config.json and one small weights file: enough for vLLM's ModelConfig offline (no
    weights are loaded: the model is simulated) and for the plugin to name the weights by their content."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        import torch
        from safetensors.torch import save_file

        _MODEL_DIR = tempfile.mkdtemp(prefix="lmcache-npu-model-")
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                  "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 262144,
                  "torch_dtype": "float32", "rms_norm_eps": 1e-5}
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(config, f)
        save_file({"model.embed_tokens.weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64)},
                  os.path.join(_MODEL_DIR, "model.safetensors"))
    return _MODEL_DIR
