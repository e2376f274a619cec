"""Counter names come from one place (`store/metrics.Metric`): no runtime module adds to a counter by a string
literal or an f-string, where a typo would silently make a new counter; no runtime module spells a counter's name
again as a string (one spelling per counter); and every name vLLM's stats export from a counter is a member."""

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


# string literals that equal a Metric value but name something else (file, literal -> what it names)
NOT_COUNTERS = {("config.py", "load_retries"): "the config key", ("node/messages.py", "unnamed"): "a weights naming",
                ("store/mooncake.py", "unavailable"): "a fetch's problem, answered as Failure.UNAVAILABLE"}
# modules another change of issue 42 owns: their second spellings are listed in its closing note
OWNED_ELSEWHERE = ("integration/vllm/stats.py", "node/exporter.py")


def metric_literals(package_root: Path, values: set[str]) -> list[str]:
    """String literals in the runtime (tools, docstrings and enum members' own values aside) that spell a counter's
    name again instead of naming its `Metric` member."""
    found = []
    for path in sorted(package_root.rglob("*.py")):
        where = path.relative_to(package_root).as_posix()
        if "tools" in path.relative_to(package_root).parts or where in ("store/metrics.py", *OWNED_ELSEWHERE):
            continue
        tree = ast.parse(path.read_text(), str(path))
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                skipped.add(id(node.value))  # a docstring
            if isinstance(node, ast.ClassDef):  # an enum's member values: `CORRUPT = "corrupt"` in `Failure`
                skipped.update(id(item.value) for item in node.body if isinstance(item, ast.Assign))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in values
                    and id(node) not in skipped and (where, node.value) not in NOT_COUNTERS):
                found.append((where, node.lineno, node.value))
    return [f"{where}:{line} {value!r}" for where, line, value in sorted(found)]


def test_no_counter_name_is_spelled_twice() -> None:
    assert metric_literals(ROOT, {m.value for m in Metric}) == []


def test_negative_control_a_second_spelling_is_found(tmp_path: Path) -> None:
    (tmp_path / "lmcache_npu" / "store").mkdir(parents=True)
    (tmp_path / "lmcache_npu" / "store" / "scan.py").write_text(
        '"""Counts "corrupt" files."""\nfrom enum import Enum\nclass Failure(str, Enum):\n    CORRUPT = "corrupt"\n'
        'def f(summary):\n    return summary.get("corrupt", 0), summary.get(Metric.CORRUPT, 0)\n'
        'REFUSALS = {Failure.CORRUPT: "corrupt_refused"}\n')
    assert metric_literals(tmp_path / "lmcache_npu", {"corrupt", "corrupt_refused"}) == [
        "store/scan.py:6 'corrupt'", "store/scan.py:7 'corrupt_refused'"]
