"""Counter names come from one place (`store/metrics.Metric`): no runtime module adds to a counter by a string
literal or an f-string, where a typo would silently make a new counter; and every name vLLM's stats export from a
counter is a member."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lmcache_npu.store.metrics import Metric

ROOT = Path(__file__).resolve().parents[2] / "lmcache_npu"


def spelled_counters(package_root: Path) -> list[str]:
    """`<...counters>.add(...)` / `found.add(...)` calls whose name is a string literal or an f-string."""
    found = []
    for path in sorted(package_root.rglob("*.py")):
        if "tools" in path.relative_to(package_root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add"
                    and node.args):
                continue
            receiver = ast.unparse(node.func.value)
            if not (receiver.endswith("counters") or receiver == "found"):
                continue
            if isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                found.append(f"{path.relative_to(package_root)}:{node.lineno} {ast.unparse(node.args[0])}")
    return found


def test_no_counter_is_named_by_a_string() -> None:
    assert spelled_counters(ROOT) == []


def test_negative_control_a_spelled_counter_is_found(tmp_path: Path) -> None:
    (tmp_path / "lmcache_npu").mkdir()
    (tmp_path / "lmcache_npu" / "mover.py").write_text(
        'def f(self, kind):\n    self.counters.add(f"{kind}_chunks")\n    self.counters.add("stores", 2)\n'
        '    self.counters.add(Metric.STORES)\n')
    assert spelled_counters(tmp_path / "lmcache_npu") == ['mover.py:2 f\'{kind}_chunks\'', "mover.py:3 'stores'"]


def test_every_exported_counter_is_a_metric() -> None:
    pytest.importorskip("vllm", reason="the connector's stats import vLLM")
    from lmcache_npu.integration.vllm import stats

    renamed = [stats.INDEX_METRICS, stats.DISK_METRICS, stats.REMOTE_METRICS]  # exported name -> (own name, help)
    for name in stats.METRICS:
        if not any(name in table for table in renamed):
            assert isinstance(name, Metric), name
    for table in renamed:
        for own, _ in table.values():
            assert isinstance(own, Metric), own
