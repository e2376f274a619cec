"""The house's measurable promises (issue 32): no import cycles between modules or between subpackages, no runtime
module over 600 lines, nothing of the runtime importing the tools; and the cycle finder itself can see a cycle."""

from __future__ import annotations

from pathlib import Path

from .facts import facts, strongly_connected

ROOT = Path(__file__).resolve().parents[2] / "lmcache_npu"


def test_the_house_keeps_its_promises() -> None:
    found = facts(ROOT)
    assert found["module cycles"] == []
    assert found["subpackage cycles"] == []
    assert found["upward imports (layer table)"] == 0
    assert found["runtime -> tools imports"] == 0
    assert found["tool lines inside the runtime"] == 0
    assert found["runtime modules over 600 lines"] == []


def test_negative_control_a_cycle_is_found() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_negative_control_a_cycle_between_subpackages_is_found(tmp_path: Path) -> None:
    package = tmp_path / "lmcache_npu"
    for module, text in (("ops/backend.py", "def f():\n    from ..store import arena\n"),
                         ("store/arena.py", "from ..ops import backend\n")):
        path = package / module
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    (package / "__init__.py").touch()
    found = facts(package)
    assert found["subpackage cycles"] == [["lmcache_npu.ops", "lmcache_npu.store"]]
    assert found["module cycles"] == [["lmcache_npu.ops.backend", "lmcache_npu.store.arena"]]
