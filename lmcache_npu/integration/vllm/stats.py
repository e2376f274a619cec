"""The connector's statistics through vLLM's connector stats (logged every interval) and Prometheus counters.

Both halves count into named sums; vLLM merges every rank's sums with the scheduler's (`aggregate`) and logs
`reduce()`: lookups, hit tokens and rate, hits per tier, loaded and stored tokens and bytes, GB/s, failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ...store.tier import TierCounters
from .adapter import KVConnectorPromMetrics, KVConnectorStats

SchedulerCounters = TierCounters

# name -> Prometheus help text; every counter either half keeps (sums over ranks and steps)
METRICS: dict[str, str] = {
    "lookups": "requests admitted after a lookup in the plugin's store",
    "lookups_pending": "lookups answered 'ask again' while disk or Mooncake chunks were promoted into the arena",
    "lookup_tokens": "tokens of looked-up requests beyond vLLM's own prefix-cache hit",
    "hit_tokens": "tokens loaded from the plugin instead of being prefilled",
    "hit_chunks_cpu": "hit chunks found in the host arena",
    "hit_chunks_disk": "hit chunks promoted from the local disk tier",
    "hit_chunks_remote": "hit chunks promoted from the Mooncake store",
    "store_chunks": "chunks the scheduler sent to be stored",
    "store_chunks_unsafe": "completed chunks not stored because vLLM may already have freed some of their rows",
    "delayed_frees": "finished requests whose blocks vLLM kept until their stores had read them",
    "load_failures": "load commands that failed on some rank (the request recomputes)",
    "store_failures": "store commands that failed on some rank (the chunk is not stored)",
    "loaded_chunks": "chunks loaded into device pages (summed over ranks)",
    "loaded_bytes": "bytes loaded into device pages (summed over ranks)",
    "load_seconds": "seconds the load transfers took (summed over ranks)",
    "stored_chunks": "chunks stored from device pages (summed over ranks)",
    "stored_bytes": "bytes stored from device pages (summed over ranks)",
    "store_seconds": "seconds the store transfers took (summed over ranks)",
    "load_retries": "device loads retried after a failure",
    "transfer_failures": "device transfers that failed (each fails its commands)",
}


@dataclass
class LMCacheNPUStats(KVConnectorStats):
    """`data` is {counter name: sum}; picklable, as vLLM ships it from workers to the logger."""

    def __post_init__(self) -> None:
        self.data = {k: v for k, v in (self.data or {}).items() if v}

    @classmethod
    def of(cls, counts: Mapping[str, float]) -> "LMCacheNPUStats":
        return cls(data=dict(counts))

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LMCacheNPUStats":
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: d[name] for name in METRICS if d.get(name)}
        if d.get("lookup_tokens"):
            out["hit_rate"] = round(d.get("hit_tokens", 0) / d["lookup_tokens"], 4)
        for kind, moved in (("load", "loaded_bytes"), ("store", "stored_bytes")):
            if d.get(f"{kind}_seconds"):
                out[f"{kind}_GBps"] = round(d.get(moved, 0) / d[f"{kind}_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


class LMCacheNPUPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `METRICS`, named `lmcache_npu:<name>` (seconds and bytes as floats)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"lmcache_npu:{name}", documentation=text,
                                                  labelnames=labelnames)
                          for name, text in METRICS.items()}
        self._bound: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name not in self._counters or not value:
                continue
            bound = self._bound.get((engine_idx, name))
            if bound is None:
                bound = self._bound[(engine_idx, name)] = self._counters[name].labels(
                    *self.per_engine_labelvalues[engine_idx])
            bound.inc(value)
