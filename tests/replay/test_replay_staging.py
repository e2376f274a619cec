"""Directories published whole: a second publisher finds the first's and keeps it; a failed write leaves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_npu.tools.replay.staging import publish_directory


def _writer(content: bytes):
    def write(staging: Path) -> None:
        (staging / "config.json").write_bytes(content)
    return write


def test_the_first_publisher_wins_and_no_staging_directory_stays(tmp_path: Path) -> None:
    target = tmp_path / "model"
    publish_directory(target, _writer(b"first"), "config.json")
    publish_directory(target, _writer(b"second"), "config.json")  # os.replace onto a non-empty directory fails
    assert (target / "config.json").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_write_raises_and_publishes_nothing(tmp_path: Path) -> None:
    def broken(staging: Path) -> None:
        (staging / "partial").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_directory(tmp_path / "model", broken, "config.json")
    assert list(tmp_path.iterdir()) == []  # negative control of the first test: nothing half-written stays
