"""Full digests where they are free (issue 31 item 4, audit finding N4): a weight file of a Hugging Face cache
snapshot is identified by the sha256 its blob is named by, plus the samples; plain directories keep their sampled
fingerprints byte for byte. The checkpoints are built here from bytes (no torch), blobs named by the real sha256."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from lmcache_npu.tools import doctor
from lmcache_npu.identity import weights as identity
from lmcache_npu.identity.weights import fingerprint_weights

SAMPLED = 256 << 10  # a budget whose whole-read share (32 KiB) is below the 1.3 MB of weights: the sampling path
WHOLE = 512 << 20  # the default budget: these weights are read whole
# fingerprints of `_files("v1")` in a plain directory, computed by identity/weights.py (then store/identity.py) before
# this change (git 8eafdf7):
# plain directories must keep them, or every existing cache of a plain checkpoint would be orphaned
PLAIN_BEFORE = {SAMPLED: "8fd086ba86a5c1c29730397dd1e5873e72edbf407d5c83d3dcad37932e383c73",
                WHOLE: "04d4411f05869319151632b67e23f1716ffd4cd3e890cff8d1ef17cd6b3a8ec2"}
SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _bytes(label: str, n: int) -> bytes:
    return hashlib.shake_256(label.encode()).digest(n)


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def _files(version: str = "v1") -> dict[str, bytes]:
    return {
        SHARD_1: _safetensors({"embed": _bytes(f"{version}-embed", 600 << 10), "norm": _bytes(f"{version}-norm", 64)}),
        SHARD_2: _safetensors({"proj": _bytes(f"{version}-proj", 700 << 10), "k_scale": _bytes(f"{version}-scale", 4)}),
        "config.json": json.dumps({"hidden_size": 64}).encode(),
    }


def _plain(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub(cache: Path, files: dict[str, bytes], revision: str = "a" * 40, lfs: bool = True) -> Path:
    """`cache/models--org--name` as huggingface_hub lays it out: blobs named by their ETag (sha256 for LFS weight
    files, git sha1 otherwise) and a snapshot of relative symlinks to them."""
    repo = cache / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for name, data in files.items():
        weight = name.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if weight and lfs else _git_sha1(data)
        (blobs / etag).write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blobs / etag, snapshot))
    return snapshot


def _tensor_offset(data: bytes, tensor: str) -> int:
    (n,) = struct.unpack("<Q", data[:8])
    return 8 + n + json.loads(data[8:8 + n])[tensor]["data_offsets"][0]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:  # in place: the blob keeps its name and inode
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("budget", [SAMPLED, WHOLE])
def test_plain_directories_keep_their_fingerprints(tmp_path: Path, budget: int) -> None:
    fp = fingerprint_weights(_plain(tmp_path / "plain", _files()), max_read_bytes=budget)
    assert fp.digest.hex() == PLAIN_BEFORE[budget] and fp.hub_sha256_files == 0
    assert fp.sampled_files == (0 if budget == WHOLE else 2)


def test_hub_snapshot_takes_the_blob_sha256_and_keeps_the_samples(tmp_path: Path) -> None:
    snapshot = _hub(tmp_path / "hub", _files())
    plain = _plain(tmp_path / "plain", _files())
    for budget in (SAMPLED, WHOLE):
        hub = fingerprint_weights(snapshot, max_read_bytes=budget)
        assert hub.hub_sha256_files == 2 and hub.sampled_files == 0 and hub.files == 2
        assert hub.describe()["hub_sha256_files"] == 2
        # the same content in a plain directory is sampled as before, so the two differ (by design: the hub
        # fingerprint also binds every byte through the sha256)
        assert fingerprint_weights(plain, max_read_bytes=budget).digest.hex() == PLAIN_BEFORE[budget]
        assert hub.digest != bytes.fromhex(PLAIN_BEFORE[budget])
        # stable: the same blobs give the same fingerprint again, and under another revision's snapshot
        assert fingerprint_weights(snapshot, max_read_bytes=budget).digest == hub.digest
    other = tmp_path / "hub" / "models--org--name" / "snapshots" / ("b" * 40)
    other.mkdir()
    for link in snapshot.iterdir():
        (other / link.name).symlink_to(os.readlink(link))
    assert fingerprint_weights(other, max_read_bytes=SAMPLED).digest == \
        fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest


def test_a_changed_blob_gives_a_new_namespace(tmp_path: Path) -> None:
    """A new revision whose shard differs only outside every sampled page: the samples cannot tell, the blob's
    sha256 can."""
    files = _files()
    snapshot = _hub(tmp_path / "hub", files)
    before = fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest
    edited = bytearray(files[SHARD_2])
    edited[_tensor_offset(files[SHARD_2], "proj") + 300_001] ^= 0x01  # one bit of a 700 KiB tensor
    changed = {**files, SHARD_2: bytes(edited)}
    # control that this edit is one sampling alone misses (the blind spot of finding N4)
    assert fingerprint_weights(_plain(tmp_path / "p1", files), max_read_bytes=SAMPLED).digest == \
        fingerprint_weights(_plain(tmp_path / "p2", changed), max_read_bytes=SAMPLED).digest, \
        "the edited byte is sampled: pick another offset for this test"
    new = _hub(tmp_path / "hub", changed, revision="c" * 40)
    assert fingerprint_weights(new, max_read_bytes=SAMPLED).digest != before
    assert fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest == before  # the old revision is unchanged


def test_an_in_place_edit_of_a_blob_at_a_sampled_position_is_seen(tmp_path: Path) -> None:
    files = _files()
    snapshot = _hub(tmp_path / "hub", files)
    before = fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest
    blob = (snapshot / SHARD_1).resolve()
    name = blob.name
    _flip(blob, _tensor_offset(files[SHARD_1], "norm") + 3)  # a 64-byte tensor: read whole even when sampling
    assert blob.name == name and (snapshot / SHARD_1).resolve() == blob
    assert fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest != before


def test_blobs_not_named_by_a_sha256_are_sampled_only(tmp_path: Path) -> None:
    """40-hex git-sha1 blobs (non-LFS files), and links that do not follow the cache layout, add nothing: those
    fingerprints equal the plain directory's."""
    sha1 = _hub(tmp_path / "sha1", _files(), lfs=False)
    fp = fingerprint_weights(sha1, max_read_bytes=SAMPLED)
    assert fp.hub_sha256_files == 0 and fp.digest.hex() == PLAIN_BEFORE[SAMPLED]
    # 64-hex names, but not a snapshot of a cache repo: links from a folder to a folder named "blobs" elsewhere
    loose, store = tmp_path / "loose", tmp_path / "store" / "blobs"
    loose.mkdir()
    store.mkdir(parents=True)
    for name, data in _files().items():
        (store / hashlib.sha256(data).hexdigest()).write_bytes(data)
        (loose / name).symlink_to(store / hashlib.sha256(data).hexdigest())
    fp = fingerprint_weights(loose, max_read_bytes=SAMPLED)
    assert fp.hub_sha256_files == 0 and fp.digest.hex() == PLAIN_BEFORE[SAMPLED]


