"""Every counter (`store/metrics.Metric`) is named somewhere in docs/, bare or with Prometheus' `_total`: a counter
an operator cannot look up is one nobody watches. UNDOCUMENTED is the backlog found when this check was added; it may
only shrink (a member documented since must leave it). Stricter where an operator looks first: every name an engine
exports is listed (in backticks) in configuration.md §6, every counter of the node cache in deployment.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import pytest

from lmcache_npu.store.metrics import Metric

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# counters undocumented (or documented only under an exported prefix) when this check was added: shrink, never grow
UNDOCUMENTED = frozenset({
    "bounce_ops", "exists_errors", "get_bytes", "io_errors", "late_calls", "lookup_chunks", "lookup_hit_chunks",
    "pending_reads", "put_bytes", "put_failures", "read_bytes", "temp_removed", "timeouts", "write_bytes",
})


def undocumented(names: list[str], docs: Path) -> list[str]:
    """The names no Markdown file under `docs` mentions as a word (`name` or `name_total`)."""
    text = "\n".join(path.read_text() for path in sorted(docs.rglob("*.md")))
    return [name for name in names if not re.search(rf"\b{re.escape(name)}(_total)?\b", text)]


def test_every_counter_is_named_in_the_docs() -> None:
    missing = sorted(set(undocumented([m.value for m in Metric], DOCS)) - UNDOCUMENTED)
    assert not missing, f"Metric values named nowhere in docs/ (document them, e.g. in configuration.md): {missing}"


def test_the_backlog_only_shrinks() -> None:
    documented_since = sorted(UNDOCUMENTED - set(undocumented(sorted(UNDOCUMENTED), DOCS)))
    assert not documented_since, f"documented now, remove from UNDOCUMENTED: {documented_since}"


def test_negative_control_a_counter_the_docs_never_name_is_found() -> None:
    assert undocumented(["node_cache_fake_counter_nobody_wrote", "expired_commands"], DOCS) == [
        "node_cache_fake_counter_nobody_wrote"]


def unlisted(names: Iterable[str], text: str, prefixes: Iterable[str] = ("",)) -> list[str]:
    """The names `text` never writes out in backticks, as a name or a Prometheus counter (`<name>_total`), each
    perhaps after one of `prefixes`."""
    return sorted({str(name) for name in names
                   if not any(f"`{prefix}{name}{suffix}`" in text for prefix in prefixes for suffix in ("", "_total"))})


def test_every_metric_an_engine_exports_is_listed_in_the_statistics_section() -> None:
    """stats.METRICS (counters and the arena's levels), GAUGES and store_info, in configuration.md §6."""
    pytest.importorskip("vllm", reason="the connector's stats import vLLM")
    from lmcache_npu.integration.vllm.stats import GAUGES, METRICS, STORE_INFO

    doc = (DOCS / "configuration.md").read_text()
    statistics = doc[doc.index("## 6. Statistics"):doc.index("## `lmcache-npu doctor`")]
    assert unlisted([*METRICS, *GAUGES, STORE_INFO], statistics) == []


def test_every_counter_of_the_node_cache_is_listed_in_the_deployment_guide() -> None:
    """Every Metric the node cache's modules count (the service's pools, its client, the workers' mappings), as the
    service's `/metrics` or an engine's exports name it (`node_<name>_total` per engine)."""
    names = {match for path in sorted((ROOT / "lmcache_npu" / "node").glob("*.py"))
             for match in re.findall(r"Metric\.([A-Z_]+)", path.read_text())}
    assert {"EXPIRED_COMMANDS", "NODE_CACHE_REFUSED_COMMANDS", "LEASES_ENDED"} <= names  # the scan sees them
    assert unlisted([Metric[name] for name in names], (DOCS / "deployment.md").read_text(),
                    prefixes=("", "node_")) == []


def test_negative_control_an_unlisted_metric_is_named() -> None:
    text = "the counters `lookups_total`, `node_stores_total` and the gauge `arena_bytes`"
    assert unlisted(["lookups", "stores", "arena_bytes", "expired_commands"], text, prefixes=("", "node_")) == [
        "expired_commands"]
    assert unlisted(["stores"], text) == ["stores"]  # `node_stores_total` only where the prefix is allowed
