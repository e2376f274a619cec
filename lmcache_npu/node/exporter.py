"""The node cache's Prometheus endpoint: its pools' occupancy and counters, and per engine its leases and hits, in
the exposition format under the names engines use (`lmcache_npu:*`), so `lmcache-npu status --url` reads it too.
The node itself is the `engine="node"` series; an attached engine's own series carry its name."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from ..store.commands import Tier
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

# per-engine series: what an engine's own calls did to the node's index
ENGINE_METRICS = (Metric.LOOKUP_HIT_CHUNKS, Metric.LOOKUP_CHUNKS, Metric.STORES, Metric.LOADS)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{_label(str(item))}"' for key, item in labels.items())
    number = int(value) if float(value).is_integer() else float(value)  # byte counts print whole, never 1.04e+06
    return f"lmcache_npu:{name}{{{text}}} {number}"


def _lines(service: Any) -> Iterator[str]:
    yield "# TYPE lmcache_npu:node_connections gauge"
    yield _sample("node_connections", {"engine": "node"}, service.connections)
    yield "# TYPE lmcache_npu:node_refused_peers counter"
    yield _sample("node_refused_peers_total", {"engine": "node"}, service.refused_peers)
    yield "# TYPE lmcache_npu:node_pools_reclaimed counter"
    yield _sample("node_pools_reclaimed_total", {"engine": "node"}, service.pools_reclaimed)
    for pool in service.pools.values():
        node = {"engine": "node", "namespace": pool.geometry.namespace}
        use = pool.index.occupancy()
        yield _sample("cpu_used_chunks", node, use[Tier.ARENA][0])
        yield _sample("cpu_capacity_chunks", node, use[Tier.ARENA][1])
        yield _sample("disk_used_chunks", node, use[Tier.DISK][0])
        yield _sample("disk_capacity_chunks", node, use[Tier.DISK][1])
        yield _sample("chunk_bytes", node, pool.geometry.object_bytes * pool.geometry.world)
        yield _sample("chunk_tokens", node, pool.geometry.chunk_tokens)
        yield _sample("node_leases", node, len(pool.leases))
        tiers = "cpu" + (",disk" if pool.index.disk_chunks else "") + (",mooncake" if pool.store.mooncake else "")
        yield _sample("store_info", {**node, "eviction_policy": pool.index.eviction_policy, "tiers": tiers}, 1)
        for metric in (Metric.LOOKUPS, Metric.HIT_CHUNKS_CPU, Metric.HIT_CHUNKS_DISK, Metric.HIT_CHUNKS_REMOTE):
            yield _sample(f"{metric.value}_total", node, pool.lookup_counters[metric])
        arena_bytes = sum(arena.memory.span_bytes for arena in pool.arenas)
        yield _sample("arena_bytes", node, arena_bytes)
        yield _sample("arena_live_bytes", node, sum(arena.memory.live_bytes for arena in pool.arenas))
        yield _sample("segments_total", node, sum(len(arena.memory.segments) for arena in pool.arenas))
        yield _sample("segments_live", node, sum(arena.memory.segments_live for arena in pool.arenas))
        for name, value in sorted(pool.index.counters.snapshot().items()):
            yield _sample(f"{name}_total", node, value)
        for executor in pool.executors:
            for prefix, tier in (("disk", executor.disk), ("mooncake", executor.remote)):
                if tier is None or (prefix == "mooncake" and executor.rank):  # one Mooncake client per pool
                    continue
                for name, value in sorted(tier.counters.snapshot().items()):
                    yield _sample(f"{prefix}_{name}_total", {**node, "rank": str(executor.rank)}, value)
        for lease in pool.leases.values():
            labels = {"engine": lease.engine, "namespace": pool.geometry.namespace}
            yield _sample("node_lease_connections", labels, len(lease.connections))
            yield _sample("node_lease_commands", labels, len(lease.commands))
            for metric in ENGINE_METRICS:
                yield _sample(f"node_{metric.value}_total", labels, lease.totals.get(metric.value, 0))


def exposition(service: Any) -> str:
    """The whole endpoint's text (called under the service's lock)."""
    return "\n".join(_lines(service)) + "\n"


class MetricsServer:
    """`GET /metrics` on (host, port); port 0 picks a free one (`address` says which)."""

    def __init__(self, host: str, port: int, render: Callable[[], str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not worth a line
                logger.debug("metrics: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="lmcache-node-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
