"""The parent of a per-rank disk directory (finding N8): with data parallelism each engine uses `disk_path/dp<rank>`,
and `disk_path` must be one that no other user can change (a real directory, owned by us or root, writable by no one
else, a sticky bit not being enough) before a rank's directory is made or used."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lmcache_npu.config import load_config
from lmcache_npu.store.disk import DiskTier, check_disk_parent

FINGERPRINT = b"P" * 16


def _dp_config(rank: int = 1, size: int = 2) -> SimpleNamespace:
    """What engine_store_config reads of a vLLM config: the data-parallel rank and size."""
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=rank, data_parallel_size=size))


def _rank_config(parent: str, rank: int = 1):
    from lmcache_npu.integration.vllm.worker import engine_store_config

    config = load_config({"disk_path": parent, "disk_bytes": "64MiB"}, environ={})
    return engine_store_config(config, _dp_config(rank))


def _parent(tmp_path, mode: int, name: str = "kv"):
    path = tmp_path / name
    path.mkdir()
    os.chmod(path, mode)
    return path


def test_a_good_parent_is_accepted_and_the_rank_directory_works(tmp_path):
    """The negative control: a 0700 (or 0755) parent of ours gives dp<rank>, and a tier runs there."""
    for mode in (0o700, 0o755):
        parent = _parent(tmp_path, mode, f"kv-{mode:o}")
        config = _rank_config(str(parent), rank=1)
        assert config.store.disk_path == f"{parent}/dp1"
        tier = DiskTier(config.store.disk_path, FINGERPRINT)
        tier.close()
        assert (parent / "dp1").is_dir() and (os.stat(parent / "dp1").st_mode & 0o777) == 0o700


def test_a_missing_parent_is_created_private(tmp_path):
    parent = tmp_path / "new" / "kv"
    config = _rank_config(str(parent), rank=0)
    assert config.store.disk_path == f"{parent}/dp0"
    assert parent.is_dir() and (os.stat(parent).st_mode & 0o077) == 0


def test_a_world_writable_parent_is_refused_naming_it(tmp_path):
    parent = _parent(tmp_path, 0o777)
    with pytest.raises(ValueError) as refusal:
        _rank_config(str(parent))
    text = str(refusal.value)
    assert repr(str(parent)) in text and "is writable by group or others" in text and "mode 0777" in text
    assert f"chmod 700 {parent}" in text and "dp<rank>" in text
    assert not (parent / "dp1").exists()  # refused before the rank's directory was made


def test_a_group_writable_parent_is_refused(tmp_path):
    parent = _parent(tmp_path, 0o770)
    with pytest.raises(ValueError, match="is writable by group or others"):
        _rank_config(str(parent))


def test_a_sticky_shared_parent_is_refused_like_a_disk_path_without_data_parallelism(tmp_path):
    """Decided by the rule for the directory itself: a 1777 disk_path is refused without data parallelism, so it is
    refused as a parent too. Sticky stops others from renaming our dp<rank> away, but not from creating a rank's
    directory before its engine does (dp1 when only dp0 ran so far), which makes that engine refuse to start."""
    parent = _parent(tmp_path, 0o1777)
    with pytest.raises(ValueError) as refusal:
        _rank_config(str(parent))
    assert "is writable by group or others (sticky or not)" in str(refusal.value)
    assert "mode 1777" in str(refusal.value)
    with pytest.raises(ValueError, match="is writable by group or others"):
        DiskTier(str(parent), FINGERPRINT)  # the same directory as a plain disk_path: refused by the existing rule


def test_a_symlinked_parent_is_refused(tmp_path):
    real = _parent(tmp_path, 0o700, "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="is a symlink.*real directory instead of a link"):
        _rank_config(str(link))


def test_a_file_as_parent_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        _rank_config(str(path))


def test_a_parent_owned_by_another_user_is_refused_and_one_owned_by_root_accepted(tmp_path, monkeypatch):
    """Ownership without root: the directory is ours, so a service running as another uid (geteuid patched) must
    refuse it, unless that directory belongs to root."""

    parent = _parent(tmp_path, 0o755)
    owner = os.stat(parent).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1000)
    if owner == 0:
        check_disk_parent(str(parent))  # root's directory, not writable by others: accepted
    else:
        with pytest.raises(ValueError, match=f"owned by uid {owner}, neither this process's uid"):
            check_disk_parent(str(parent))


def test_a_parent_given_to_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root (chown); the uid rule is also checked, without "
                    "root, by test_a_parent_owned_by_another_user_is_refused_and_one_owned_by_root_accepted")
    parent = _parent(tmp_path, 0o755)
    os.chown(parent, 65534, -1)
    with pytest.raises(ValueError, match="owned by uid 65534, neither this process's uid 0 nor root.*chown 0"):
        check_disk_parent(str(parent))


def test_without_data_parallelism_disk_path_is_the_tier_directory(tmp_path):
    """No dp<rank>: disk_path is the tier's own directory and keeps the existing, stricter rule (owned by us)."""
    from lmcache_npu.integration.vllm.worker import engine_store_config

    parent = _parent(tmp_path, 0o777)
    config = load_config({"disk_path": str(parent), "disk_bytes": "64MiB"}, environ={})
    assert engine_store_config(config, _dp_config(rank=0, size=1)) is config
    with pytest.raises(ValueError, match="is writable by group or others"):
        DiskTier(str(parent), FINGERPRINT)
