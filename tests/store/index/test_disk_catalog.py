"""store/index/disk_catalog.py alone: which chunks have a disk copy, in least recently used order, and which one gives
way when the tier is full (never one `droppable` refuses, e.g. a copy being read)."""

from __future__ import annotations

import pytest

from lmcache_npu.store.index.disk_catalog import DiskCatalog


def catalog(*keys: str, capacity: int = 3) -> DiskCatalog:
    found = DiskCatalog(capacity)
    for key in keys:
        found.add(key)
    return found


def test_the_least_recently_added_copy_gives_way_when_full() -> None:
    disk = catalog("a", "b")
    assert not disk.full()
    disk.add("c")
    assert disk.full() and len(disk) == 3 and disk.victim(lambda key: True) == "a"


def test_a_copy_that_was_read_becomes_the_most_recent() -> None:
    disk = catalog("a", "b", "c")
    disk.touch("a")
    assert disk.victim(lambda key: True) == "b"


def test_negative_control_without_the_read_the_oldest_copy_is_the_victim() -> None:
    assert catalog("a", "b", "c").victim(lambda key: True) == "a"


def test_a_copy_droppable_refuses_is_skipped_and_none_when_all_are_refused() -> None:
    disk = catalog("a", "b", "c")
    assert disk.victim(lambda key: key != "a") == "b"
    assert disk.victim(lambda key: False) is None


def test_a_discarded_copy_is_gone_and_touching_an_unknown_one_is_harmless() -> None:
    disk = catalog("a", "b")
    disk.discard("a")
    disk.touch("zz")
    assert "a" not in disk and "b" in disk and len(disk) == 1


def test_capacity_zero_is_no_disk_tier() -> None:
    disk = DiskCatalog(0)
    disk.touch("a")
    disk.discard("a")
    assert len(disk) == 0 and "a" not in disk and disk.victim(lambda key: True) is None and disk.full()
    with pytest.raises(AssertionError, match="the index has no disk tier"):
        disk.add("a")
