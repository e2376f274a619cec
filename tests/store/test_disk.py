"""The local-disk tier stores exactly the bytes it was given, survives restarts, refuses files whose header or
length is wrong (a flipped payload byte is the envelope's to name), and trusts no directory, link or lock it did not
check."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing as mp
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import xxhash

from lmcache_npu.store.disk import DISK_FORMAT_VERSION, HEADER_BYTES, DiskTier, scan_disk_directory
from lmcache_npu.store.disk import tier as disk_tier
from lmcache_npu.store.envelope import Sealer, seal, sealed_bytes, verify
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import OK, Failure, TierCounters, TierResult, TierStore

FP = bytes(range(16))
OTHER_FP = bytes(range(16, 32))


def name_of(i: int, rank: int = 0) -> str:
    return f"{'ab' * 16}-{i:016x}-r{rank}"


def file_of(root: Path, name: str) -> Path:
    return root / hashlib.sha256(name.encode()).hexdigest()[:2] / f"{name}.kv"


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def read(tier: DiskTier, name: str, size: int) -> tuple[TierResult, bytes]:
    out = np.zeros(size, dtype=np.uint8)
    result = tier.read_into(name, out)
    return result, out.tobytes()


class Results:
    """Collects `done` results and lets a test wait for them."""

    def __init__(self) -> None:
        self.items: list[TierResult] = []
        self.event = threading.Event()

    def __call__(self, result: TierResult) -> None:
        self.items.append(result)
        self.event.set()


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    t = DiskTier(tmp_path / "cache", FP)
    yield t
    t.close()


@pytest.fixture
def fsync_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Blocks every fsync until `release` is set; `entered` says a writer is inside one."""
    release, entered = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def gated(fd: int) -> None:
        entered.set()
        release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", gated)
    yield release, entered
    release.set()


def test_round_trip_many_chunks_of_every_buffer_kind(tier: DiskTier) -> None:
    rng = np.random.default_rng(1)
    sizes = [0, 1, 63, 64, 65] + [int(s) for s in rng.integers(1, 300 << 10, 55)]
    expected = {name_of(i): payload(size, seed=i) for i, size in enumerate(sizes)}
    kinds: list[Callable[[bytes], object]] = [
        bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8).copy().reshape(-1, 1),
        lambda b: memoryview(torch.frombuffer(bytearray(b), dtype=torch.uint8).numpy()) if b else memoryview(b),
    ]
    for i, (name, data) in enumerate(expected.items()):
        assert tier.write_async(name, kinds[i % len(kinds)](data)) == OK
    assert tier.flush(10)
    for name, data in expected.items():
        assert file_of(Path(tier.root), name).stat().st_size == HEADER_BYTES + len(data)
        assert read(tier, name, len(data)) == (OK, data)
    assert tier.used_bytes == sum(HEADER_BYTES + len(d) for d in expected.values())
    counts = tier.counters.snapshot()
    assert counts["writes"] == counts["reads"] == len(expected)
    assert counts["write_bytes"] == counts["read_bytes"] == sum(map(len, expected.values()))


def test_header_layout_on_disk(tier: DiskTier) -> None:
    data = payload(1000, seed=5)
    tier.write_async(name_of(1), data)
    tier.flush()
    raw = file_of(Path(tier.root), name_of(1)).read_bytes()
    magic, version, header, fp, length, digest, reserved = struct.unpack("<8sII16sQ12s12s", raw[:64])
    assert (magic, version, header, fp, length) == (b"LMCNPUKV", DISK_FORMAT_VERSION, 64, FP, 1000)
    assert DISK_FORMAT_VERSION == 2 and reserved == bytes(12)  # no payload checksum: the envelope is the digest
    assert digest == hashlib.sha256(name_of(1).encode()).digest()[:12] and raw[64:] == data


def test_caller_may_reuse_its_buffer_at_once(tier: DiskTier, fsync_gate: tuple[threading.Event, ...]) -> None:
    source = bytearray(payload(5000, seed=2))
    original = bytes(source)
    assert tier.write_async(name_of(1), source) == OK
    source[:] = bytes(len(source))  # the arena slot is reused right after a spill
    assert read(tier, name_of(1), 5000) == (OK, original)  # from the pending copy
    fsync_gate[0].set()
    tier.flush(10)
    assert read(tier, name_of(1), 5000) == (OK, original)  # from the file


