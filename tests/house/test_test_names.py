"""No two modules under tests/ share a basename (pytest's per-folder `conftest.py` and `__init__.py` aside): a newcomer
told "see test_disk.py" or "the scenarios in mooncake_scenarios.py" must land on one file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# pytest finds these by name in every folder: one per folder is the point
PER_FOLDER = frozenset({"__init__.py", "conftest.py"})


def duplicate_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """Each module basename held by more than one path, with those paths (sorted, for a readable failure);
    `conftest.py` and `__init__.py` are never duplicates."""
    counts = Counter(p.name for p in paths if p.name not in PER_FOLDER)
    return {name: sorted(str(p) for p in paths if p.name == name) for name, n in counts.items() if n > 1}


def test_no_two_test_modules_share_a_basename() -> None:
    files = [p.relative_to(TESTS) for p in TESTS.rglob("*.py")]
    assert sum(p.name.startswith("test_") for p in files) > 100  # the walk really found the suite
    assert duplicate_basenames(files) == {}


def test_negative_control_a_duplicate_basename_is_found() -> None:
    fake = [Path("node/test_disk.py"), Path("store/test_disk.py"), Path("store/test_arena.py")]
    assert duplicate_basenames(fake) == {"test_disk.py": ["node/test_disk.py", "store/test_disk.py"]}


def test_negative_control_a_duplicate_helper_module_is_found() -> None:
    fake = [Path("cuda/marks.py"), Path("npu/marks.py"), Path("npu/test_marks.py")]
    assert duplicate_basenames(fake) == {"marks.py": ["cuda/marks.py", "npu/marks.py"]}


def test_conftest_and_init_in_every_folder_are_not_duplicates() -> None:
    fake = [Path("node/conftest.py"), Path("store/conftest.py"), Path("node/__init__.py"), Path("store/__init__.py")]
    assert duplicate_basenames(fake) == {}
