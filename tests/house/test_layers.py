"""The package's layers only go down (docs/architecture.md §1): each module imports its own layer and the layers
listed below it, and the tools (CLI, doctor, status, benches, replay, presets, the local Mooncake master) sit on top
where nothing of the runtime imports them. The scheduler's side of the store imports nothing of the workers' side."""

from __future__ import annotations

from pathlib import Path

import pytest

from .layers import Arrow, all_arrows, arrows, layer_of, violations

ROOT = Path(__file__).resolve().parents[2] / "lmcache_npu"

NATIVE = ("native", "checks")
PLATFORM = ("platform", *NATIVE)
OPS = ("ops", *PLATFORM)
STORE_SCHEDULER = ("store.scheduler", *OPS)
STORE = ("store", *STORE_SCHEDULER)
LAYOUT = ("layout", *OPS)
RUNTIME = ("config", "integration", "transfer", "identity", "node", *STORE, "layout")

# a layer's modules (dotted prefixes under lmcache_npu; the longest prefix names a module's layer) and what it may
# import besides itself
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "checks": (("checks",), ()),
    "native": (("_emu", "_host", "_npu", "_cuda"), ("checks",)),
    "root": (("",), ("ops", "checks")),
    "platform": (("platform",), NATIVE),
    "ops": (("ops",), PLATFORM),
    "layout": (("layout",), OPS),
    "store.scheduler": (("store.index", "store.keys", "store.commands", "store.policies", "store.tier", "store.metrics",
                         "store.config", "store.cost"), OPS),
    "store": (("store",), STORE_SCHEDULER),
    "transfer": (("transfer",), (*STORE, "layout")),
    "node": (("node",), (*STORE, "transfer")),  # a pool builds its ranks' executors as a worker does
    "config": (("config",), (*STORE, "layout")),
    "integration": (("integration",), RUNTIME),
    "identity": (("identity",), OPS),
    "tools": (("tools",), ("root", *RUNTIME)),
}


PREFIXES = {(f"lmcache_npu.{prefix}" if prefix else "lmcache_npu"): layer
            for layer, (module_prefixes, _) in LAYERS.items() for prefix in module_prefixes}
BELOW = {layer: below for layer, (_, below) in LAYERS.items()}


def test_every_import_goes_down() -> None:
    assert violations(ROOT, PREFIXES, BELOW) == []


def test_the_check_sees_imports_at_any_depth() -> None:
    found = arrows(ROOT)
    assert len(found) > 200  # a reader that saw nothing would pass the test above
    local = [a for a in found if a.source == "lmcache_npu.ops.backend" and a.target.startswith("lmcache_npu.ops.")]
    assert any(a.target == "lmcache_npu.ops.emu_backend" for a in local)  # a function-local import


@pytest.mark.parametrize("source, text, expected", [
    ("store/index.py", "from .disk import HEADER_BYTES\n", "lmcache_npu.store.disk"),
    ("ops/backend.py", "def f():\n    from ..store import segments\n", "lmcache_npu.store.segments"),
    ("store/keys.py", "from ..ops import TransferPlan\n", None),  # downward: allowed
    ("platform/numa.py", "import lmcache_npu.ops.plan\n", "lmcache_npu.ops.plan"),
    ("transfer/mover.py", "from ..tools.replay import runner\n", "lmcache_npu.tools.replay.runner"),
    ("checks.py", "from .store import keys\n", "lmcache_npu.store.keys"),  # the lowest layer imports nothing
])
def test_negative_control_an_upward_import_is_found(tmp_path: Path, source: str, text: str,
                                                     expected: str | None) -> None:
    package = tmp_path / "lmcache_npu"
    for module in ("store/index.py", "store/keys.py", "store/disk/__init__.py", "store/segments.py", "ops/backend.py",
                   "ops/plan.py", "platform/numa.py", "transfer/mover.py", "tools/replay/runner.py"):
        path = package / module
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        path.touch()
    (package / source).write_text(text)
    found = violations(package, PREFIXES, BELOW)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and f"imports {expected} (layer" in found[0], found


def vllm_imports(package_root: Path) -> list[str]:
    """Imports of vLLM or vllm-ascend outside the connector and the tools, at any depth."""
    return [str(a) for a in all_arrows(package_root) if a.target.split(".")[0] in ("vllm", "vllm_ascend")
            and layer_of(a.source, PREFIXES) not in ("integration", "tools")]


def test_only_the_connector_and_the_tools_import_vllm() -> None:
    assert vllm_imports(ROOT) == []


def test_negative_control_a_vllm_import_in_the_layout_is_found(tmp_path: Path) -> None:
    (tmp_path / "lmcache_npu" / "layout").mkdir(parents=True)
    (tmp_path / "lmcache_npu" / "layout" / "discovery.py").write_text("def f():\n    from vllm.v1 import x\n")
    assert vllm_imports(tmp_path / "lmcache_npu") == ["lmcache_npu.layout.discovery:2 imports vllm.v1"]


def test_arrow_text_names_the_line() -> None:
    assert str(Arrow("a.b", 3, "a.c")) == "a.b:3 imports a.c"
