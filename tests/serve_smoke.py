"""`vllm serve` with the plugin, end to end: two identical long requests, the second one's prefill served from the
plugin (its Prometheus counters say how many tokens), identical outputs. The CPU engine tests, the NPU suite and
the CUDA suite run the same check on their device. The server's life and the HTTP calls live in
lmcache_npu.tools.servebench (the serving benchmark uses the same ones)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lmcache_npu.tools.servebench.metrics import read_counters
from lmcache_npu.tools.servebench.server import CONNECTOR, complete, kv_transfer_config, vllm_server

__all__ = ["CONNECTOR", "SmokeResult", "check", "complete", "hit_tokens", "kv_transfer_config",
           "two_identical_requests", "vllm_server", "wait_for_hits"]


@dataclass(frozen=True)
class SmokeResult:
    first: tuple[int, ...]
    second: tuple[int, ...]
    hit_tokens_after_first: float
    hit_tokens_after_second: float
    prompt_tokens: int


def hit_tokens(base: str) -> float:
    """The plugin's hit-token counter from vLLM's /metrics (summed over label sets)."""
    return read_counters(base).plugin_hits


def wait_for_hits(base: str, above: float, timeout_s: float = 30.0) -> float:
    """Connector stats reach /metrics with the engine's next steps: wait for the counter to move."""
    deadline = time.monotonic() + timeout_s
    value = hit_tokens(base)
    while value <= above and time.monotonic() < deadline:
        time.sleep(1.0)
        value = hit_tokens(base)
    return value


def two_identical_requests(model: str, args: Sequence[str], log_path: Path, prompt: Sequence[int],
                           env: Optional[Mapping[str, str]] = None, max_tokens: int = 16) -> SmokeResult:
    """Serves `model` with `args` (which carry the kv-transfer-config), sends `prompt` twice, reads the counter."""
    with vllm_server(model, args, log_path, env) as base:
        first = complete(base, model, prompt, max_tokens)
        time.sleep(1.0)  # the first request's stores finish after its last step
        after_first = hit_tokens(base)
        second = complete(base, model, prompt, max_tokens)
        after_second = wait_for_hits(base, after_first)
    return SmokeResult(first, second, after_first, after_second, len(prompt))


def check(result: SmokeResult, chunk_tokens: int) -> None:
    """Nothing hit on the first request; the second loaded every whole chunk of its prompt but at most one (the
    last may be computed so the model has a token to start from), and generated the same tokens."""
    assert result.hit_tokens_after_first == 0, f"the first request hit {result.hit_tokens_after_first:.0f} tokens"
    loaded = result.hit_tokens_after_second - result.hit_tokens_after_first
    whole_chunks = (result.prompt_tokens - 1) // chunk_tokens * chunk_tokens
    assert loaded >= whole_chunks, (
        f"the second request loaded {loaded:.0f} tokens; its prompt has {whole_chunks} tokens of whole chunks")
    assert result.second == result.first, "the second request's tokens differ from the first's"
