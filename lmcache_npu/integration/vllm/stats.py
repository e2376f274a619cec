"""The connector's statistics through vLLM's connector stats (logged every interval) and Prometheus counters.

Both halves count into named sums; vLLM merges every rank's sums with the scheduler's (`aggregate`) and logs
`reduce()`: lookups, hit tokens and rate, hits per tier, loaded and stored tokens and bytes, GB/s, failures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from ...store.metrics import Metric
from ...store.tier import TierCounters
from .adapter import KVConnectorPromMetrics, KVConnectorStats

logger = logging.getLogger(__name__)

# name -> Prometheus help text; every sum either half reports (over ranks and steps): counters, but ARENA_METRICS
METRICS: dict[str, str] = {  # Metric keys: a member is its name
    Metric.LOOKUPS: "requests admitted after a lookup in the plugin's store",
    Metric.LOOKUPS_PENDING: "lookups answered 'ask again' while disk or Mooncake chunks were promoted into the arena",
    Metric.LOOKUP_TOKENS: "tokens of looked-up requests beyond vLLM's own prefix-cache hit",
    Metric.HIT_TOKENS: "tokens loaded from the plugin instead of being prefilled",
    Metric.HIT_CHUNKS_CPU: "hit chunks found in the host arena",
    Metric.HIT_CHUNKS_DISK: "hit chunks promoted from the local disk tier",
    Metric.HIT_CHUNKS_REMOTE: "hit chunks promoted from the Mooncake store",
    Metric.STORE_CHUNKS: "chunks the scheduler sent to be stored",
    Metric.STORE_CHUNKS_UNSAFE: "completed chunks not stored because vLLM may already have freed some of their rows",
    Metric.DELAYED_FREES: "finished requests whose blocks vLLM kept until their stores had read them",
    Metric.REMOTE_PREFILL_DEFERRED: "requests whose prompt a prefill engine sends (do_remote_prefill) left to the P/D "
                                    "connector beside this one (MultiConnector) instead of a local hit",
    Metric.HANDOFFS_SENT: "P/D hand-offs through the node cache this prefill engine answered (kv_transfer_params)",
    Metric.HANDOFF_TAIL_CHUNKS: "prompts' partial last chunks stored for a P/D hand-off",
    Metric.HANDOFFS_RECEIVED: "P/D hand-offs through the node cache this decode engine loaded from",
    Metric.HANDOFF_WAITS: "lookups answered 'ask again' while the prefill engine was still storing hand-off chunks",
    Metric.HANDOFFS_EXPIRED: "hand-offs whose pending chunks were given up after handoff_wait_ms (computed instead)",
    Metric.HANDOFFS_REFUSED: "hand-offs not used: malformed, another namespace, or keys this engine does not compute",
    Metric.LORA_BYPASSED_REQUESTS: "LoRA requests served without the plugin: their adapter's files could not be read, so "
                              "nothing names their KV",
    Metric.LOAD_FAILURES: "load commands that failed on some rank (the request recomputes)",
    Metric.STORE_FAILURES: "store commands that failed on some rank (the chunk is not stored)",
    Metric.LOADED_CHUNKS: "chunks loaded into device pages (summed over ranks)",
    Metric.LOADED_BYTES: "bytes loaded into device pages (summed over ranks)",
    Metric.LOAD_SECONDS: "seconds the load transfers took (summed over ranks)",
    Metric.STORED_CHUNKS: "chunks stored from device pages (summed over ranks)",
    Metric.STORED_BYTES: "bytes stored from device pages (summed over ranks)",
    Metric.STORE_SECONDS: "seconds the store transfers took (summed over ranks)",
    Metric.LOAD_RETRIES: "device loads retried after a failure",
    Metric.TRANSFER_FAILURES: "device transfers that failed (each fails its commands)",
    Metric.STEP_LOAD_WAITS: "steps where the model runs on the host that queued loads and waited for them, so they are "
                       "reported in that step (no wait where they were already done; per rank, summed)",
    Metric.STEP_LOAD_WAIT_MISSES: "of those, steps whose loads were not done within the wait (reported at a later step; per "
                             "rank, summed)",
    Metric.SLICED_LOADS: "hits loaded into the forward that computes their request (load_mode sliced or chosen by auto)",
    Metric.SLICED_LOAD_TOKENS: "tokens of those hits",
    Metric.SLICED_LOAD_FAILURES: "sliced loads that failed on some rank: vLLM recomputes their blocks and drops the "
                                 "step's token (per rank, summed)",
    Metric.SLICED_LOAD_UNWAITED: "of those, loads a forward may have read before they landed (a layer that consumes a "
                                 "slice ran without announcing itself; per rank, summed)",
    Metric.FENCE_WAITS: "store batches the model's stream waited for before a step wrote pages they still read "
                   "(summed over ranks)",
    Metric.FENCE_SKIPS: "in-flight store batches a step let read on, since it wrote none of their pages (per step, summed "
                   "over ranks)",
    Metric.FENCED_STORE_COMMANDS: "store commands the scheduler named because the step wrote a block they read",
    Metric.FENCE_UNKNOWN_STEPS: "steps whose writes the scheduler could not place, so every queued store was waited for",
    Metric.SHARE_STORED_BYTES: "bytes of chunk objects stored in the arena with tp_share (own planes + a 1/tp share of the "
                          "replicated ones; summed over ranks)",
    Metric.SHARE_LOADED_BYTES: "bytes of stored share objects loaded with tp_share (summed over ranks)",
    Metric.SHARE_EXCHANGED_BYTES: "bytes of other ranks' shares received through the TP group's exchange (summed over "
                             "ranks)",
    Metric.SHARE_LOAD_FAILURES: "loads refused on every rank because a share was missing or invalid on some rank",
    Metric.SHARE_HOST_FALLBACKS: "load batches exchanged in host memory because some rank had no device memory for the "
                            "device exchange (per rank, summed)",
    Metric.SHARE_STORE_HOST_SCRATCH: "store batches whose full objects went to host scratch because the device had no "
                                "memory for them (per rank, summed)",
    Metric.EAGLE_DROPPED_CHUNKS: "chunks a hit did not claim because an EAGLE/MTP drafter's last row depends on the next "
                            "chunk's first token",
    Metric.EPOCH_CHANGES: "times a worker mapped the segments of a restarted node cache (a new epoch; summed over "
                     "ranks)",
    Metric.NODE_EPOCH_RELEASES: "times a worker unmapped a node cache epoch that was gone or replaced, once its "
                           "commands had settled (summed over ranks)",
    Metric.NODE_REBINDS: "times a worker attached again to a restarted node cache that kept its epoch (a warm "
                         "restart): its mapping kept, nothing mapped or registered again (summed over ranks)",
    Metric.NODE_UNMAPPED_COMMANDS: "node cache commands a worker failed because the epoch they were issued for was not "
                              "mapped there (yet): loads recompute, stores are not made (summed over ranks)",
    Metric.OVERDUE_COMMANDS: "load and store commands a worker waited for past its deadline and answered as failed "
                             "(the load recomputes, the store is dropped; summed over ranks)",
    Metric.COUNTER_REGRESSIONS: "counter moves that went negative and were left out of the Prometheus counters, which "
                                "refuse them (a bug: the log names the counter)",
    # the cost model and the cut point (integration/vllm/cut_point.py), counted at each request's admission
    Metric.COST_CLAIMED_TOKENS_FASTER: "hit tokens claimed because the cost model predicted loading them beats "
                                       "computing them",
    Metric.COST_CLAIMED_TOKENS_UNFITTED: "hit tokens claimed before the cost model had seen enough steps to decline",
    Metric.COST_CLAIMED_TOKENS_LOAD_ALL: "hit tokens claimed under load_policy load-all",
    Metric.COST_DECLINED_TOKENS_SLOWER: "hit tokens computed instead because the cost model predicted computing them "
                                        "is faster than loading them",
    Metric.COST_DECLINED_TOKENS_LATE: "hit tokens computed instead because their promotion ran past the deadline the "
                                      "cost model set",
    Metric.COST_PROBE_LOOKUPS: "lookups that promoted the chunks the cost model declined on a slow tier, unclaimed, "
                               "so that the tier's speed is measured again (one in 32 such decisions)",
    Metric.COST_PREDICTED_SAVED_SECONDS: "time to first token the cost model predicted its claims saved (summed over "
                                         "requests)",
    Metric.COST_PREDICTED_LOST_SECONDS: "time to first token the cost model predicted claims it did not choose cost "
                                        "(load-all or unfitted claims slower than computing, summed over requests)",
    Metric.COST_PREDICTED_STEP_SECONDS: "engine step seconds the cost model predicted, for the steps it observed",
    Metric.COST_OBSERVED_STEP_SECONDS: "engine step seconds observed (the same steps)",
    Metric.COST_PREDICTED_LOAD_SECONDS: "arena -> device load seconds the cost model predicted, for the batches the "
                                        "workers timed",
    Metric.COST_OBSERVED_LOAD_SECONDS: "arena -> device load seconds the workers timed (the same batches)",
    Metric.COST_PREDICTED_DISK_SECONDS: "disk promotion seconds the cost model predicted, for the batches timed",
    Metric.COST_OBSERVED_DISK_SECONDS: "disk promotion seconds the workers timed (the same batches)",
    Metric.COST_PREDICTED_REMOTE_SECONDS: "Mooncake promotion seconds the cost model predicted, for the batches timed",
    Metric.COST_OBSERVED_REMOTE_SECONDS: "Mooncake promotion seconds the workers timed (the same batches)",
    Metric.COST_PREDICTED_WAIT_SECONDS: "seconds the cost model predicted requests would wait for their promotions",
    Metric.COST_OBSERVED_WAIT_SECONDS: "seconds those requests waited for their promotions",
}
# the host arena's segments: levels, not counts. Each rank reports how they moved since its last report (up as
# segments go live, down when a node cache epoch is unmapped), so the sum over steps and ranks is the current state;
# exported as Prometheus gauges, since a counter refuses to go down
ARENA_METRICS: dict[str, str] = {
    Metric.ARENA_BYTES: "bytes of host-arena slots (summed over ranks)",
    Metric.ARENA_LIVE_BYTES: "bytes of host-arena slots in live (registered) segments (summed over ranks)",
    Metric.SEGMENTS_LIVE: "host-arena segments live: registered with the device, or pageable (summed over ranks)",
    Metric.SEGMENTS_TOTAL: "host-arena segments mapped (summed over ranks)",
}
METRICS.update(ARENA_METRICS)
# per-rank counters, exported as `rank<r>_<name>` (e.g. rank1_stored_bytes): what each rank's tiers hold and read
PER_RANK_METRICS = ("stored_bytes", "loaded_bytes")

# counters the store keeps for its own tests and logs (never drained): exported name -> (own name, help text)
INDEX_METRICS: dict[str, tuple[str, str]] = {
    "evictions": (Metric.EVICTIONS, "host-arena chunks evicted to make room (spilled to disk first where there is one)"),
    "evicted_lost": (Metric.EVICTED_LOST, "evicted chunks no lower tier holds: gone from this instance"),
    "spills": (Metric.SPILLS, "host-arena chunks written to the disk tier"),
    "spill_failures": (Metric.SPILL_FAILED, "spills that failed on some rank"),
    "disk_persists": (Metric.PERSISTS, "chunks written through to the disk tier"),
    "persist_failures": (Metric.PERSIST_FAILED, "write-throughs that failed on some rank"),
    "persist_no_room": (Metric.PERSIST_NO_ROOM, "write-throughs skipped: every disk chunk was being read or written"),
    "disk_evictions": (Metric.DISK_EVICTIONS, "chunks dropped from the disk tier to make room"),
    "store_no_slot": (Metric.STORE_NO_SLOT, "chunks not stored because every arena slot was pinned or reserved"),
    "promotions_disk": (Metric.PROMOTIONS_DISK, "chunks promoted from the disk tier into the host arena"),
    "promotions_remote": (Metric.PROMOTIONS_REMOTE, "chunks promoted from the Mooncake store into the host arena"),
    "promote_no_slot": (Metric.PROMOTE_NO_SLOT, "promotions skipped for want of a free arena slot"),
    "promote_failures": (Metric.PROMOTE_FAILED, "promotions that failed on some rank (the chunk is a miss)"),
    "remote_put_failures": (Metric.PUT_FAILED, "Mooncake puts that failed on some rank"),
    "remote_lookup_errors": (Metric.REMOTE_LOOKUP_ERRORS, "Mooncake existence checks that failed (taken as misses)"),
    "cost_declined_disk_writes": (Metric.COST_DECLINED_DISK_WRITES, "disk writes (spills, write-throughs) the cost "
                                  "model declined: reading the chunk back was predicted to save less than writing it costs"),
    "cost_declined_remote_puts": (Metric.COST_DECLINED_REMOTE_PUTS, "Mooncake puts the cost model declined (the same "
                                  "rule as for the disk)"),
    # the node cache client's (node_cache set): the service going away and coming back
    "node_cache_disconnects": (Metric.NODE_CACHE_DISCONNECTS, "times the node cache service was lost (every lookup "
                                                              "misses until it is back)"),
    "node_cache_reconnects": (Metric.NODE_CACHE_RECONNECTS, "times this engine attached to the node cache again (a new "
                                                            "epoch)"),
    "node_cache_unreachable": (Metric.NODE_CACHE_UNREACHABLE, "node cache calls answered as misses while the service "
                                                              "was away"),
    "node_cache_refused": (Metric.NODE_CACHE_REFUSED, "attaches the node cache refused (no pool for this engine's "
                                                      "geometry): the engine serves without it meanwhile"),
    "node_cache_error_replies": (Metric.NODE_CACHE_ERROR_REPLIES, "node cache calls the service answered with an "
                                                                  "error, taken as misses"),
    "node_cache_malformed_replies": (Metric.NODE_CACHE_MALFORMED_REPLIES, "node cache replies of an unexpected shape "
                                                                          "(another release?), taken as misses"),
    "node_cache_refused_commands": (Metric.NODE_CACHE_REFUSED_COMMANDS, "node cache commands a step had handed "
                                    "out when the service was lost, answered as failed by the workers (loads "
                                    "recompute)"),
    "node_cache_replayed_completions": (Metric.NODE_CACHE_REPLAYED_COMPLETIONS, "answers sent again to the node cache "
                                        "after a timeout, on attaching to the same service (its slots are freed)"),
}
DISK_METRICS: dict[str, tuple[str, str]] = {
    "disk_writes": (Metric.WRITES, "chunk files written (summed over ranks)"),
    "disk_write_bytes": (Metric.WRITE_BYTES, "bytes written to chunk files (summed over ranks)"),
    "disk_reads": (Metric.READS, "chunk files read (summed over ranks)"),
    "disk_read_bytes": (Metric.READ_BYTES, "bytes read from chunk files (summed over ranks)"),
    "disk_corrupt": (Metric.CORRUPT, "chunk files refused as corrupt or of another layout, and removed"),
    "disk_io_errors": (Metric.IO_ERRORS, "disk reads or writes that raised"),
    "disk_full": (Metric.DISK_FULL, "writes refused because the file system was full"),
    "disk_queue_full": (Metric.QUEUE_FULL, "spills refused because the write-behind queue was full"),
    "disk_rejected": (Metric.REJECTED, "chunk files whose envelope did not verify for the chunk asked for (never loaded)"),
}
REMOTE_METRICS: dict[str, tuple[str, str]] = {
    "mooncake_puts": (Metric.PUTS, "chunk objects put into the Mooncake store (summed over ranks)"),
    "mooncake_put_bytes": (Metric.PUT_BYTES, "bytes put into the Mooncake store (summed over ranks)"),
    "mooncake_get_bytes": (Metric.GET_BYTES, "bytes read from the Mooncake store (summed over ranks)"),
    "mooncake_misses": (Metric.MISSES, "Mooncake reads of objects no longer there"),
    "mooncake_errors": (Metric.ERRORS, "Mooncake calls that failed"),
    "mooncake_timeouts": (Metric.TIMEOUTS, "Mooncake calls that ran past their deadline"),
    "mooncake_unavailable": (Metric.UNAVAILABLE, "times the Mooncake store was marked unavailable (calls skip it a while)"),
    "mooncake_skipped": (Metric.UNHEALTHY_SKIPS, "Mooncake calls skipped while the store was marked unavailable"),
    "mooncake_rejected": (Metric.REJECTED, "Mooncake objects whose envelope did not verify for the chunk asked for "
                                      "(overwritten, forged or corrupt: never loaded)"),
    "mooncake_put_existing": (Metric.PUT_EXISTING, "puts of a name that already held a valid object (not written again)"),
    "mooncake_put_replaced_invalid": (Metric.PUT_REPLACED_INVALID, "puts that replaced an object whose envelope did "
                                                              "not verify"),
}
for _table in (INDEX_METRICS, DISK_METRICS, REMOTE_METRICS):
    METRICS.update({name: text for name, (_, text) in _table.items()})

# what the scheduler's index holds now, reported when it changes and exported as Prometheus gauges (set, not summed)
GAUGES: dict[str, str] = {
    "cpu_capacity_chunks": "chunks the host arena can hold",
    "cpu_used_chunks": "chunks in the host arena (stored, being written or promoted)",
    "disk_capacity_chunks": "chunk files the local disk tier can hold (0: no disk tier)",
    "disk_used_chunks": "chunk files on the local disk tier (written or being written)",
    "chunk_bytes": "bytes of one chunk, summed over ranks (capacity in bytes is chunks times this)",
    "chunk_tokens": "tokens per chunk",
}
# the cost model's fit (integration/vllm/cut_point.py), reported when it moves; also gauges
FIT_GAUGES: dict[str, str] = {
    "cost_step_base_seconds": "the cost model's fixed seconds per engine step",
    "cost_step_token_seconds": "the cost model's seconds per scheduled token",
    "cost_step_attention_seconds": "the cost model's seconds per scheduled token and token of context it attends to",
    "cost_step_observations": "engine steps the cost model's compute side learned from (recency-weighted)",
    "cost_load_latency_seconds": "the cost model's fixed seconds of an arena -> device load",
    "cost_load_bytes_per_second": "the cost model's arena -> device bandwidth (one rank)",
    "cost_disk_latency_seconds": "the cost model's fixed seconds of a disk -> arena promotion",
    "cost_disk_bytes_per_second": "the cost model's disk -> arena bandwidth (one rank)",
    "cost_remote_latency_seconds": "the cost model's fixed seconds of a Mooncake -> arena promotion",
    "cost_remote_bytes_per_second": "the cost model's Mooncake -> arena bandwidth (one rank)",
}
GAUGES.update(FIT_GAUGES)
# `lmcache_npu:store_info{namespace=..., eviction_policy=..., tiers=...} 1`: what names this engine's chunks (a
# digest of model content and layout, never a secret) and how it keeps them; reported as a tuple of those values
STORE_INFO = "store_info"
STORE_INFO_LABELS = ("namespace", "eviction_policy", "tiers")


class CounterDeltas:
    """What long-lived counters grew by since the last `take`, under exported names (the store's counters are read
    by its own code and tests, so they are never drained)."""

    def __init__(self) -> None:
        self._sources: list[tuple[TierCounters, dict[str, tuple[str, str]]]] = []
        self._last: dict[tuple[int, str], float] = {}
        self._versions: list[int] = []  # each source's version as of the last take

    def watch(self, counters: TierCounters, names: dict[str, tuple[str, str]]) -> None:
        self._sources.append((counters, names))
        self._versions.append(-1)

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for position, (counters, names) in enumerate(self._sources):
            if counters.version == self._versions[position]:  # nothing counted since the last take
                continue
            self._versions[position], now = counters.versioned_snapshot()
            for exported, (own, _) in names.items():
                value = now.get(own, 0)
                grown = value - self._last.get((position, own), 0)
                self._last[(position, own)] = value
                if grown:
                    out[exported] = out.get(exported, 0) + grown
        return out


@dataclass
class LMCacheNPUStats(KVConnectorStats):
    """`data` is {counter name: sum}; picklable, as vLLM ships it from workers to the logger."""

    def __post_init__(self) -> None:
        self.data = {k: v for k, v in (self.data or {}).items() if v or k in GAUGES}  # a gauge's 0 is news

    @classmethod
    def of(cls, counts: Mapping[str, float]) -> "LMCacheNPUStats":
        return cls(data=dict(counts))

    def reset(self) -> None:
        self.data = {}

    def __getitem__(self, field_name: str) -> Any:
        """A field by name, as in the stats' serialized form: vLLM 0.28's MultiConnector reads a child's stats as
        that dict (`stats["data"]`), which in an engine without multiprocessing they are not."""
        return getattr(self, field_name)

    def aggregate(self, other: KVConnectorStats) -> "LMCacheNPUStats":
        for name, value in (other.data or {}).items():
            if name in GAUGES or name == STORE_INFO:  # a state, not a count: the latest report wins
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: d[name] for name in METRICS if d.get(name)}
        out.update({name: value for name, value in d.items() if _per_rank(name) and value})
        if d.get("lookup_tokens"):
            out["hit_rate"] = round(d.get("hit_tokens", 0) / d["lookup_tokens"], 4)
        for kind, moved in (("load", "loaded_bytes"), ("store", "stored_bytes")):
            if d.get(f"{kind}_seconds"):
                out[f"{kind}_GBps"] = round(d.get(moved, 0) / d[f"{kind}_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


def _per_rank(name: str) -> bool:
    """`rank<r>_<metric>` with <metric> in PER_RANK_METRICS."""
    head, _, metric = name.partition("_")
    return head.startswith("rank") and head[4:].isdigit() and metric in PER_RANK_METRICS


class LMCacheNPUPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `METRICS`, named `lmcache_npu:<name>` (seconds and bytes as floats), but a
    gauge for each of `ARENA_METRICS` (levels that go down too)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous_counters()
        self._counters = {name: self._counter_cls(name=f"lmcache_npu:{name}", documentation=text,
                                                  labelnames=labelnames)
                          for name, text in METRICS.items() if name not in ARENA_METRICS}
        # the arena's sizes travel as changes (summed over ranks and steps) but are levels: they go down when a
        # worker unmaps a node cache epoch, which a Prometheus counter refuses
        self._levels = {name: self._gauge_cls(name=f"lmcache_npu:{name}", documentation=text, multiprocess_mode="sum",
                                              labelnames=labelnames)
                        for name, text in ARENA_METRICS.items()}
        self._bound: dict[tuple[int, str], Any] = {}
        self._regressed: set[str] = set()  # counters whose negative move was logged (once each)
        self._gauges = {name: self._gauge_cls(name=f"lmcache_npu:{name}", documentation=text,
                                              multiprocess_mode="mostrecent", labelnames=labelnames)
                        for name, text in GAUGES.items()}
        self._info = self._gauge_cls(name=f"lmcache_npu:{STORE_INFO}", documentation="the store's namespace, "
                                     "eviction policy and tiers (value 1)", multiprocess_mode="mostrecent",
                                     labelnames=[*labelnames, *STORE_INFO_LABELS])
        self._info_shown: dict[int, tuple[str, ...]] = {}

    def _set_state(self, name: str, value: Any, engine_idx: int) -> None:
        """A gauge takes the latest value; a new store_info replaces the engine's previous label set."""
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        if name in self._gauges:
            self._gauges[name].labels(*labels).set(float(value))
            return
        info = tuple(str(v) for v in value)
        if len(info) != len(STORE_INFO_LABELS):
            raise ValueError(f"{STORE_INFO} needs {len(STORE_INFO_LABELS)} values {STORE_INFO_LABELS}, got {value!r}")
        shown = self._info_shown.get(engine_idx)
        if shown == info:
            return
        if shown is not None:
            self._info.remove(*labels, *shown)
        self._info.labels(*labels, *info).set(1)
        self._info_shown[engine_idx] = info

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in GAUGES or name == STORE_INFO:
                self._set_state(name, value, engine_idx)
                continue
            family = self._levels.get(name) or self._counters.get(name)
            if family is None or not value:
                continue
            if value < 0 and name not in self._levels:  # Prometheus raises, and vLLM's stat logger stops the engine
                if name not in self._regressed:
                    self._regressed.add(name)
                    logger.warning("lmcache_npu: counter %s moved by %s; a counter never goes back, so the move is "
                                   "left out (counted in counter_regressions_total; please report it)", name, value)
                name, family, value = Metric.COUNTER_REGRESSIONS, self._counters[Metric.COUNTER_REGRESSIONS], 1
            bound = self._bound.get((engine_idx, name))
            if bound is None:
                bound = self._bound[(engine_idx, name)] = family.labels(*self.per_engine_labelvalues[engine_idx])
            bound.inc(value)


def _unregister_previous_counters() -> None:
    """A new engine in the same process (tests, a restarted LLM) replaces the last one's counters, as vLLM does for
    its own: the default registry refuses a second collector of the same name."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if str(getattr(collector, "_name", "")).startswith("lmcache_npu:"):
            REGISTRY.unregister(collector)