def test_restart_finds_entries_oldest_first_and_reads_them(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    expected = {name_of(i): payload(100 + 37 * i, seed=i) for i in range(8)}
    for name, data in expected.items():
        tier.write_async(name, data)
    tier.close()
    order = [name_of(i) for i in (5, 2, 7, 0, 1, 6, 3, 4)]
    for age, name in enumerate(reversed(order)):  # set mtimes explicitly: filesystem timestamps are coarse
        os.utime(file_of(root, name), (1_000_000 - age, 1_000_000 - age))
    entries = scan_disk_directory(root, FP)
    assert [e.name for e in entries] == order
    assert {e.name: e.payload_bytes for e in entries} == {n: len(d) for n, d in expected.items()}
    restarted = DiskTier(root, FP)
    assert restarted.used_bytes == sum(HEADER_BYTES + len(d) for d in expected.values())
    for name, data in expected.items():
        assert restarted.exists(name) and read(restarted, name, len(data)) == (OK, data)
    assert restarted.delete(name_of(3)) and restarted.used_bytes == sum(
        HEADER_BYTES + len(d) for n, d in expected.items() if n != name_of(3))
    restarted.close()


def flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 17] ^= 0x40
    path.write_bytes(raw)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def append_byte(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def patch_header(offset: int, value: bytes) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset:offset + len(value)] = value
        path.write_bytes(raw)
    return corrupt


def tiny(path: Path) -> None:
    path.write_bytes(b"LMCNPUKV")


CORRUPTIONS = {
    "short": truncate,
    "size": append_byte,
    "magic": patch_header(0, b"XXXXXXXX"),
    "header size": patch_header(12, struct.pack("<I", 128)),
    "short ": tiny,  # shorter than a header
}


@pytest.mark.parametrize("reason", list(CORRUPTIONS))
def test_read_of_damaged_file_is_corrupt_and_removes_it(tier: DiskTier, reason: str) -> None:
    good = payload(4000, seed=9)
    tier.write_async(name_of(1), good)
    tier.write_async(name_of(2), good)
    tier.flush()
    path = file_of(Path(tier.root), name_of(1))
    CORRUPTIONS[reason](path)
    assert read(tier, name_of(1), 4000)[0] == TierResult.fail(Failure.CORRUPT, reason.strip())
    assert not path.exists() and tier.counters["corrupt"] == 1
    assert tier.used_bytes == HEADER_BYTES + 4000
    assert read(tier, name_of(1), 4000)[0] == TierResult.fail(Failure.MISS) and tier.counters["misses"] == 1
    assert read(tier, name_of(2), 4000) == (OK, good)


@pytest.mark.parametrize("reason", list(CORRUPTIONS))
def test_scan_removes_damaged_files(tmp_path: Path, reason: str) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    tier.write_async(name_of(1), payload(4000, seed=9))
    tier.close()
    CORRUPTIONS[reason](file_of(root, name_of(1)))
    restarted = DiskTier(root, FP)
    assert restarted.counters["corrupt"] == 1 and restarted.used_bytes == 0
    assert not file_of(root, name_of(1)).exists()
    restarted.close()


def sealed_object(key: ChunkKey, size: int = 4000) -> np.ndarray:
    data = np.random.default_rng(9).integers(0, 256, sealed_bytes(size), dtype=np.uint8)
    seal(data, key, 0, Sealer())
    return data


@pytest.mark.parametrize("restart", [False, True], ids=["read", "scan-then-read"])
def test_a_flipped_payload_byte_passes_the_tier_and_fails_the_envelope(tmp_path: Path, restart: bool) -> None:
    """The tier hashes no payload (format 2): a flipped byte comes back as stored, and the envelope digest, which the
    executor verifies on every promotion, names it."""
    key = ChunkKey("ab" * 16, bytes(range(32)))
    name, stored = key.storage_name(0), sealed_object(key)
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    tier.write_async(name, stored)
    assert tier.flush(10)
    out = np.zeros_like(stored)
    assert tier.read_into(name, out) == OK and verify(out, key, 0, Sealer()) is None  # control: untouched, it verifies
    flip_payload_byte(file_of(root, name))
    if restart:
        tier.close()
        tier = DiskTier(root, FP)  # the header is intact: the scan keeps the file
        assert tier.counters["corrupt"] == 0 and tier.used_bytes == HEADER_BYTES + stored.nbytes
    assert tier.read_into(name, out) == OK and out.tobytes() != stored.tobytes()
    assert verify(out, key, 0, Sealer()) == "digest"
    tier.close()


def test_format_version_1_files_are_another_versions_skipped_and_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    DiskTier(root, FP).close()
    data = payload(4000, seed=9)
    path = file_of(root, name_of(1))
    path.parent.mkdir(mode=0o700)
    # byte for byte what version 1 wrote: an xxh3-64 checksum at 40, the name digest at 48
    path.write_bytes(struct.pack("<8sII16sQQ12s4x", b"LMCNPUKV", 1, 64, FP, len(data), xxhash.xxh3_64_intdigest(data),
                                 hashlib.sha256(name_of(1).encode()).digest()[:12]) + data)
    restarted = DiskTier(root, FP)
    assert restarted.used_bytes == 0 and restarted.counters["foreign"] == 1 and restarted.counters["corrupt"] == 0
    assert read(restarted, name_of(1), 4000)[0] == TierResult.fail(Failure.CORRUPT, "version")
    assert path.exists()
    # control: the same payload written by this version reads
    restarted.write_async(name_of(2), data)
    assert restarted.flush(10) and read(restarted, name_of(2), 4000) == (OK, data)
    restarted.close()


