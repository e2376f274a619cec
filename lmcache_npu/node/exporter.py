"""The node cache's Prometheus endpoint: its pools' occupancy and counters, and per engine its leases and hits, in
the exposition format under the names engines use (`lmcache_npu:*`), so `lmcache-npu status --url` reads it too.
The node itself is the `engine="node"` series; an attached engine's own series carry its name. Every family has one
`# TYPE` line naming it exactly as its samples are named (counters end in `_total`), its samples together.

The values are read under the service's lock (`snapshot`: plain reads) and formatted after it is released
(`render`); `/healthz`, `/readyz` and `/version` never take the lock, so a probe does not wait behind a slow verb.
A pool's `namespace` label names the weights it serves: on a metrics address beyond loopback it is a pseudonym
keyed by a secret of the process (`namespace_labeller`), so a scrape cannot confirm which model a node serves.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Mapping

from ..store.commands import Tier
from ..store.metrics import Metric

logger = logging.getLogger(__name__)

# per-engine series: what an engine's own calls did to the node's index
ENGINE_METRICS = (Metric.LOOKUP_HIT_CHUNKS, Metric.LOOKUP_CHUNKS, Metric.STORES, Metric.LOADS)
Sample = tuple[str, dict[str, str], float]  # (name without the lmcache_npu: prefix, labels, value)
Route = Callable[[], tuple[int, str, str]]  # a path's answer: (HTTP status, content type, body)
GAUGES_NAMED_TOTAL = frozenset({"segments_total"})  # a count of segments (the engines' name for it), not a counter


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{_label(str(item))}"' for key, item in labels.items())
    number = int(value) if float(value).is_integer() else float(value)  # byte counts print whole, never 1.04e+06
    return f"lmcache_npu:{name}{{{text}}} {number}"


def loopback(host: str) -> bool:
    """Whether a metrics address is reachable from this host only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve beyond this host
        return False


def namespace_labeller(host: str) -> Callable[[str], str]:
    """The `namespace` label of a pool for a metrics endpoint on `host`: the namespace itself on loopback, else
    `pool-` and 12 hex digits of a keyed BLAKE2b (stable while the process lives, unlinkable to the weights)."""
    if loopback(host):
        return lambda namespace: namespace
    key = secrets.token_bytes(32)
    return lambda namespace: "pool-" + hashlib.blake2b(namespace.encode(), key=key, digest_size=6).hexdigest()


def _samples(service: Any) -> Iterator[Sample]:
    label_of: Callable[[str], str] = service.namespace_label
    yield ("node_connections", {"engine": "node"}, service.connections)
    yield ("node_refused_peers_total", {"engine": "node"}, service.refused_peers)
    yield ("node_refused_connections_total", {"engine": "node"}, service.refused_crowd)
    yield ("node_pools_reclaimed_total", {"engine": "node"}, service.pools_reclaimed)
    for pool in service.pools.values():
        node = {"engine": "node", "namespace": label_of(pool.geometry.namespace)}
        use = pool.index.occupancy()
        yield ("cpu_used_chunks", node, use[Tier.ARENA][0])
        yield ("cpu_capacity_chunks", node, use[Tier.ARENA][1])
        yield ("disk_used_chunks", node, use[Tier.DISK][0])
        yield ("disk_capacity_chunks", node, use[Tier.DISK][1])
        yield ("chunk_bytes", node, pool.geometry.object_bytes * pool.geometry.world)
        yield ("chunk_tokens", node, pool.geometry.chunk_tokens)
        yield ("node_leases", node, len(pool.leases))
        tiers = "cpu" + (",disk" if pool.index.disk_chunks else "") + (",mooncake" if pool.store.mooncake else "")
        yield ("store_info", {**node, "eviction_policy": pool.index.eviction_policy, "tiers": tiers}, 1)
        for metric in (Metric.LOOKUPS, Metric.HIT_CHUNKS_CPU, Metric.HIT_CHUNKS_DISK, Metric.HIT_CHUNKS_REMOTE):
            yield (f"{metric.value}_total", node, pool.lookup_counters[metric])
        arena_bytes = sum(arena.memory.span_bytes for arena in pool.arenas)
        yield ("arena_bytes", node, arena_bytes)
        yield ("arena_live_bytes", node, sum(arena.memory.live_bytes for arena in pool.arenas))
        yield ("segments_total", node, sum(len(arena.memory.segments) for arena in pool.arenas))
        yield ("segments_live", node, sum(arena.memory.segments_live for arena in pool.arenas))
        for name, value in sorted(pool.index.counters.snapshot().items()):
            yield (f"{name}_total", node, value)
        for executor in pool.executors:
            for prefix, tier in (("disk", executor.disk), ("mooncake", executor.remote)):
                if tier is None or (prefix == "mooncake" and executor.rank):  # one Mooncake client per pool
                    continue
                for name, value in sorted(tier.counters.snapshot().items()):
                    yield (f"{prefix}_{name}_total", {**node, "rank": str(executor.rank)}, value)
        for lease in pool.leases.values():
            labels = {"engine": lease.engine, "namespace": label_of(pool.geometry.namespace)}
            yield ("node_lease_connections", labels, len(lease.connections))
            yield ("node_lease_commands", labels, len(lease.commands))
            for metric in ENGINE_METRICS:
                yield (f"node_{metric.value}_total", labels, lease.totals.get(metric.value, 0))


def snapshot(service: Any) -> list[Sample]:
    """The endpoint's values (under the service's lock: reads only, the text is made by `render` after it)."""
    return list(_samples(service))


def render(samples: list[Sample]) -> str:
    """The exposition text of `samples`: per family its `# TYPE` line (a counter when its name ends in `_total`,
    but for GAUGES_NAMED_TOTAL, else a gauge), then all of its samples, families in the order they first appear."""
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        families.setdefault(name, []).append((labels, value))
    lines = []
    for name, members in families.items():
        counter = name.endswith("_total") and name not in GAUGES_NAMED_TOTAL
        lines.append(f"# TYPE lmcache_npu:{name} {'counter' if counter else 'gauge'}")
        lines.extend(_sample(name, labels, value) for labels, value in members)
    return "\n".join(lines) + "\n"


def exposition(service: Any) -> str:
    """The whole endpoint's text, read under the service's lock and formatted outside it."""
    with service.lock:
        samples = snapshot(service)
    return render(samples)


class MetricsServer:
    """`GET /metrics` on (host, port), and the paths of `routes` (`/healthz` ...); port 0 picks a free one
    (`address` says which)."""

    def __init__(self, host: str, port: int, render: Callable[[], str], routes: Mapping[str, Route] = {}) -> None:
        answers: dict[str, Route] = {"/metrics": lambda: (200, "text/plain; version=0.0.4", render()), **routes}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                answer = answers.get(self.path.split("?")[0])
                if answer is None:
                    self.send_error(404, f"served here: {', '.join(sorted(answers))}")
                    return
                status, content_type, text = answer()
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
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
