"""A module's docstring says what the module is and why in a few lines and points to docs/ for the proofs (issue 42):
no runtime module opens with more than `MAX_LINES` lines, where a proof would start to be kept twice."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lmcache_npu"
MAX_LINES = 24  # the longest today (node/client.py) is 22; a ceiling to lower, never to raise
# modules another change of issue 42 owns (file -> what moves): the rule applies once that change lands
def long_docstrings(package_root: Path, max_lines: int, skipped: tuple[str, ...] = ()) -> list[str]:
    """Runtime modules (the tools aside) whose module docstring is longer than `max_lines` lines."""
    found = []
    for path in sorted(package_root.rglob("*.py")):
        where = path.relative_to(package_root).as_posix()
        if where.split("/")[0] == "tools" or where in skipped:
            continue
        text = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
        if text is not None and len(text.splitlines()) > max_lines:
            found.append(f"{where}: {len(text.splitlines())} lines")
    return found


def test_module_docstrings_are_short() -> None:
    assert long_docstrings(ROOT, MAX_LINES) == []


def test_negative_control_a_long_docstring_is_found(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "tools").mkdir()
    proof = '"""' + "\n".join(f"step {i}" for i in range(MAX_LINES + 1)) + '"""\n'
    (tmp_path / "store" / "fence.py").write_text(proof)
    (tmp_path / "tools" / "bench.py").write_text(proof)  # a tool's docstring is its --help: not held to this
    (tmp_path / "store" / "short.py").write_text('"""What and why.\n\nProofs: docs/architecture.md."""\n')
    assert long_docstrings(tmp_path, MAX_LINES) == [f"store/fence.py: {MAX_LINES + 1} lines"]
