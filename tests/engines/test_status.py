"""`lmcache-npu status --json` against a real `vllm serve` with the plugin: the tiers, use, hit rate and namespace
it prints come from the /metrics the server already serves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_npu.tools.replay.models import model_vocab
from lmcache_npu.tools.servebench.server import complete, kv_transfer_config, vllm_server

pytestmark = pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: era-neutral, runs once

CHUNK_TOKENS = 256


def status_json(base: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "lmcache_npu.tools.cli", "status", "--url", base, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (engine,) = json.loads(done.stdout)["engines"]
    return engine


def test_status_reads_a_serving_engines_store(model_dirs, tmp_path: Path) -> None:
    model = model_dirs("llama")
    vocab = model_vocab(model, 4000)
    prompt = [(11 * i + 5) % vocab for i in range(3 * CHUNK_TOKENS + 17)]
    args = ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "4",
            "--kv-transfer-config", kv_transfer_config({"cpu_bytes": "64MiB", "chunk_tokens": CHUNK_TOKENS})]
    with vllm_server(model, args, tmp_path / "serve.log") as base:
        complete(base, model, prompt, 4)
        time.sleep(1.0)  # the stores complete after the request's last step
        complete(base, model, prompt, 4)
        deadline = time.monotonic() + 30
        engine = status_json(base)
        while engine["hit_tokens"] == 0 and time.monotonic() < deadline:  # stats reach /metrics with later steps
            time.sleep(1.0)
            engine = status_json(base)
    assert len(engine["namespace"]) == 32 and int(engine["namespace"], 16) >= 0
    assert engine["eviction_policy"] and engine["chunk_tokens"] == CHUNK_TOKENS and engine["chunk_bytes"] > 0
    (cpu,) = engine["tiers"]  # no disk, no Mooncake configured
    # slots are aligned, so a little of the arena may hold no chunk
    assert cpu["tier"] == "cpu" and 0.9 * (64 << 20) <= cpu["capacity_bytes"] <= 64 << 20
    assert cpu["used_chunks"] == 3 and cpu["used_bytes"] == 3 * engine["chunk_bytes"]
    assert engine["hit_tokens"] == 3 * CHUNK_TOKENS and cpu["hit_chunks"] == 3
    assert 0 < engine["hit_rate"] <= 1 and cpu["hit_rate"] == engine["hit_rate"]
