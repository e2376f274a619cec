"""A server's Prometheus counters (`/metrics`): prompt tokens, vLLM's own prefix-cache hits, the connector's hits
as vLLM counts them, and the plugin's own hit counter; a point's numbers are the difference over it.

vLLM counts its local prefix-cache hits (`vllm:prefix_cache_hits`) apart from a connector's
(`vllm:external_prefix_cache_hits`), and the plugin exports its own (`lmcache_npu:hit_tokens`): a token vLLM's
cache served is never credited to the plugin."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable

from ..status import parse_metrics
from .server import http_get

PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_HITS = "vllm:prefix_cache_hits"
VLLM_QUERIES = "vllm:prefix_cache_queries"
CONNECTOR_HITS = "vllm:external_prefix_cache_hits"
PLUGIN_HITS = "lmcache_npu:hit_tokens"
PLUGIN_STORED = "lmcache_npu:stored_chunks"


def parse_counters(text: str) -> dict[str, float]:
    """Every sample of a /metrics page summed over its label sets, by name without the `_total` suffix (counters'
    `_created` timestamps are dropped: they are not counts; NaN samples too). A malformed line is an error naming its
    line number (`lmcache_npu.tools.status.parse_metrics`, the one parser of the exposition format)."""
    sums: dict[str, float] = {}
    for sample in parse_metrics(text):
        if sample.name.endswith("_created") or math.isnan(sample.value):
            continue
        name = sample.name.removesuffix("_total")
        sums[name] = sums.get(name, 0.0) + sample.value
    return sums


@dataclass(frozen=True)
class ServerCounters:
    """The counts a point reports (cumulative on a server, or a point's difference)."""

    prompt_tokens: float = 0.0
    vllm_queries: float = 0.0
    vllm_hits: float = 0.0  # tokens vLLM's own prefix cache served
    connector_hits: float = 0.0  # tokens any KV connector loaded, as vLLM counts them
    plugin_hits: float = 0.0  # tokens the plugin loaded, by its own counter (0 without the plugin)
    plugin_stored_chunks: float = 0.0

    @classmethod
    def from_counters(cls, counters: dict[str, float]) -> "ServerCounters":
        return cls(counters.get(PROMPT_TOKENS, 0.0), counters.get(VLLM_QUERIES, 0.0), counters.get(VLLM_HITS, 0.0),
                   counters.get(CONNECTOR_HITS, 0.0), counters.get(PLUGIN_HITS, 0.0),
                   counters.get(PLUGIN_STORED, 0.0))

    def minus(self, before: "ServerCounters") -> "ServerCounters":
        """What happened between `before` and this snapshot; a counter that went down means another server."""
        delta = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)}
        fallen = [name for name, value in delta.items() if value < 0]
        if fallen:
            raise ValueError(f"counters {', '.join(fallen)} went down between two snapshots: not the same server")
        return ServerCounters(**delta)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def read_counters(base: str) -> ServerCounters:
    return ServerCounters.from_counters(parse_counters(http_get(f"{base}/metrics")))


def settled_counters(read: Callable[[], ServerCounters], timeout_s: float = 15.0,
                     interval_s: float = 0.5) -> ServerCounters:
    """The counters once two reads `interval_s` apart agree: connector stats reach /metrics with the engine's
    next step, a little after the last response."""
    if timeout_s <= 0 or interval_s <= 0:
        raise ValueError(f"timeout_s and interval_s must be > 0, got {timeout_s} and {interval_s}")
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        current = read()
        if current == last:
            return current
        last = current
    return last
