"""No two test files share a basename: a newcomer told "see test_disk.py" must land on one file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def duplicate_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """Each test-file basename held by more than one path, with those paths (sorted, for a readable failure)."""
    counts = Counter(p.name for p in paths)
    return {name: sorted(str(p) for p in paths if p.name == name) for name, n in counts.items() if n > 1}


def test_no_two_test_files_share_a_basename() -> None:
    files = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    assert len(files) > 100  # the walk really found the suite
    assert duplicate_basenames(files) == {}


def test_negative_control_a_duplicate_basename_is_found() -> None:
    fake = [Path("node/test_disk.py"), Path("store/test_disk.py"), Path("store/test_arena.py")]
    assert duplicate_basenames(fake) == {"test_disk.py": ["node/test_disk.py", "store/test_disk.py"]}
