"""`lmcache-npu status`: what a running engine's store holds, read from the Prometheus endpoint vLLM already serves.

vLLM's API server exports the plugin's counters and gauges on `/metrics` (`lmcache_npu:*`, see
integration/vllm/stats.py), so an operator needs no new port: this module fetches that text, parses the exposition
format, and per engine (vLLM's `model_name` / `engine` labels) shows the tiers with their capacity and use, the hit
rate overall and per tier, the namespace and eviction policy, the Mooncake traffic, and the host arena's segments
where the engine reports them. It imports neither vLLM nor torch: it runs on any host that can reach the server.
The node cache service (`lmcache-npu node-cache --metrics-port`) serves the same names: the node is the
`engine="node"` series (its tiers, hit rates and leases) and each attached engine's lease its own.
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from .cost_report import cost_lines

logger = logging.getLogger(__name__)

PREFIX = "lmcache_npu:"
DEFAULT_URL = "http://localhost:8000"
# labels that name the store itself, not the engine it belongs to
STORE_INFO_LABELS = ("namespace", "eviction_policy", "tiers")
# labels of a part of one engine's store (the node cache's ranks): their samples are summed into the engine's
PART_LABELS = ("rank",)
NODE_NAMES = ("node_connections", "node_leases", "node_refused_peers")
LEASE_NAMES = ("node_lease_connections", "node_lease_commands", "node_lookup_chunks", "node_lookup_hit_chunks",
               "node_stores", "node_loads")
# the index's tier name -> the hit-chunk counter that names it and what an operator calls it
TIER_NAMES = {"cpu": "host arena", "disk": "local disk", "remote": "Mooncake"}
ARENA_NAMES = ("arena_bytes", "arena_live_bytes", "segments_live", "segments_total")
REMOTE_NAMES = ("mooncake_puts", "mooncake_put_bytes", "mooncake_get_bytes", "mooncake_errors", "mooncake_timeouts")

# the largest value a plugin metric can take: its counters and gauges are int64-sized counts and byte totals
MAX_VALUE = float(2**63)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def _unescape(raw: str) -> str:
    """A label value as the exposition format escapes it (\\\\, \\n, \\"), in one left-to-right pass: "\\\\n" is a
    backslash and an n, not a backslash and a newline."""
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)


_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


@dataclass(frozen=True)
class Sample:
    """One line of the exposition format: metric name, labels, value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, name: str) -> str:
        return dict(self.labels).get(name, "")


def parse_metrics(text: str) -> list[Sample]:
    """Samples of Prometheus' text exposition format (comments and blank lines skipped); a malformed line is an
    error naming its line number."""
    samples = []
    for number, line in enumerate(text.split("\n"), 1):  # the format ends lines with \n only
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"metrics line {number} is not a Prometheus sample: {line[:120]!r}")
        name, labels_text, value_text = match.group(1), match.group(2), match.group(3)
        try:
            value = float(value_text)
        except ValueError:
            raise ValueError(f"metrics line {number}: value {value_text!r} of {name} is not a number") from None
        samples.append(Sample(name, _parse_labels(labels_text[1:-1], number) if labels_text else (), value))
    return samples


def _parse_labels(text: str, number: int) -> tuple[tuple[str, str], ...]:
    labels = []
    position = 0
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            raise ValueError(f"metrics line {number}: labels {text[:120]!r} are malformed at {position}")
        raw = match.group(2)
        labels.append((match.group(1), _unescape(raw)))
        position = match.end()
    return tuple(labels)


def metrics_url(url: str) -> str:
    """`url` with /metrics as path when it names none; only http and https are accepted."""
    parsed = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--url must be an http(s) address of a vLLM server such as {DEFAULT_URL}, got {url!r}")
    path = parsed.path if parsed.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunparse(parsed._replace(path=path))


def fetch_metrics(url: str, timeout_s: float = 5.0) -> str:
    """The metrics text a vLLM server serves; an unreachable server is an error naming the address."""
    address = metrics_url(url)
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:  # noqa: S310 (http(s) only, checked)
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"cannot read {address}: {getattr(exc, 'reason', exc)} (is `vllm serve` running there, "
                              f"with stats on?)") from None


