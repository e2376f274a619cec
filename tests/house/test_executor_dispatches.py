"""`StoreExecutor` only dispatches (issue 42 item 4): it holds no tier-specific code. Its module imports neither a
tier (`store/disk`, `store/mooncake`) nor a route handler's module, and names no command kind or tier: those live in
the handlers (`store/routes/`), which `routes/build.py` wires up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lmcache_npu"
EXECUTOR = ROOT / "store" / "executor.py"
# modules whose code is one tier's or one route's
TIER_MODULES = ("lmcache_npu.store.disk", "lmcache_npu.store.mooncake", "lmcache_npu.store.routes.device",
                "lmcache_npu.store.routes.disk", "lmcache_npu.store.routes.remote", "lmcache_npu.store.routes.drop",
                "lmcache_npu.store.routes.build")
# names of one kind of command or one tier: code that branches on them belongs to a handler
TIER_NAMES = frozenset({"Store", "Load", "Spill", "Persist", "Promote", "Put", "Drop", "Tier", "Medium", "DiskTier",
                        "MooncakeTier", "DeviceMover", "DeviceRoute", "DiskRoute", "RemoteRoute", "DropRoute"})


def tier_code(path: Path, package: str = "lmcache_npu.store") -> list[str]:
    """Where the module at `path` (a module of `package`) imports a tier's module or names a tier or command kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
            found += [f"{node.lineno}: imports {t}" for t in targets if t.startswith(TIER_MODULES)][:1]
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in TIER_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name.startswith(TIER_MODULES)]
        elif isinstance(node, ast.Name) and node.id in TIER_NAMES:
            found.append(f"{node.lineno}: names {node.id}")
    return found


def test_the_executor_holds_no_tier_specific_code() -> None:
    assert tier_code(EXECUTOR) == []


def test_negative_control_tier_code_is_found(tmp_path: Path) -> None:
    module = tmp_path / "executor.py"
    module.write_text("from .disk.tier import DiskTier\n"
                      "from .routes import remote\n"
                      "import lmcache_npu.store.mooncake\n"
                      "from .commands import Route, SlotMove\n"
                      "def run(command):\n"
                      "    if isinstance(command, Spill):\n"
                      "        return SlotMove\n")
    assert tier_code(module) == ["1: imports lmcache_npu.store.disk.tier", "1: imports DiskTier",
                                 "2: imports lmcache_npu.store.routes.remote", "3: imports lmcache_npu.store.mooncake",
                                 "6: names Spill"]
    module.write_text("from .commands import Route, SlotMove\nfrom .routes.context import RouteHandler\n")
    assert tier_code(module) == []  # the control: the route types and the handler protocol are the dispatcher's