def test_links_into_a_snapshot_and_absolute_links_still_count(tmp_path: Path) -> None:
    snapshot = _hub(tmp_path / "hub", _files())
    expected = fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest
    farm = tmp_path / "farm"  # an operator's folder of links to the snapshot's files
    farm.mkdir()
    for link in snapshot.iterdir():
        (farm / link.name).symlink_to(link)
    assert fingerprint_weights(farm, max_read_bytes=SAMPLED).digest == expected
    moved = tmp_path / "moved-cache"  # relative links survive moving the whole cache
    shutil.copytree(tmp_path / "hub", moved, symlinks=True)
    assert fingerprint_weights(moved / "models--org--name" / "snapshots" / ("a" * 40),
                               max_read_bytes=SAMPLED).digest == expected
    for link in snapshot.iterdir():  # huggingface_hub falls back to absolute links across volumes
        target = link.resolve()
        link.unlink()
        link.symlink_to(target)
    assert fingerprint_weights(snapshot, max_read_bytes=SAMPLED).digest == expected


def test_doctor_says_how_many_files_got_a_full_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_npu.config import load_config

    config = load_config({}, environ={})
    snapshot = _hub(tmp_path / "hub", _files())
    plain = _plain(tmp_path / "plain", _files())
    whole = doctor.check_weights(str(plain), config)
    assert whole.verdict == doctor.OK and "all 2 weight files read whole" in whole.detail
    # these weights are small enough to be read whole at the default budget: sample them as a large checkpoint is
    monkeypatch.setattr(identity, "fingerprint_weights",
                        functools.partial(identity.fingerprint_weights, max_read_bytes=SAMPLED))
    hub = doctor.check_weights(str(snapshot), config)
    assert hub.verdict == doctor.OK
    assert "2 of 2 weight files with a full sha256 from the Hugging Face cache, 0 sampled only" in hub.detail
    assert "not seen" not in hub.detail
    sampled = doctor.check_weights(str(plain), config)
    assert "0 of 2 weight files with a full sha256 from the Hugging Face cache, 2 sampled only" in sampled.detail
    assert "an edit to part of a tensor that misses every sampled page is not seen" in sampled.detail
