"""The newcomer's map stays true: docs/testing.md's module -> tests table has a row for every part of the package, and
every test path the docs and the README name in backquotes exists (a renamed test file renames its mentions)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_PATHS = ("tests/build",)  # docs/npu_build.md says why the directory is *not* called that


def unmapped_parts(package_root: Path, testing_doc: str) -> list[str]:
    """Subpackages and top-level modules of the package that no row of the module table names (`part/` or
    `part.py` in its first column)."""
    rows = [line.split("|")[1] for line in testing_doc.splitlines() if line.startswith("| `")]
    named = " ".join(rows)
    parts = [p.name + "/" for p in package_root.iterdir() if (p / "__init__.py").exists()]
    parts += [p.name for p in package_root.glob("*.py") if p.name != "__init__.py"]
    return sorted(part for part in parts if f"`{part}" not in named and f" {part}" not in named)


def missing_test_paths(repo: Path, docs: list[Path]) -> list[str]:
    found = []
    for doc in docs:
        for path in re.findall(r"`(tests/[\w./*-]+)`", doc.read_text()):
            if path not in NOT_PATHS and not glob.glob(str(repo / path)):
                found.append(f"{doc.relative_to(repo)}: {path}")
    return found


def test_every_part_of_the_package_has_a_row() -> None:
    assert unmapped_parts(REPO / "lmcache_npu", (REPO / "docs" / "testing.md").read_text()) == []


def test_every_test_path_the_docs_name_exists() -> None:
    assert missing_test_paths(REPO, sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]) == []


def test_negative_control_a_missing_row_and_a_stale_path_are_found(tmp_path: Path) -> None:
    package = tmp_path / "lmcache_npu"
    for part in ("store", "node"):
        (package / part).mkdir(parents=True)
        (package / part / "__init__.py").touch()
    (package / "config.py").touch()
    doc = "| module | tests |\n|---|---|\n| `store/` keys | `tests/store` |\n| `config.py` | `tests/x` |\n"
    assert unmapped_parts(package, doc) == ["node/"]
    (tmp_path / "tests" / "store").mkdir(parents=True)
    (tmp_path / "tests" / "store" / "test_disk_tier.py").touch()
    (tmp_path / "README.md").write_text("`tests/store/test_disk.py` and `tests/store/test_disk_*.py`, `tests/build`\n")
    assert missing_test_paths(tmp_path, [tmp_path / "README.md"]) == ["README.md: tests/store/test_disk.py"]