def test_file_copied_to_another_name_fails_the_name_check(tier: DiskTier) -> None:
    data = payload(3000, seed=4)
    tier.write_async(name_of(1), data)
    tier.flush()
    root = Path(tier.root)
    target = file_of(root, name_of(2))
    target.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(file_of(root, name_of(1)), target)
    assert read(tier, name_of(2), 3000)[0] == TierResult.fail(Failure.CORRUPT, "name")
    assert not target.exists() and tier.counters["corrupt"] == 1
    assert read(tier, name_of(1), 3000) == (OK, data)
    shutil.copyfile(file_of(root, name_of(1)), target)
    restarted = DiskTier(root, FP)  # the scan catches it too
    assert [e.name for e in scan_disk_directory(root, FP)] == [name_of(1)] and not target.exists()
    restarted.close()


def test_file_in_the_wrong_fan_out_directory_is_removed_at_scan(tier: DiskTier) -> None:
    tier.write_async(name_of(1), b"x" * 100)
    tier.flush()
    root = Path(tier.root)
    source = file_of(root, name_of(1))
    wrong = root / ("00" if source.parent.name != "00" else "01") / source.name
    wrong.parent.mkdir(exist_ok=True)
    os.rename(source, wrong)
    assert scan_disk_directory(root, FP) == [] and not wrong.exists()


def test_other_format_versions_are_skipped_and_never_removed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    tier.write_async(name_of(1), payload(4000, seed=9))
    tier.close()
    patch_header(8, struct.pack("<I", DISK_FORMAT_VERSION + 1))(file_of(root, name_of(1)))
    restarted = DiskTier(root, FP)
    assert restarted.used_bytes == 0 and restarted.counters["foreign"] == 1 and restarted.counters["corrupt"] == 0
    assert read(restarted, name_of(1), 4000)[0] == TierResult.fail(Failure.CORRUPT, "version")
    assert file_of(root, name_of(1)).exists()
    restarted.close()


def test_other_layout_files_are_skipped_and_never_removed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    owner = DiskTier(root, FP)
    data = payload(2000, seed=3)
    owner.write_async(name_of(1), data)
    owner.flush()
    other = DiskTier(root, OTHER_FP)
    assert other.used_bytes == 0 and other.counters["foreign"] == 1 and other.counters["corrupt"] == 0
    assert read(other, name_of(1), 2000)[0] == TierResult.fail(Failure.CORRUPT, "fingerprint")
    assert other.counters["foreign"] == 2 and other.counters["corrupt"] == 0
    assert file_of(root, name_of(1)).exists()
    assert read(owner, name_of(1), 2000) == (OK, data)
    assert [e.name for e in scan_disk_directory(root, FP)] == [name_of(1)]
    other.close()
    owner.close()


def test_wrong_length_buffer_is_corrupt_length(tier: DiskTier) -> None:
    tier.write_async(name_of(1), payload(1000, seed=1))
    tier.flush()
    assert read(tier, name_of(1), 999)[0] == TierResult.fail(Failure.CORRUPT, "length")
    assert not file_of(Path(tier.root), name_of(1)).exists() and tier.used_bytes == 0


def test_pending_write_is_served_from_memory(tier: DiskTier, fsync_gate: tuple[threading.Event, ...]) -> None:
    release, entered = fsync_gate
    data = payload(70_000, seed=6)
    done = Results()
    assert tier.write_async(name_of(1), data, done) == OK
    assert entered.wait(5)  # the writer is inside fsync: the file is not renamed yet
    assert not file_of(Path(tier.root), name_of(1)).exists()
    assert tier.exists(name_of(1)) and tier.pending_bytes == HEADER_BYTES + 70_000
    assert read(tier, name_of(1), 70_000) == (OK, data) and tier.counters["pending_reads"] == 1
    assert not tier.flush(timeout=0.05) and done.items == []
    release.set()
    assert tier.flush(10) and done.items == [OK] and tier.pending_bytes == 0
    assert read(tier, name_of(1), 70_000) == (OK, data) and tier.counters["pending_reads"] == 1


def test_queue_full_refusal(tmp_path: Path, fsync_gate: tuple[threading.Event, ...]) -> None:
    tier = DiskTier(tmp_path, FP, max_pending_bytes=3 * (HEADER_BYTES + 1000))
    done = Results()
    for i in range(3):
        assert tier.write_async(name_of(i), payload(1000, seed=i), done) == OK
    assert tier.write_async(name_of(3), payload(1000, seed=3), done) == TierResult.fail(Failure.QUEUE_FULL)
    assert tier.counters["queue_full"] == 1 and not tier.exists(name_of(3))
    fsync_gate[0].set()
    assert tier.flush(10) and done.items == [OK, OK, OK]  # the refusal never called done
    assert tier.write_async(name_of(3), payload(1000, seed=3)) == OK
    tier.close()