@dataclass
class TierStatus:
    """One tier: capacity and use (chunks, and bytes summed over ranks; None where the engine cannot know, as
    for Mooncake), and the share of looked-up tokens it served."""

    tier: str
    name: str
    capacity_chunks: Optional[int]
    used_chunks: Optional[int]
    capacity_bytes: Optional[int]
    used_bytes: Optional[int]
    hit_chunks: int
    hit_rate: Optional[float]

    @property
    def use(self) -> Optional[float]:
        if not self.capacity_chunks or self.used_chunks is None:
            return None
        return self.used_chunks / self.capacity_chunks


@dataclass
class EngineStatus:
    """One engine's store, as its metrics say."""

    engine: dict[str, str]
    namespace: str = ""
    eviction_policy: str = ""
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    chunk_tokens: int = 0
    chunk_bytes: int = 0
    tiers: list[TierStatus] = field(default_factory=list)
    arena: dict[str, float] = field(default_factory=dict)
    remote: dict[str, float] = field(default_factory=dict)
    node: dict[str, float] = field(default_factory=dict)  # the node cache's own series: connections, leases
    lease: dict[str, float] = field(default_factory=dict)  # an engine's lease at the node cache (no tiers of its own)
    cost: dict[str, float] = field(default_factory=dict)  # the cost model's fit, decisions and calibration (cost_*)

    @property
    def hit_rate(self) -> Optional[float]:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None


def engine_status(samples: Sequence[Sample]) -> list[EngineStatus]:
    """Per engine, what the plugin's metrics say; an endpoint without them is an error that says why."""
    values: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    info: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for sample in samples:
        if not sample.name.startswith(PREFIX):
            continue
        name = sample.name[len(PREFIX):]
        if name.endswith("_created"):
            continue  # prometheus_client's creation timestamps
        if not math.isfinite(sample.value) or abs(sample.value) > MAX_VALUE:
            # the plugin exports counts and sizes only: +Inf, NaN or 1e300 is no reading of its store
            raise ValueError(f"metric {sample.name}{_labels_text(sample.labels)} has value {sample.value!r}: the "
                             f"plugin's metrics are finite counts and sizes (at most 2**63); is this server running "
                             f"a matching lmcache_npu?")
        engine = tuple((k, v) for k, v in sample.labels if k not in STORE_INFO_LABELS and k not in PART_LABELS)
        if name == "store_info":
            if sample.value:
                info[engine] = {k: v for k, v in sample.labels if k in STORE_INFO_LABELS}
            continue
        found = values.setdefault(engine, {})
        # a counter's sample ends in _total; a name that itself ends so (segments_total) is kept under both
        for key in {name, name[:-len("_total")] if name.endswith("_total") else name}:
            found[key] = found.get(key, 0.0) + sample.value
    if not values and not info:
        raise ValueError("the endpoint serves no lmcache_npu metrics: is this vLLM running the plugin "
                         "(--kv-transfer-config with LMCacheNPUConnector) with stats on (not --disable-log-stats)?")
    return [_one_engine(dict(engine), values.get(engine, {}), info.get(engine, {}))
            for engine in sorted(set(values) | set(info))]


def _labels_text(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f"{k}={v!r}" for k, v in labels) + "}" if labels else ""


def _one_engine(engine: dict[str, str], v: dict[str, float], info: dict[str, str]) -> EngineStatus:
    status = EngineStatus(engine=engine, namespace=info.get("namespace", ""),
                          eviction_policy=info.get("eviction_policy", ""), lookups=int(v.get("lookups", 0)),
                          lookup_tokens=int(v.get("lookup_tokens", 0)), hit_tokens=int(v.get("hit_tokens", 0)),
                          chunk_tokens=int(v.get("chunk_tokens", 0)), chunk_bytes=int(v.get("chunk_bytes", 0)))
    if "node_lease_connections" in v and "cpu_capacity_chunks" not in v:  # an engine as the node cache sees it
        status.lease = {n: v[n] for n in LEASE_NAMES if n in v}
        return status
    status.node = {n: v[n] for n in NODE_NAMES if n in v}
    if "lookup_tokens" not in v and "lookup_chunks" in v and status.chunk_tokens:  # the node counts chunks
        status.lookup_tokens = int(v["lookup_chunks"]) * status.chunk_tokens
        status.hit_tokens = int(v.get("lookup_hit_chunks", 0)) * status.chunk_tokens
    present = set(info.get("tiers", "cpu").split(","))
    for tier, name in TIER_NAMES.items():
        hit_chunks = int(v.get(f"hit_chunks_{tier}", 0))
        capacity = v.get(f"{tier}_capacity_chunks")
        if tier == "disk" and not capacity and "disk" not in present:
            continue
        if tier == "remote" and "mooncake" not in present and not hit_chunks:
            continue
        used = v.get(f"{tier}_used_chunks")
        rate = (hit_chunks * status.chunk_tokens / status.lookup_tokens
                if status.lookup_tokens and status.chunk_tokens else None)
        status.tiers.append(TierStatus(
            tier=tier, name=name,
            capacity_chunks=None if capacity is None else int(capacity),
            used_chunks=None if used is None else int(used),
            # int first: chunks x bytes in float could round, or pass 1.8e308 and become inf
            capacity_bytes=None if capacity is None or not status.chunk_bytes else int(capacity) * status.chunk_bytes,
            used_bytes=None if used is None or not status.chunk_bytes else int(used) * status.chunk_bytes,
            hit_chunks=hit_chunks, hit_rate=rate))
    status.arena = {n: v[n] for n in ARENA_NAMES if n in v}
    status.remote = {n: v[n] for n in REMOTE_NAMES if n in v}
    status.cost = {n: value for n, value in v.items() if n.startswith("cost_")}
    return status


