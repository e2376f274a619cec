"""The Python floor pyproject.toml declares is one the runtime can import on: a feature of a newer Python used by
`lmcache_npu` (without `tools/`) raises the floor. Negative control: the check finds StrEnum under a 3.10 floor."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# names a module may import only from this Python on: (module, name) -> (major, minor)
NEWER_NAMES = {("enum", "StrEnum"): (3, 11), ("typing", "Self"): (3, 11), ("typing", "LiteralString"): (3, 11),
               ("tomllib", None): (3, 11), ("typing", "override"): (3, 12)}


def declared_floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert found, f"requires-python {spec!r} is not of the form '>=X.Y'"
    return int(found[1]), int(found[2])


def needs(source: str) -> list[tuple[str, tuple[int, int]]]:
    """What in `source` needs a newer Python: (what, from which version)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                version = NEWER_NAMES.get((node.module, alias.name))
                if version:
                    found.append((f"{node.module}.{alias.name}", version))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                version = NEWER_NAMES.get((alias.name, None))
                if version:
                    found.append((alias.name, version))
    return found


def too_new(floor: tuple[int, int], files: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {what} needs {version[0]}.{version[1]}"
            for path in files for what, version in needs(path.read_text()) if version > floor]


def test_the_runtime_imports_nothing_newer_than_the_declared_floor() -> None:
    runtime = [p for p in (ROOT / "lmcache_npu").rglob("*.py") if "tools" not in p.relative_to(ROOT).parts]
    assert too_new(declared_floor(), runtime) == []


def test_negative_control_strenum_under_a_3_10_floor_is_found() -> None:
    metrics = ROOT / "lmcache_npu" / "store" / "metrics.py"
    assert any("enum.StrEnum needs 3.11" in line for line in too_new((3, 10), [metrics]))
