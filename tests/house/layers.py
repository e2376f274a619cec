"""The import graph of a package, read from its source (every import, function-local ones too), checked against
a table of layers: a module may import its own layer and the layers its layer names below it, nothing else."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class Arrow:
    source: str  # module path, dotted
    line: int
    target: str  # the imported module (or name) path, dotted

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_name(package_root: Path, path: Path) -> str:
    parts = path.relative_to(package_root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_arrows(package_root: Path) -> list[Arrow]:
    """Every import inside `package_root`, of any module (this package's, the standard library's, vLLM's).
    `from X import name` is an arrow to the module `X.name` where that is one of the package's modules (a native one
    included), else to `X`."""
    package = package_root.name
    paths = sorted(package_root.rglob("*.py"))
    modules = {module_name(package_root, path) for path in paths}
    modules |= {f"{package}.{so.name.split('.')[0]}" for so in package_root.glob("_*.so")}
    found: list[Arrow] = []
    for path in paths:
        module = module_name(package_root, path)
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules or not node.module
                           or origin == package else origin for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            found += [Arrow(module, node.lineno, t) for t in dict.fromkeys(targets)]
    return found


def arrows(package_root: Path) -> list[Arrow]:
    """Every import inside `package_root` of a module of the same package."""
    package = package_root.name
    return [a for a in all_arrows(package_root) if a.target == package or a.target.startswith(package + ".")]


def layer_of(module: str, prefixes: Mapping[str, str]) -> str:
    """The layer of a module: that of the longest prefix naming it (`pkg.store.index` before `pkg.store`)."""
    matches = [prefix for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise KeyError(f"{module} is in no layer; add it to the table")
    return prefixes[max(matches, key=len)]


def violations(package_root: Path, prefixes: Mapping[str, str], below: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Arrows that leave their layer for one that is not `below` it. `prefixes`: dotted module prefix -> layer."""
    bad = []
    for arrow in arrows(package_root):
        source, target = layer_of(arrow.source, prefixes), layer_of(arrow.target, prefixes)
        if source != target and target not in below[source]:
            allowed = ", ".join(below[source]) or "nothing"
            bad.append(f"{arrow} (layer {source} -> {target}; {source} may import {allowed})")
    return bad