def to_json(statuses: Sequence[EngineStatus]) -> str:
    """Machine-readable: every field, with the derived rates."""
    out = []
    for status in statuses:
        entry = asdict(status)
        entry["hit_rate"] = status.hit_rate
        for tier, data in zip(status.tiers, entry["tiers"]):
            data["use"] = tier.use
        out.append(entry)
    return json.dumps({"engines": out}, indent=2, sort_keys=True)


def render(statuses: Sequence[EngineStatus]) -> str:
    """A plain-text report per engine (tiers as a table)."""
    lines: list[str] = []
    for status in statuses:
        who = ", ".join(f"{k}={v}" for k, v in status.engine.items()) or "engine"
        if status.lease:
            lease = status.lease
            looked, hit = lease.get("node_lookup_chunks", 0), lease.get("node_lookup_hit_chunks", 0)
            lines.append(f"{who}  (attached to the node cache: {_count(lease.get('node_lease_connections'))} "
                         f"connection(s), {_count(lease.get('node_lease_commands'))} command(s) in flight)")
            lines.append(f"  looked-up chunks {int(looked)}  hit chunks {int(hit)}  hit rate "
                         f"{_percent(hit / looked if looked else None)}  stored {_count(lease.get('node_stores'))}  "
                         f"loaded {_count(lease.get('node_loads'))}")
            continue
        lines.append(f"{who}")
        lines.append(f"  namespace {status.namespace or '?'}  eviction policy {status.eviction_policy or '?'}  "
                     f"chunks of {status.chunk_tokens or '?'} tokens, {_bytes(status.chunk_bytes)}")
        lines.append(f"  lookups {status.lookups}  looked-up tokens {status.lookup_tokens}  hit tokens "
                     f"{status.hit_tokens}  hit rate {_percent(status.hit_rate)}")
        lines.append(f"  {'tier':<11} {'used':>9} {'capacity':>9} {'use':>7} {'used bytes':>11} {'capacity':>11} "
                     f"{'hit chunks':>10} {'hit rate':>8}")
        for tier in status.tiers:
            lines.append(f"  {tier.name:<11} {_count(tier.used_chunks):>9} {_count(tier.capacity_chunks):>9} "
                         f"{_percent(tier.use):>7} {_bytes(tier.used_bytes):>11} {_bytes(tier.capacity_bytes):>11} "
                         f"{tier.hit_chunks:>10} {_percent(tier.hit_rate):>8}")
        if status.arena:
            live, total = status.arena.get("segments_live"), status.arena.get("segments_total")
            lines.append(f"  arena segments {_count(live)}/{_count(total)} live, "
                         f"{_bytes(status.arena.get('arena_live_bytes'))} of {_bytes(status.arena.get('arena_bytes'))}")
        if status.node:
            lines.append(f"  node cache: {_count(status.node.get('node_leases'))} engine lease(s), "
                         f"{_count(status.node.get('node_connections'))} connection(s), "
                         f"{_count(status.node.get('node_refused_peers'))} refused peer(s)")
        if status.remote:
            lines.append("  Mooncake " + ", ".join(f"{k.removeprefix('mooncake_')} {_number(v)}"
                                                   for k, v in status.remote.items()))
        lines += cost_lines(status.cost)
    return "\n".join(lines)


def _count(value: Optional[float]) -> str:
    return "-" if value is None else str(int(value))


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def _bytes(value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"
