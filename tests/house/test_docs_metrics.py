"""Every counter (`store/metrics.Metric`) is named somewhere in docs/, bare or with Prometheus' `_total`: a counter
an operator cannot look up is one nobody watches. UNDOCUMENTED is the backlog found when this check was added; it may
only shrink (a member documented since must leave it)."""

from __future__ import annotations

import re
from pathlib import Path

from lmcache_npu.store.metrics import Metric

DOCS = Path(__file__).resolve().parents[2] / "docs"
# counters undocumented (or documented only under an exported prefix) when this check was added: shrink, never grow
UNDOCUMENTED = frozenset({
    "bounce_ops", "drop_failed", "exists_errors", "get_bytes", "hit_chunks_disk", "hit_chunks_remote", "io_errors",
    "late_calls", "listener_errors", "load_failed", "loaded_bytes", "lookup_chunks", "lookup_hit_chunks",
    "lookups_pending", "pending_reads", "promote_failed", "put_bytes", "put_failed", "put_failures", "read_bytes",
    "spill_failed", "store_failed", "stored_bytes", "temp_removed", "timeouts", "unexpected_completions",
    "write_bytes",
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