def test_capacity_refusal_counts_pending_and_frees_on_delete(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, capacity_bytes=2 * (HEADER_BYTES + 1000))
    assert tier.write_async(name_of(0), payload(1000, seed=0)) == OK
    assert tier.write_async(name_of(1), payload(1000, seed=1)) == OK  # may still be pending: counted as well
    assert tier.write_async(name_of(2), b"x") == TierResult.fail(Failure.CAPACITY)
    assert tier.counters["capacity_refused"] == 1
    tier.flush()
    assert tier.used_bytes == 2 * (HEADER_BYTES + 1000)
    assert tier.delete(name_of(0)) and tier.used_bytes == HEADER_BYTES + 1000
    assert tier.write_async(name_of(2), payload(1000, seed=2)) == OK
    tier.close()
    restarted = DiskTier(tmp_path, FP, capacity_bytes=10)  # files found at start count against capacity
    assert restarted.write_async(name_of(3), b"x") == TierResult.fail(Failure.CAPACITY)
    restarted.close()


@pytest.mark.parametrize("code, failure, counter", [
    (errno.ENOSPC, TierResult.fail(Failure.DISK_FULL), "disk_full"),
    (errno.EIO, TierResult.fail(Failure.IO, "Input/output error"), "io_errors")])
def test_write_errors_are_reported_and_the_service_continues(tier: DiskTier, monkeypatch: pytest.MonkeyPatch,
                                                             code: int, failure: TierResult, counter: str) -> None:
    def failing_write(fd: int, data: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", failing_write)
    done = Results()
    assert tier.write_async(name_of(1), payload(5000, seed=1), done) == OK
    assert tier.flush(10) and done.items == [failure] and tier.counters[counter] == 1
    assert not tier.exists(name_of(1)) and tier.used_bytes == 0 and tier.pending_bytes == 0
    assert list(Path(tier.root).rglob("*.tmp")) == []
    monkeypatch.undo()
    data = payload(5000, seed=2)
    assert tier.write_async(name_of(1), data, done) == OK
    assert tier.flush(10) and done.items[-1] == OK and read(tier, name_of(1), 5000) == (OK, data)


def test_delete_cancels_a_queued_write(tier: DiskTier, fsync_gate: tuple[threading.Event, ...]) -> None:
    first, second = Results(), Results()
    tier.write_async(name_of(1), payload(1000, seed=1), first)  # occupies the writer inside fsync
    assert fsync_gate[1].wait(5)
    tier.write_async(name_of(2), payload(1000, seed=2), second)  # still queued
    assert tier.delete(name_of(2)) and not tier.exists(name_of(2)) and tier.pending_bytes == HEADER_BYTES + 1000
    fsync_gate[0].set()
    assert tier.flush(10)
    assert first.items == [OK] and second.items == [TierResult.fail(Failure.CANCELLED)]
    assert not file_of(Path(tier.root), name_of(2)).exists() and read(tier, name_of(2), 1000)[0].reason == "miss"


def test_delete_during_the_write_itself_leaves_nothing(tier: DiskTier, fsync_gate: tuple[threading.Event, ...]) -> None:
    done = Results()
    tier.write_async(name_of(1), payload(1000, seed=1), done)
    assert fsync_gate[1].wait(5)  # the temp file is written, the rename not yet done
    assert tier.delete(name_of(1)) and tier.counters["deleted"] == 1
    fsync_gate[0].set()
    assert tier.flush(10) and done.items == [TierResult.fail(Failure.CANCELLED)]
    assert not tier.exists(name_of(1)) and list(Path(tier.root).rglob("*.*")) == [] and tier.used_bytes == 0
    assert not tier.delete(name_of(1)) and tier.counters["deleted"] == 1


def test_delete_after_landing_removes_the_file(tier: DiskTier) -> None:
    tier.write_async(name_of(1), b"abc")
    tier.flush()
    assert tier.delete(name_of(1)) and not file_of(Path(tier.root), name_of(1)).exists() and tier.used_bytes == 0


def test_newer_write_supersedes_a_pending_one(tmp_path: Path, fsync_gate: tuple[threading.Event, ...]) -> None:
    tier = DiskTier(tmp_path, FP, writer_threads=2)
    old, new = Results(), Results()
    tier.write_async(name_of(1), payload(800, seed=1), old)
    tier.write_async(name_of(1), payload(900, seed=2), new)
    assert read(tier, name_of(1), 900) == (OK, payload(900, seed=2))
    fsync_gate[0].set()
    assert tier.flush(10)
    assert old.items == [TierResult.fail(Failure.SUPERSEDED)] and new.items == [OK]
    assert read(tier, name_of(1), 900) == (OK, payload(900, seed=2)) and tier.used_bytes == HEADER_BYTES + 900
    tier.close()


def test_file_and_directory_modes(tmp_path: Path) -> None:
    root = tmp_path / "new" / "cache"
    tier = DiskTier(root, FP)
    tier.write_async(name_of(1), b"x" * 10)
    tier.close()
    path = file_of(root, name_of(1))
    assert (root.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_disk_tier_is_a_tier_store(tier: DiskTier) -> None:
    assert isinstance(tier, TierStore)


def test_close_is_idempotent_and_refuses_later_writes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, writer_threads=3)
    done = Results()
    for i in range(20):
        tier.write_async(name_of(i), payload(100, seed=i), done)
    tier.close()
    assert len(done.items) == 20 and all(r.ok for r in done.items)  # close flushed them
    assert tier.write_async(name_of(99), b"x", done) == TierResult.fail(Failure.CLOSED) and len(done.items) == 20
    tier.close()
    assert read(tier, name_of(7), 100) == (OK, payload(100, seed=7))


def test_a_raising_done_callback_does_not_stop_the_writer(tier: DiskTier) -> None:
    def explode(result: TierResult) -> None:
        raise RuntimeError("callback bug")

    tier.write_async(name_of(1), b"one", explode)
    tier.write_async(name_of(2), b"two")
    assert tier.flush(10) and read(tier, name_of(2), 3) == (OK, b"two")


def test_caller_bugs_raise_value_error(tier: DiskTier) -> None:
    for bad in ("", "../etc", "a/b", "x.tmp", "a" * 201):
        with pytest.raises(ValueError):
            tier.write_async(bad, b"x")
    with pytest.raises(ValueError):
        tier.read_into(name_of(1), b"read-only")
    with pytest.raises(ValueError):
        tier.write_async(name_of(1), np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError):
        DiskTier(tier.root, b"short")


def test_reads_racing_writes_never_see_partial_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, writer_threads=2)
    data = {name_of(i): payload(20_000 + i, seed=i) for i in range(40)}
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for name, expected in data.items():
                result, got = read(tier, name, len(expected))
                if result.ok and got != expected or not result.ok and result.reason != "miss":
                    bad.append(f"{name}: {result}")

    thread = threading.Thread(target=reader)
    thread.start()
    for name, expected in data.items():
        tier.write_async(name, expected)
    tier.flush(10)
    stop.set()
    thread.join()
    assert bad == [] and tier.counters["corrupt"] == 0
    assert all(read(tier, n, len(d)) == (OK, d) for n, d in data.items())
    tier.close()


