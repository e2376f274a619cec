"""One scope per size key (issue 42 item 2): `cpu_bytes` and `disk_bytes` in a `StoreConfig` are an engine's per-rank
keys; the node cache's sizes live in `NodeCapacity`, and only `node/capacity.py` makes a per-rank configuration from
them (a `replace(..., cpu_bytes=...)` anywhere else would give the key a second scope). Slots are counted from bytes
by `slots_for_capacity` alone (`store/arena.py`). Negative control: the scan finds both kinds in a fake source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_npu"
SIZE_KEYS = {"cpu_bytes", "disk_bytes"}
REWRITE_HOME = PACKAGE / "node" / "capacity.py"
SLOTS_HOME = PACKAGE / "store" / "arena.py"


def rewrites(source: str) -> list[int]:
    """Lines of `replace(x, cpu_bytes=...)` / `dataclasses.replace(x, disk_bytes=...)` calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "replace" and any(k.arg in SIZE_KEYS for k in node.keywords):
                found.append(node.lineno)
    return found


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
            if isinstance(n, (ast.Attribute, ast.Name))}


def slot_counts(source: str) -> list[int]:
    """Lines dividing a `cpu_bytes` by a slot's size (however spelled out): a slot count made outside
    `slots_for_capacity`."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)
            and any(n.endswith("cpu_bytes") for n in _names(node.left)) and any("slot" in n for n in _names(node.right))]


def test_only_the_node_capacity_module_rewrites_a_size_key():
    found = {str(p.relative_to(ROOT)): lines for p in PACKAGE.rglob("*.py") if p != REWRITE_HOME
             for lines in [rewrites(p.read_text())] if lines}
    assert not found, f"per-rank sizes rewritten outside node/capacity.py: {found}"
    assert rewrites(REWRITE_HOME.read_text())  # the home does it (the scan sees real code)


def test_slots_are_counted_from_bytes_in_one_place():
    found = {str(p.relative_to(ROOT)): lines for p in PACKAGE.rglob("*.py") if p != SLOTS_HOME
             for lines in [slot_counts(p.read_text())] if lines}
    assert not found, f"slots counted outside slots_for_capacity: {found}"


def test_negative_control_the_scans_find_a_rewrite_and_a_slot_count():
    fake = ("import dataclasses\n"
            "x = dataclasses.replace(store, cpu_bytes=store.cpu_bytes // 2)\n"
            "y = replace(store, disk_bytes=0)\n"
            "n = store.cpu_bytes // slot_bytes\n"
            "m = store.cpu_bytes // (world * slot_bytes_for(b))\n")
    assert rewrites(fake) == [2, 3]
    assert slot_counts(fake) == [4, 5]
    assert rewrites("z = replace(store, pinned=False)\n") == [] and slot_counts("k = a // b\n") == []
