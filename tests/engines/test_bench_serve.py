"""One small `bench-serve` point on this era's real `vllm serve`, vLLM alone and with the plugin (vLLM's prefix
cache on in both): vLLM's own `vllm bench serve` drives a few prefix_repetition requests, the counters come from
/metrics, and identical greedy requests give identical tokens in both configurations. Between the two identical
requests vLLM's prefix cache is emptied (dev-mode endpoint), so the plugin's hits are its own."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from lmcache_npu.tools.replay.models import model_vocab
from lmcache_npu.tools.servebench.load import LoadSpec, run_load
from lmcache_npu.tools.servebench.metrics import read_counters, settled_counters
from lmcache_npu.tools.servebench.server import ServerSettings, complete, kv_transfer_config, vllm_server
from lmcache_npu.tools.servebench.tokenizer import tokenizer_dir
from lmcache_npu.tools.servebench.workloads import PrefixShape, Workloads

pytestmark = pytest.mark.one_era(0, 32)  # tests/engines/conftest.py: era-neutral, runs once (the demo's era)

CHUNK_TOKENS = 256


def _reset_vllm_prefix_cache(base: str) -> None:
    for _ in range(30):  # refused while blocks are still held by a finishing request
        request = urllib.request.Request(f"{base}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read().decode()
        if not body or json.loads(body).get("success", True):
            return
        time.sleep(0.5)
    raise RuntimeError("vLLM kept refusing to reset its prefix cache")


def test_one_bench_serve_point_without_and_with_the_plugin(model_dirs, tmp_path: Path) -> None:
    model = model_dirs("llama")
    vocab = model_vocab(model, 4000)
    server = ServerSettings(model, str(tokenizer_dir(vocab)), "float32", max_model_len=2048,
                            kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    workloads = Workloads(prefix=PrefixShape(num_prompts=4, num_prefixes=1, prefix_tokens=512, suffix_tokens=32,
                                             output_tokens=8))
    prompt = [(11 * i + 5) % (vocab - 4) + 4 for i in range(3 * CHUNK_TOKENS + 21)]
    tokens, counters = {}, {}
    for name, transfer in (("alone", None), ("plugin", kv_transfer_config({"cpu_bytes": "256MiB",
                                                                          "chunk_tokens": CHUNK_TOKENS}))):
        folder = tmp_path / name
        folder.mkdir()
        env = {**server.env(), "VLLM_SERVER_DEV_MODE": "1"}
        with vllm_server(model, server.args(transfer), folder / "serve.log", env=env) as base:
            args, prompts = workloads.dataset("prefix_repetition", 0, folder)
            before = read_counters(base)
            load = run_load(LoadSpec(args, prompts, max_concurrency=1), base, model, server.tokenizer or "",
                            folder / "point.json", folder / "point.log")
            point = settled_counters(lambda: read_counters(base)).minus(before)
            first = complete(base, model, prompt, 8)
            time.sleep(1.0)  # the first request's stores finish after its last step
            _reset_vllm_prefix_cache(base)
            before_second = settled_counters(lambda: read_counters(base))
            second = complete(base, model, prompt, 8)
            after = settled_counters(lambda: read_counters(base)).minus(before_second)
        assert load.completed == prompts and load.failed == 0
        assert point.prompt_tokens >= prompts * (512 + 32)
        # three later requests re-send the 512-token prefix: some source served it (vLLM's cache or the plugin)
        assert point.vllm_hits + point.plugin_hits >= 2 * 512, point
        assert second == first, f"{name}: identical greedy requests gave different tokens"
        tokens[name], counters[name] = first, (point, after)
    alone_point, alone_after = counters["alone"]
    assert alone_point.plugin_hits == alone_point.connector_hits == alone_after.plugin_hits == 0
    assert alone_after.vllm_hits == 0  # negative control: with its cache emptied, vLLM alone computes it all
    plugin_point, plugin_after = counters["plugin"]
    assert plugin_after.plugin_hits >= 3 * CHUNK_TOKENS, plugin_after
    assert plugin_point.plugin_stored_chunks > 0
    assert tokens["plugin"] == tokens["alone"], "the plugin changed the tokens of a greedy request"