NAMES = [name_of(i) for i in range(4)]
OPERATIONS = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(NAMES), st.binary(max_size=3000)),
    st.tuples(st.just("read"), st.sampled_from(NAMES)),
    st.tuples(st.just("delete"), st.sampled_from(NAMES)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("restart")),
)


@given(ops=st.lists(OPERATIONS, max_size=25), writer_threads=st.sampled_from([1, 2]))
def test_random_operations_match_a_dict_model(ops: list[tuple], writer_threads: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        tier = DiskTier(root, FP, writer_threads=writer_threads)
        model: dict[str, bytes] = {}
        try:
            for op in ops:
                if op[0] == "write":
                    assert tier.write_async(op[1], op[2]) == OK
                    model[op[1]] = op[2]
                elif op[0] == "read":
                    expected = model.get(op[1])
                    result, got = read(tier, op[1], 0 if expected is None else len(expected))
                    missed = (TierResult.fail(Failure.MISS), b"")
                    assert (result, got) == ((OK, expected) if expected is not None else missed)
                elif op[0] == "delete":
                    assert tier.delete(op[1]) == (op[1] in model)
                    model.pop(op[1], None)
                elif op[0] == "flush":
                    assert tier.flush(10)
                    assert tier.used_bytes == sum(HEADER_BYTES + len(v) for v in model.values())
                else:
                    tier.close()
                    tier = DiskTier(root, FP, writer_threads=writer_threads)
                    assert tier.used_bytes == sum(HEADER_BYTES + len(v) for v in model.values())
                assert all(tier.exists(n) == (n in model) for n in NAMES)
            tier.flush(10)
            assert sorted(e.name for e in scan_disk_directory(root, FP)) == sorted(model)
            assert all(read(tier, n, len(v)) == (OK, v) for n, v in model.items())
            assert tier.counters["corrupt"] == 0 and not list(Path(root).rglob("*.tmp"))
        finally:
            tier.close()


# ---- trust in the directory, the lock, temp files ----------------------------------------------------------------

FOREIGN_UID = 1234


def make_root(parent: Path, mode: int = 0o700) -> Path:
    root = parent / "cache"
    root.mkdir()
    os.chmod(root, mode)  # exactly `mode`, whatever the umask did
    return root


def refusal(make: Callable[[], object]) -> str:
    """The ValueError message `make()` raises; fails the test when it starts instead."""
    with pytest.raises(ValueError) as error:
        made = make()
        if isinstance(made, DiskTier):
            made.close()
    return str(error.value)


def test_missing_root_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        tier = DiskTier(tmp_path / "a" / "cache", FP)
    finally:
        os.umask(previous)
    tier.close()
    assert stat.S_IMODE((tmp_path / "a" / "cache").stat().st_mode) == 0o700


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.integers(0, 0o777))
def test_root_mode_is_refused_exactly_when_group_or_others_may_write(tmp_path: Path, mode: int) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as parent:
        root = make_root(Path(parent), mode)
        if mode & 0o022:
            for make in (lambda: DiskTier(root, FP), lambda: scan_disk_directory(root, FP)):
                message = refusal(make)
                assert str(root) in message and f"mode {mode:04o}" in message and "writable by group or others" \
                    in message and f"chmod 700 {root}" in message
            assert stat.S_IMODE(root.stat().st_mode) == mode  # refused, not silently repaired
        else:  # negative control: a private root starts
            DiskTier(root, FP).close()
            assert scan_disk_directory(root, FP) == []


