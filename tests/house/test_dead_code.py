"""No dead code at module level (issue 42): every function, class and constant a module of lmcache_npu defines at its
top level is named somewhere besides its definition (in the package, its tests, the build checks or setup.py), so a
reader never studies code nothing runs. Methods are left out: vLLM calls the connector's hooks by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALWAYS_USED = ("__all__", "logger")  # read by Python and logging themselves


def top_level_names(tree: ast.Module) -> list[tuple[str, int]]:
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append((node.name, node.lineno))
        elif isinstance(node, ast.Assign):
            names += [(target.id, node.lineno) for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append((node.target.id, node.lineno))
    return [(name, line) for name, line in names if name not in ALWAYS_USED]


def unused_names(package_root: Path, readers: list[Path]) -> list[str]:
    """Top-level names of `package_root`'s modules that occur only once in `readers` (their definition)."""
    text = "\n".join(path.read_text() for path in readers)
    counts: dict[str, int] = {}
    for word in re.findall(r"\b\w+\b", text):
        counts[word] = counts.get(word, 0) + 1
    found = []
    for path in sorted(package_root.rglob("*.py")):
        for name, line in top_level_names(ast.parse(path.read_text(), str(path))):
            if counts.get(name, 0) <= 1:
                found.append(f"{path.relative_to(package_root.parent)}:{line} {name}")
    return found


def python_files(*roots: Path) -> list[Path]:
    return [path for root in roots for path in ([root] if root.is_file() else sorted(root.rglob("*.py")))]


def test_every_top_level_name_is_used() -> None:
    readers = python_files(REPO / "lmcache_npu", REPO / "tests", REPO / "build_checks", REPO / "setup.py")
    assert unused_names(REPO / "lmcache_npu", readers) == []


def test_negative_control_an_unused_function_and_constant_are_found(tmp_path: Path) -> None:
    package = tmp_path / "lmcache_npu"
    package.mkdir()
    (package / "host.py").write_text("import logging\nlogger = logging.getLogger(__name__)\nLOCAL_TIERS = (1, 2)\n"
                                     "def chain_for_host():\n    return used()\ndef used():\n    return 1\n")
    (package / "mover.py").write_text("class Mover:\n    def hook(self):\n        pass\n")
    (tmp_path / "test_mover.py").write_text("from lmcache_npu.mover import Mover\n")
    readers = python_files(package, tmp_path / "test_mover.py")
    assert unused_names(package, readers) == ["lmcache_npu/host.py:3 LOCAL_TIERS",
                                              "lmcache_npu/host.py:4 chain_for_host"]
