"""`vllm serve` on a CUDA GPU with the plugin (where vLLM with CUDA is installed): the same smoke test as the CPU
engines and the NPU suite run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from ..serve_smoke import check, kv_transfer_config, two_identical_requests

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("lmcache_npu._cuda") is None,
                       reason="lmcache_npu._cuda is not built (needs nvcc and a CUDA build of torch)"),
]
CHUNK_TOKENS = 256


def test_vllm_serve_loads_the_second_identical_request_from_the_plugin(tmp_path: Path) -> None:
    from lmcache_npu.tools.replay.models import make_model, model_vocab

    model = os.environ.get("LMCACHE_NPU_SMOKE_MODEL") or str(make_model("llama"))
    vocab = model_vocab(model, 4000) if Path(model).is_dir() else 4000
    prompt = [(7 * i + 3) % vocab for i in range(8 * CHUNK_TOKENS + 37)]
    args = ["--dtype", "bfloat16", "--max-model-len", "4096", "--no-enable-prefix-caching", "--max-num-seqs", "4",
            "--gpu-memory-utilization", "0.5",
            "--kv-transfer-config", kv_transfer_config({"cpu_bytes": "4GiB", "chunk_tokens": CHUNK_TOKENS})]
    if not os.environ.get("LMCACHE_NPU_SMOKE_MODEL"):
        args.append("--skip-tokenizer-init")
    check(two_identical_requests(model, args, tmp_path / "serve.log", prompt), CHUNK_TOKENS)