def test_root_0777_is_refused_and_0700_starts(tmp_path: Path) -> None:
    root = make_root(tmp_path, 0o777)
    message = refusal(lambda: DiskTier(root, FP))
    assert repr(str(root)) in message and "mode 0777" in message and "chmod 700" in message
    os.chmod(root, 0o700)
    tier = DiskTier(root, FP)
    assert tier.write_async(name_of(1), b"fine") == OK and tier.flush(10)
    tier.close()


def test_root_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    os.chown(root, FOREIGN_UID, -1)
    for make in (lambda: DiskTier(root, FP), lambda: scan_disk_directory(root, FP)):
        message = refusal(make)
        assert str(root) in message and f"owned by uid {FOREIGN_UID}" in message and f"chown {os.geteuid()}" in message
    os.chown(root, os.geteuid(), -1)  # negative control: the same directory, owned by us
    DiskTier(root, FP).close()


def test_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = make_root(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    for make in (lambda: DiskTier(link, FP), lambda: scan_disk_directory(link, FP)):
        message = refusal(make)
        assert str(link) in message and "is a symlink" in message
    DiskTier(real, FP).close()  # negative control: the directory it points at is fine by itself


def plant_fan(root: Path, kind: str, elsewhere: Path) -> Path:
    """Puts an untrusted thing where the fan directory of name_of(1) belongs."""
    fan = file_of(root, name_of(1)).parent
    if kind == "symlink":
        elsewhere.mkdir(mode=0o700)
        fan.symlink_to(elsewhere, target_is_directory=True)
    elif kind == "file":
        fan.write_bytes(b"not a directory")
    else:
        fan.mkdir(mode=0o700)
        if kind == "foreign owner":
            os.chown(fan, FOREIGN_UID, -1)
        elif kind == "0777":
            os.chmod(fan, 0o777)
    return fan


FAN_PROBLEMS = {"symlink": "is a symlink", "file": "is not a directory", "foreign owner": f"uid {FOREIGN_UID}",
                "0777": "writable by group or others", "ours": None}


@pytest.mark.parametrize("kind", list(FAN_PROBLEMS))
def test_untrusted_fan_directory_is_refused_at_start(tmp_path: Path, kind: str) -> None:
    root = make_root(tmp_path)
    fan = plant_fan(root, kind, tmp_path / "elsewhere")
    if FAN_PROBLEMS[kind] is None:  # negative control: our own 0700 fan directory
        tier = DiskTier(root, FP)
        assert tier.write_async(name_of(1), b"ok") == OK and tier.flush(10) and read(tier, name_of(1), 2) == (OK, b"ok")
        tier.close()
        return
    for make in (lambda: DiskTier(root, FP), lambda: scan_disk_directory(root, FP)):
        message = refusal(make)
        assert str(fan) in message and FAN_PROBLEMS[kind] in message and "fan directory" in message
    if kind == "symlink":
        assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing was made through the link


def test_symlinked_chunk_file_is_never_read_or_removed(tmp_path: Path) -> None:
    elsewhere = DiskTier(tmp_path / "elsewhere", FP)
    secret = payload(3000, seed=11)
    elsewhere.write_async(name_of(2), secret)
    elsewhere.close()
    target = file_of(tmp_path / "elsewhere", name_of(2))
    os.utime(target, (1_000_000, 1_000_000))
    before = target.read_bytes()
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    link = file_of(root, name_of(2))
    link.parent.mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(target)
    # negative control: the target is a valid file for this very name, so following the link would be a hit
    assert read(elsewhere, name_of(2), 3000) == (OK, secret)
    assert read(tier, name_of(2), 3000)[0] == TierResult.fail(Failure.UNTRUSTED, "symlink")
    assert tier.counters["untrusted"] == 1 and tier.counters["reads"] == 0 and not tier.exists(name_of(2))
    tier.close()
    restarted = DiskTier(root, FP)  # the scan skips the link: neither an entry nor removed
    assert restarted.used_bytes == 0 and restarted.counters["untrusted"] == 1 and restarted.counters["corrupt"] == 0
    assert link.is_symlink() and scan_disk_directory(root, FP) == []
    data = payload(3000, seed=12)
    assert restarted.write_async(name_of(2), data) == OK and restarted.flush(10)  # renamed over the link
    assert not link.is_symlink() and read(restarted, name_of(2), 3000) == (OK, data)
    link.unlink()
    link.symlink_to(target)
    assert restarted.delete(name_of(2)) and not link.exists() and not link.is_symlink()  # the link went
    restarted.close()
    assert target.read_bytes() == before and target.stat().st_mtime == 1_000_000


def test_a_fifo_under_a_chunk_name_is_refused_without_blocking(tier: DiskTier) -> None:
    path = file_of(Path(tier.root), name_of(1))
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path)
    assert read(tier, name_of(1), 10)[0] == TierResult.fail(Failure.UNTRUSTED, "not a regular file")
    assert tier.counters["untrusted"] == 1 and not tier.exists(name_of(1))


