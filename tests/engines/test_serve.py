"""`vllm serve` on this machine's CPU with the plugin from --kv-transfer-config: the smoke test the NPU and CUDA
suites run on their devices, proven here first."""

from __future__ import annotations

from pathlib import Path

from lmcache_npu.tools.replay.models import model_vocab

from ..serve_smoke import check, kv_transfer_config, two_identical_requests

CHUNK_TOKENS = 256


def test_vllm_serve_loads_the_second_identical_request_from_the_plugin(model_dirs, tmp_path: Path) -> None:
    model = model_dirs("llama")
    vocab = model_vocab(model, 4000)
    prompt = [(7 * i + 3) % vocab for i in range(4 * CHUNK_TOKENS + 37)]
    args = ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "4",
            "--kv-transfer-config", kv_transfer_config({"cpu_bytes": "256MiB", "chunk_tokens": CHUNK_TOKENS})]
    result = two_identical_requests(model, args, tmp_path / "serve.log", prompt)
    check(result, CHUNK_TOKENS)
