"""The chunk envelope: every field tampered in turn is named by `verify`, through the executor a tampered chunk is a
failed promotion and a miss (never loaded, never written through to disk), and the store secret's MAC cannot be
forged without it. Each comparison has a control: the untouched object verifies, and with verification switched
off the same tampered object is loaded with wrong bytes."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.store.routes import guard as executor_module
from lmcache_npu.store.disk import HEADER_BYTES, DiskTier
from lmcache_npu.store.envelope import ENVELOPE_BYTES, MAX_CHUNK_HASH_BYTES, Sealer, seal, sealed_bytes, verify
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.secret import SECRET_ENV, resolve_secret

from .fakes import Cluster, MemoryRemote, make_key

SECRET = b"s3cret-of-the-cluster-0123456789"
KEY = ChunkKey("ab" * 16, bytes(range(32)))


def sealed(size: int = 4000, key: ChunkKey = KEY, rank: int = 3, sealer: Sealer = Sealer(), seed: int = 0):
    data = np.random.default_rng(seed).integers(0, 256, sealed_bytes(size), dtype=np.uint8)
    seal(data, key, rank, sealer)
    return data


# (trailer offset, byte xor, reason without a secret, reason with one)
FIELDS = {
    "magic": (0, 0x01, "magic", "magic"),
    "version": (8, 0x02, "version", "version"),
    "envelope size": (10, 0x01, "version", "version"),
    "digest algorithm": (12, 0x05, "digest", "mac"),  # 1 -> 4 (sha256) and 2 -> 7 (unknown)
    "flags": (13, 0x01, "unexpected mac", "mac missing"),
    "chunk hash length": (14, 0x01, "key", "key"),
    "reserved byte": (15, 0x01, "version", "version"),
    "namespace": (16 + 7, 0x80, "namespace", "namespace"),
    "rank": (32, 0x01, "rank", "rank"),
    "payload length": (40, 0x01, "length", "length"),
    "chunk hash": (48 + 31, 0x10, "key", "key"),
    "chunk hash padding": (48 + 40, 0x10, "key", "key"),
    "payload digest": (128 + 3, 0x01, "digest", "mac"),
    "mac": (160 + 5, 0x01, "version", "mac"),
    "reserved tail": (200, 0x01, "version", "version"),
}


@pytest.mark.parametrize("keyed", [False, True], ids=["digest", "mac"])
@pytest.mark.parametrize("field", list(FIELDS))
def test_every_field_tampered_in_turn_is_named(field, keyed):
    sealer = Sealer(SECRET if keyed else None)
    data = sealed(sealer=sealer)
    assert verify(data, KEY, 3, sealer) is None  # control: the untouched object verifies
    offset, flip, plain, with_mac = FIELDS[field]
    data[-ENVELOPE_BYTES + offset] ^= flip
    assert verify(data, KEY, 3, sealer) == (with_mac if keyed else plain)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 20_000), position=st.data(), hash_len=st.integers(1, MAX_CHUNK_HASH_BYTES),
       keyed=st.booleans(), rank=st.integers(0, 2**32 - 1))
def test_a_flipped_payload_byte_anywhere_is_a_digest_mismatch(size, position, hash_len, keyed, rank):
    sealer = Sealer(SECRET if keyed else None)
    key = ChunkKey("cd" * 16, bytes(range(hash_len)))
    data = sealed(size, key, rank, sealer)
    assert verify(data, key, rank, sealer) is None
    at = position.draw(st.integers(0, size - 1))
    data[at] ^= 1 << position.draw(st.integers(0, 7))
    assert verify(data, key, rank, sealer) == "digest"


def test_the_wrong_key_rank_or_length_asked_for_is_named():
    data = sealed()
    assert verify(data, KEY, 2, Sealer()) == "rank"
    assert verify(data, KEY._replace(namespace="ac" * 16), 3, Sealer()) == "namespace"
    assert verify(data, KEY._replace(chunk_hash=KEY.chunk_hash + b"\0"), 3, Sealer()) == "key"
    assert verify(data[:-1], KEY, 3, Sealer()) == "magic"  # a short read shifts the trailer
    longer = np.concatenate([np.zeros(5, dtype=np.uint8), data])
    assert verify(longer, KEY, 3, Sealer()) == "length"


def test_a_forged_envelope_without_the_secret_does_not_verify_for_a_reader_with_it():
    keyed = Sealer(SECRET)
    data = sealed(sealer=keyed)
    forged = data.copy()
    forged[:100] = 7  # other bytes, and a digest recomputed over them: everything a forger without the secret can do
    from lmcache_npu.store.envelope import DIGESTS

    digest = DIGESTS[keyed.digest_id][1](memoryview(forged[:-ENVELOPE_BYTES]))
    forged[-ENVELOPE_BYTES + 128:-ENVELOPE_BYTES + 128 + len(digest)] = np.frombuffer(digest, dtype=np.uint8)
    assert verify(forged, KEY, 3, keyed) == "mac"
    assert verify(sealed(sealer=Sealer(b"another-secret-0123456789")), KEY, 3, keyed) == "mac"
    assert verify(sealed(sealer=Sealer()), KEY, 3, keyed) == "mac missing"
    assert verify(data, KEY, 3, Sealer()) == "unexpected mac"
    # control: the digest recomputation above is right (without a MAC the forgery would pass)
    plain = sealed(sealer=Sealer(digest="blake3"))
    plain[:100] = 7
    digest = DIGESTS[2][1](memoryview(plain[:-ENVELOPE_BYTES]))
    plain[-ENVELOPE_BYTES + 128:-ENVELOPE_BYTES + 128 + 32] = np.frombuffer(digest, dtype=np.uint8)
    assert verify(plain, KEY, 3, Sealer()) is None


@pytest.mark.parametrize("digest", ["xxh3-128", "blake3", "blake2b", "sha256"])
def test_every_digest_round_trips_and_a_reader_of_another_choice_still_verifies(digest):
    keyed = digest != "xxh3-128"
    writer = Sealer(SECRET if keyed else None, digest=digest)
    data = sealed(sealer=writer)
    assert verify(data, KEY, 3, Sealer(SECRET if keyed else None)) is None
    data[0] ^= 1
    assert verify(data, KEY, 3, writer) == "digest"


def test_a_keyed_seal_is_the_same_whatever_number_of_threads_hashes_it(monkeypatch):
    from lmcache_npu.store import envelope

    key = ChunkKey("c" * 32, bytes(range(32)))
    sealer = Sealer(secret=b"s" * 32)
    payload = np.random.default_rng(3).integers(0, 256, (2 << 20) + ENVELOPE_BYTES, dtype=np.uint8)
    seals = []
    for threads in (1, 4):
        monkeypatch.setattr(envelope, "_BLAKE3_THREADS", threads)
        data = payload.copy()
        seal(data, key, 0, sealer)
        seals.append(bytes(data[-ENVELOPE_BYTES:]))
    assert seals[0] == seals[1]
    data[5] ^= 1  # control: the threaded digest still sees one flipped byte
    assert verify(data, key, 0, sealer) == "digest"


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="chunk hash of 81 bytes is longer than the envelope holds"):
        seal(np.zeros(sealed_bytes(10), dtype=np.uint8), KEY._replace(chunk_hash=bytes(81)), 0, Sealer())
    with pytest.raises(ValueError, match="namespace must be 32 hex digits"):
        seal(np.zeros(sealed_bytes(10), dtype=np.uint8), KEY._replace(namespace="zz" * 16), 0, Sealer())
    with pytest.raises(ValueError, match="at least 256 bytes"):
        verify(np.zeros(100, dtype=np.uint8), KEY, 0, Sealer())
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Sealer(b"short")
    with pytest.raises(ValueError, match="not cryptographic"):
        Sealer(SECRET, digest="xxh3-128")
    assert "s3cret" not in repr(Sealer(SECRET))


# ---- the secret ---------------------------------------------------------------------------------------------------

def test_the_secret_comes_from_a_file_or_the_environment_and_is_never_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o600)
    assert resolve_secret(str(path), {}) == SECRET
    assert resolve_secret("", {SECRET_ENV: SECRET.decode()}) == SECRET
    assert resolve_secret("", {}) is None
    assert f"secret: configured (from file {path})" in caplog.text and f"from {SECRET_ENV}" in caplog.text
    assert SECRET.decode() not in caplog.text and "group or others" not in caplog.text
    os.chmod(path, 0o644)  # refused since issue 31 (tests/security/test_secret_file.py has the other rules)
    with pytest.raises(ValueError, match="accessible to group or others .*chmod 600"):
        resolve_secret(str(path), {})
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="mooncake.secret_file .* cannot be read"):
        resolve_secret(str(tmp_path / "absent"), {})
    path.write_bytes(b"  short \n")
    with pytest.raises(ValueError, match="mooncake.secret_file .* holds 5 bytes"):
        resolve_secret(str(path), {})
    with pytest.raises(ValueError, match=f"{SECRET_ENV} holds 3 bytes"):
        resolve_secret("", {SECRET_ENV: "abc"})


def test_the_secret_variable_is_not_taken_for_a_config_key():
    from lmcache_npu.config import NON_KEY_ENV

    assert "SECRET" in NON_KEY_ENV


# ---- through the executor -----------------------------------------------------------------------------------------

OBJECT_BYTES = 5000


def _tampered_cluster_pair(offset: int, reader_sealer=None, writer_sealer=None, tmp_path=None):
    """A writer instance stores chunks into a shared remote; the object of chunk 1, rank 0 gets one byte flipped
    at `offset` of its sealed bytes (negative: from the end); a reader instance (with a write-through disk when
    tmp_path is given) then loads."""
    shared: dict[str, bytes] = {}
    writer = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    for executor in writer.executors:
        executor.sealer = writer_sealer or Sealer()
    keys = [make_key(i) for i in range(3)]
    writer.store("w", keys)
    writer.close()
    if offset is not None:
        name = keys[1].storage_name(0)
        raw = bytearray(shared[name])
        raw[offset] ^= 0x01
        shared[name] = bytes(raw)
    disks = None if tmp_path is None else [DiskTier(tmp_path / "kv", b"E" * 16) for _ in range(2)]
    reader = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared), disks=disks,
                     disk_chunks=0 if disks is None else 8, disk_write_through=disks is not None)
    for executor in reader.executors:
        executor.sealer = reader_sealer or Sealer()
    return reader, keys, disks


@pytest.mark.parametrize("field", ["magic", "namespace", "rank", "chunk hash", "payload length", "payload digest",
                                   "payload"])
def test_a_tampered_object_is_a_failed_promotion_a_miss_and_never_persisted(field, tmp_path):
    offset = 17 if field == "payload" else OBJECT_BYTES + FIELDS[field][0]
    reader, keys, disks = _tampered_cluster_pair(offset, tmp_path=tmp_path)
    assert reader.load("r", keys) == 1  # chunk 0 only: chunk 1 is refused, and a hit is a prefix
    assert reader.index.counters["promote_failed"] == 1 and not reader.mismatches
    assert reader.remote.counters["rejected"] == 1
    loaded = {c.key for c in reader.issued if type(c).__name__ == "Load"}
    assert keys[1] not in loaded
    reader.settle()
    for disk in disks:
        assert disk.flush(10)
    assert not any(d.exists(keys[1].storage_name(r)) for r, d in enumerate(disks))  # never written through
    assert all(d.exists(keys[0].storage_name(r)) for r, d in enumerate(disks))  # control: the good one was
    reader.close()
    for disk in disks:
        disk.close()


@pytest.mark.parametrize("field", ["namespace", "payload digest", "payload"])
def test_negative_control_without_verification_the_tampered_chunk_loads_wrong_bytes(field, monkeypatch):
    offset = 17 if field == "payload" else OBJECT_BYTES + FIELDS[field][0]
    monkeypatch.setattr(executor_module, "verify", lambda *args: None)
    reader, keys, _ = _tampered_cluster_pair(offset)
    loaded = reader.load("r", keys)
    if field == "payload":
        assert loaded == 3 and reader.mismatches == [keys[1]]  # the flipped byte reached the device
    else:
        assert loaded == 3 and not reader.mismatches  # the envelope alone was wrong: loaded although misnamed
    assert reader.remote.counters["rejected"] == 0
    reader.close()


@pytest.mark.parametrize("reader_keyed", [True, False])
def test_a_secret_on_one_side_only_is_a_miss_with_a_clear_log_line(reader_keyed, caplog):
    caplog.set_level(logging.WARNING)
    keyed, plain = Sealer(SECRET), Sealer()
    reader, keys, _ = _tampered_cluster_pair(None, reader_sealer=keyed if reader_keyed else plain,
                                             writer_sealer=plain if reader_keyed else keyed)
    assert reader.load("r", keys) == 0 and not reader.mismatches
    assert reader.remote.counters["rejected"] >= 1
    if reader_keyed:
        assert "rejected: mac missing (the object has no MAC but this store has a secret" in caplog.text
    else:
        assert "rejected: unexpected mac (the object has a MAC but this store has no secret" in caplog.text
    reader.close()
    # control: the same secret on both sides loads every chunk
    reader, keys, _ = _tampered_cluster_pair(None, reader_sealer=Sealer(SECRET), writer_sealer=Sealer(SECRET))
    assert reader.load("r", keys) == 3 and not reader.mismatches
    reader.close()


def test_a_disk_file_with_a_bad_envelope_is_rejected_counted_and_dropped(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    keys, _ = _written_through(tmp_path)
    # rank 1's file of chunk 1 now claims rank 0 (a file renamed or copied from another rank: its disk header,
    # which covers only the name digest, is recomputed so the disk tier itself accepts it)
    source = DiskTier(tmp_path / "kv", b"E" * 16)
    out = np.zeros(sealed_bytes(OBJECT_BYTES), dtype=np.uint8)
    assert source.read_into(keys[1].storage_name(0), memoryview(out)).ok
    assert source.delete(keys[1].storage_name(1))
    assert source.write_async(keys[1].storage_name(1), memoryview(out)).ok and source.flush(10)
    source.close()
    reader, disks = _adopting_reader(tmp_path, keys)
    assert reader.load("r", keys) == 1 and not reader.mismatches
    assert disks[1].counters["rejected"] == 1 and disks[0].counters["rejected"] == 0
    assert f"disk: chunk {keys[1].storage_name(1)} rejected: rank" in caplog.text
    reader.settle()
    assert not disks[1].exists(keys[1].storage_name(1))  # the index dropped the useless copies
    reader.close()
    for disk in disks:
        disk.close()


def _written_through(tmp_path):
    """A writer instance of two ranks writes two chunks through to disk under tmp_path/kv and closes; their keys and
    the (closed) tiers that wrote them."""
    disks = [DiskTier(tmp_path / "kv", b"E" * 16) for _ in range(2)]
    writer = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=8, disk_write_through=True)
    keys = [make_key(i) for i in range(2)]
    writer.store("w", keys)
    for disk in disks:
        assert disk.flush(10)
    writer.close()
    for disk in disks:
        disk.close()
    return keys, disks


def _adopting_reader(tmp_path, keys):
    """A reader instance over the same directory that adopts `keys`' files; the reader and its ranks' tiers."""
    disks = [DiskTier(tmp_path / "kv", b"E" * 16) for _ in range(2)]
    reader = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=8)
    reader.index.adopt_disk(keys)
    return reader, disks


def _disk_pair_with_a_flipped_payload_byte(tmp_path):
    """Two chunks written through; one payload byte of rank 1's file of chunk 1 is flipped (the header stays valid:
    the disk tier hashes no payload); a reader instance adopts the files."""
    keys, writers = _written_through(tmp_path)
    path = writers[1].file_path(keys[1].storage_name(1))
    with open(path, "r+b") as file:
        file.seek(HEADER_BYTES + 17)
        byte = file.read(1)[0]
        file.seek(HEADER_BYTES + 17)
        file.write(bytes([byte ^ 0x40]))
    reader, disks = _adopting_reader(tmp_path, keys)
    return reader, keys, disks


def test_a_flipped_payload_byte_in_a_disk_file_is_a_refused_load(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    reader, keys, disks = _disk_pair_with_a_flipped_payload_byte(tmp_path)
    assert disks[1].counters["corrupt"] == 0  # the scan judged the header only, and it is intact
    assert reader.load("r", keys) == 1 and not reader.mismatches  # chunk 1 refused on every rank, never loaded
    loaded = {c.key for c in reader.issued if type(c).__name__ == "Load"}
    assert keys[1] not in loaded and keys[0] in loaded
    assert reader.index.counters["promote_failed"] == 1
    assert disks[1].counters["rejected"] == 1 and disks[0].counters["rejected"] == 0
    assert f"disk: chunk {keys[1].storage_name(1)} rejected: digest" in caplog.text
    reader.settle()
    assert not disks[1].exists(keys[1].storage_name(1))  # the index dropped the bad copy
    reader.close()
    for disk in disks:
        disk.close()


def test_negative_control_without_the_envelope_check_the_flipped_disk_byte_reaches_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(executor_module, "verify", lambda *args: None)
    reader, keys, disks = _disk_pair_with_a_flipped_payload_byte(tmp_path)
    reader.load("r", keys)
    assert reader.mismatches == [keys[1]]  # the disk tier served the wrong byte: only the envelope stops it
    assert disks[1].counters["rejected"] == 0
    reader.close()
    for disk in disks:
        disk.close()