def test_fan_directory_untrusted_later_fails_each_access_and_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, FP)
    data = payload(2000, seed=3)
    tier.write_async(name_of(1), data)
    tier.flush(10)
    fan = file_of(root, name_of(1)).parent
    decoy = tmp_path / "decoy"
    os.rename(fan, decoy)  # the decoy holds a valid file for name_of(1)
    fan.symlink_to(decoy, target_is_directory=True)
    decoy_file = decoy / file_of(root, name_of(1)).name
    os.utime(decoy_file, (1_000_000, 1_000_000))
    failure = TierResult.fail(Failure.UNTRUSTED, f"fan directory {fan.name} is a symlink")
    assert read(tier, name_of(1), 2000)[0] == failure
    done = Results()
    assert tier.write_async(name_of(1), payload(2000, seed=4), done) == OK
    assert tier.flush(10) and done.items == [failure]
    assert not tier.exists(name_of(1)) and not tier.delete(name_of(1))
    assert tier.counters["untrusted"] == 4 and tier.counters["reads"] == 0
    assert sorted(p.name for p in decoy.iterdir()) == [decoy_file.name]  # no temp file was made through the link
    assert decoy_file.read_bytes()[HEADER_BYTES:] == data and decoy_file.stat().st_mtime == 1_000_000
    fan.unlink()
    os.rename(decoy, fan)  # negative control: the same file in a real fan directory reads
    assert read(tier, name_of(1), 2000) == (OK, data)
    os.chown(fan, FOREIGN_UID, -1)
    assert read(tier, name_of(1), 2000)[0] == TierResult.fail(
        Failure.UNTRUSTED,
        f"fan directory {fan.name} is owned by uid {FOREIGN_UID}, not by this process's uid {os.geteuid()}")
    os.chown(fan, os.geteuid(), -1)
    os.chmod(fan, 0o770)
    assert read(tier, name_of(1), 2000)[0] == TierResult.fail(
        Failure.UNTRUSTED, f"fan directory {fan.name} is writable by group or others")
    os.chmod(fan, 0o700)
    assert read(tier, name_of(1), 2000) == (OK, data)
    tier.close()


def hold_lock(root: str, lock_name: str, ready, release) -> None:
    """Runs in another process: holds the lock until told to let go."""
    tier = DiskTier(root, FP, lock_name=lock_name)
    ready.set()
    release.wait(120)
    tier.close()


def test_second_engine_with_the_same_lock_name_is_refused_naming_the_holder(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=hold_lock, args=(str(root), "ns-r0", ready, release), daemon=True)
    holder.start()
    try:
        assert ready.wait(120)
        message = refusal(lambda: DiskTier(root, FP, lock_name="ns-r0"))
        assert f"held by pid {holder.pid} on host {socket.gethostname()}" in message and str(root) in message
        assert "'ns-r0'" in message
        other = DiskTier(root, FP, lock_name="ns-r1")  # negative control: another rank on the same directory
        assert other.holds_lock
        other.close()
    finally:
        release.set()
        holder.join(120)
    assert holder.exitcode == 0
    second = DiskTier(root, FP, lock_name="ns-r0")  # the holder closed: the lock is free
    assert second.holds_lock
    second.close()


