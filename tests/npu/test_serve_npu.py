"""`vllm serve` on an Ascend NPU with the plugin (A2/A3, bfloat16): two identical long requests, the second one's
prefill loaded from the plugin, identical tokens. Not on 310P: vllm-ascend (every release through 0.25) raises "KV
cache transfer is not supported for 310P" at start-up with any KV connector; 310P is kernels-only. The model is a
small Llama made on the machine (random weights, nothing downloaded) unless LMCACHE_NPU_SMOKE_MODEL names a model
directory or hub id."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..serve_smoke import check, kv_transfer_config, two_identical_requests
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, NEEDS_VLLM_ASCEND, select_device, skip_or_fail

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_VLLM_ASCEND, NEEDS_NPU_MODULE]
CHUNK_TOKENS = 256


def test_vllm_serve_loads_the_second_identical_request_from_the_plugin(tmp_path: Path) -> None:
    from lmcache_npu.ops import BackendUnavailable, get_backend
    from lmcache_npu.tools.replay.models import make_model, model_vocab

    select_device(0)
    try:
        soc = get_backend("npu").soc.name
    except BackendUnavailable as exc:
        skip_or_fail(str(exc))
    if soc == "310p":
        pytest.skip("310P is kernels-only: vllm-ascend raises 'KV cache transfer is not supported for 310P' at "
                    "start-up whenever a KV transfer config is set (lmcache-npu doctor says which releases)")
    model = os.environ.get("LMCACHE_NPU_SMOKE_MODEL") or str(make_model("llama"))
    local = Path(model).is_dir()
    vocab = model_vocab(model, 4000) if local else 4000
    prompt = [(7 * i + 3) % vocab for i in range(8 * CHUNK_TOKENS + 37)]
    args = ["--dtype", "bfloat16", "--max-model-len", "4096",
            "--no-enable-prefix-caching", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5",
            "--kv-transfer-config", kv_transfer_config({"cpu_bytes": "4GiB", "chunk_tokens": CHUNK_TOKENS})]
    if not os.environ.get("LMCACHE_NPU_SMOKE_MODEL"):
        args.append("--skip-tokenizer-init")  # the made model has no tokenizer; prompts are token ids
    result = two_identical_requests(model, args, tmp_path / "serve.log", prompt)
    check(result, CHUNK_TOKENS)
