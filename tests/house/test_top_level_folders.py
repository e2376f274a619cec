"""No top-level folder of the repository shares its name with a subpackage of lmcache_npu: there is one `tools`, the
package's (the NPU build's checks live in build_checks/)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def folders_named_like_a_subpackage(repo_root: Path, package: str = "lmcache_npu") -> list[str]:
    """The top-level folders of `repo_root` (hidden ones aside) whose name is also a subpackage of `package`."""
    top = {p.name for p in repo_root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    subpackages = {init.parent.name for init in (repo_root / package).glob("*/__init__.py")}
    return sorted(top & subpackages)


def test_no_top_level_folder_is_named_like_a_subpackage() -> None:
    assert (REPO / "lmcache_npu" / "tools" / "__init__.py").is_file()  # the rule has something to compare against
    assert folders_named_like_a_subpackage(REPO) == []


def test_negative_control_a_second_tools_folder_is_found(tmp_path: Path) -> None:
    for folder in ("tools", "docs", "lmcache_npu/tools", "lmcache_npu/store", "lmcache_npu/notes"):
        (tmp_path / folder).mkdir(parents=True)
    for subpackage in ("tools", "store"):
        (tmp_path / "lmcache_npu" / subpackage / "__init__.py").touch()
    assert folders_named_like_a_subpackage(tmp_path) == ["tools"]  # notes/ has no __init__.py, docs/ is no subpackage