def test_lock_in_one_process_file_contents_and_release(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    first = DiskTier(root, FP, lock_name="ns-r0")
    lock_file = root / ".lock-ns-r0"
    assert lock_file.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    assert stat.S_IMODE(lock_file.stat().st_mode) == 0o600
    assert f"held by pid {os.getpid()}" in refusal(lambda: DiskTier(root, FP, lock_name="ns-r0"))
    unlocked = DiskTier(root, FP)  # no lock name: tools and the scheduler's scan never contend
    unlocked.close()
    assert first.holds_lock and scan_disk_directory(root, FP) == []
    first.close()
    assert not first.holds_lock and lock_file.read_text() == ""
    first.close()  # idempotent
    again = DiskTier(root, FP, lock_name="ns-r0")
    again.close()
    for bad in ("", "../x", "a.b", "a/b", "x" * 201):
        with pytest.raises(ValueError, match="lock_name"):
            DiskTier(root, FP, lock_name=bad)


def test_a_planted_lock_file_is_refused(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    lock_file = root / ".lock-ns-r0"
    lock_file.symlink_to(tmp_path / "target")
    assert "symlink" in refusal(lambda: DiskTier(root, FP, lock_name="ns-r0"))
    assert not (tmp_path / "target").exists()  # O_NOFOLLOW: the link was not followed to create its target
    lock_file.unlink()
    lock_file.write_text("")
    os.chown(lock_file, FOREIGN_UID, -1)
    assert f"owner uid {FOREIGN_UID}" in refusal(lambda: DiskTier(root, FP, lock_name="ns-r0"))
    os.chown(lock_file, os.geteuid(), -1)  # negative control
    DiskTier(root, FP, lock_name="ns-r0").close()


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    tier = DiskTier(root, FP, lock_name="ns-r0")
    reader, writer = os.pipe()
    up_reader, up_writer = os.pipe()
    child = os.fork()
    if child == 0:  # without the fork hook it would hold an inherited copy of the lock's fd until it exits
        os.close(writer)
        os.write(up_writer, b"1")  # the fork hooks have run
        os.read(reader, 1)
        os._exit(0)
    os.close(reader)
    os.close(up_writer)
    try:
        assert os.read(up_reader, 1) == b"1"
        tier.close()
        again = DiskTier(root, FP, lock_name="ns-r0")  # fails if the child's copy still held the flock
        again.close()
    finally:
        os.close(writer)
        os.close(up_reader)
        os.waitpid(child, 0)


def make_temp(root: Path, name: str, pid: int, incarnation: str, age: float = 0.0) -> Path:
    path = file_of(root, name).parent / f"{name}.{pid}-{incarnation}.0.tmp"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(b"partial")
    when = time.time() - age
    os.utime(path, (when, when))
    return path


def plant_temps(root: Path) -> dict[str, Path]:
    """Temp files of rank 0's names (ours) and rank 1's (foreign), fresh and old, with live and dead writer pids."""
    return {
        "own fresh, live pid": make_temp(root, name_of(1), os.getpid(), disk_tier._INCARNATION),
        "own fresh, dead pid": make_temp(root, name_of(2), 2 ** 22 + 7, "00000000"),
        "own old": make_temp(root, name_of(3), os.getpid(), "00000000", age=3600),
        "foreign fresh, live pid": make_temp(root, name_of(4, rank=1), os.getpid(), disk_tier._INCARNATION),
        "foreign fresh, dead pid": make_temp(root, name_of(5, rank=1), 2 ** 22 + 7, "00000000"),
        "foreign old": make_temp(root, name_of(6, rank=1), os.getppid(), "12345678", age=3600),
    }


def rank0(name: str) -> bool:
    return name.endswith("-r0")


@pytest.mark.parametrize("holder", ["locked tier", "unlocked tier", "scheduler scan"])
def test_temp_files_own_ones_go_under_the_lock_foreign_ones_only_by_age(tmp_path: Path, holder: str) -> None:
    root = make_root(tmp_path)
    temps = plant_temps(root)
    counters = TierCounters()
    if holder == "scheduler scan":
        assert scan_disk_directory(root, FP, counters, owns=rank0) == []
    else:
        tier = DiskTier(root, FP, owns=rank0, lock_name="ns-r0" if holder == "locked tier" else None)
        counters = tier.counters
        tier.close()
    removable = {"own old", "foreign old"}
    if holder == "locked tier":  # our lock proves no live writer of our names: a crashed holder's leftovers
        removable |= {"own fresh, live pid", "own fresh, dead pid"}
    assert {what for what, path in temps.items() if not path.exists()} == removable
    assert counters["temp_removed"] == len(removable)


def test_a_writer_of_another_tier_keeps_its_fresh_temp_file_across_our_start(tmp_path: Path,
                                                                            fsync_gate: tuple[threading.Event, ...]
                                                                            ) -> None:
    root = make_root(tmp_path)
    file_of(root, name_of(1, rank=1)).parent.mkdir(mode=0o700)  # so the gated fsync is the temp file's, not the root's
    writer = DiskTier(root, FP, owns=lambda n: n.endswith("-r1"), lock_name="ns-r1")
    data = payload(5000, seed=8)
    done = Results()
    assert writer.write_async(name_of(1, rank=1), data, done) == OK
    assert fsync_gate[1].wait(5)  # its temp file exists, not yet renamed
    assert len(list(root.rglob("*.tmp"))) == 1
    starter = DiskTier(root, FP, owns=rank0, lock_name="ns-r0")
    assert starter.counters["temp_removed"] == 0 and len(list(root.rglob("*.tmp"))) == 1
    fsync_gate[0].set()
    assert writer.flush(10) and done.items == [OK] and read(writer, name_of(1, rank=1), 5000) == (OK, data)
    starter.close()
    writer.close()
