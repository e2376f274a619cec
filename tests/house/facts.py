"""Facts about the house a script can read from the code, for the before/after table of the house issue:
`python -m tests.house.facts PACKAGE_DIR` prints them (any checkout of lmcache_npu, old layouts included).

- import cycles: strongly connected groups of modules (imports at any depth, function-local ones included), and of
  subpackages (the first level under the package: ops, store, layout, ...);
- upward imports: arrows the layer table of test_layers.py refuses (only for trees it describes, else "n/a");
- tooling inside the runtime: lines of tool modules (CLI, doctor, status, benches, replay, presets, the local
  Mooncake master) outside `tools/`;
- the largest runtime modules and how many are over 600 lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .layers import arrows, violations

TOOL_NAMES = ("cli", "doctor", "status", "selftest", "bench", "servebench", "replay", "presets", "mooncake_local")


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more nodes that reach each other (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def facts(package_root: Path) -> dict[str, object]:
    package = package_root.name
    modules = {}
    for path in sorted(package_root.rglob("*.py")):
        parts = path.relative_to(package_root).with_suffix("").parts
        name = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
        modules[name] = len(path.read_text().splitlines())
    found = arrows(package_root)
    module_graph: dict[str, set[str]] = {name: set() for name in modules}
    package_graph: dict[str, set[str]] = {}

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    for arrow in found:
        target = arrow.target if arrow.target in modules else arrow.target.rpartition(".")[0]
        if target in modules and target != arrow.source:
            module_graph[arrow.source].add(target)
        a, b = top(arrow.source), top(arrow.target)
        package_graph.setdefault(a, set())
        if a != b:
            package_graph[a].add(b)

    def is_tool(name: str) -> bool:
        parts = name.split(".")[1:]
        return bool(parts) and (parts[0] == "tools" or any(part in TOOL_NAMES for part in parts))

    runtime = {name: lines for name, lines in modules.items() if not is_tool(name)}
    tooling_inside = sum(lines for name, lines in modules.items() if is_tool(name) and ".tools" not in name)
    try:
        from .test_layers import BELOW, PREFIXES
        upward: object = len(violations(package_root, PREFIXES, BELOW))
    except KeyError:  # a module the table does not place: an older layout
        upward = "n/a (layout predates the table)"
    largest = sorted(runtime.items(), key=lambda item: -item[1])
    runtime_to_tools = sum(1 for a in found if not is_tool(a.source) and is_tool(a.target)
                           and a.target.split(".")[1] == "tools")
    return {
        "modules": len(modules),
        "module cycles": strongly_connected(module_graph),
        "subpackage cycles": strongly_connected(package_graph),
        "upward imports (layer table)": upward,
        "runtime -> tools imports": runtime_to_tools,
        "tool lines inside the runtime": tooling_inside,
        "runtime lines": sum(runtime.values()),
        "runtime modules over 600 lines": [f"{name} ({lines})" for name, lines in largest if lines > 600],
        "largest runtime modules": [f"{name} ({lines})" for name, lines in largest[:5]],
    }


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "lmcache_npu"
    for name, value in facts(root.resolve()).items():
        print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
