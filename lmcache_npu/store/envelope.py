"""The chunk envelope (DESIGN §7, issue 21): a 256-byte trailer right after a chunk object's payload, in the same arena
slot, that says whose chunk an object is (namespace, chunk hash, rank, length) and proves its bytes (a digest; with
the store secret a cryptographic digest and an HMAC no client without the secret can forge). A chunk read back from
disk or Mooncake is loaded only when its envelope verifies for the key and rank the reader asked for; anything else
is a named miss. Byte layout, digests and their cost: docs/storage.md §5a.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from typing import Callable, Optional, Union

import numpy as np
import xxhash

from ..platform.threads import in_background
from .keys import ChunkKey

logger = logging.getLogger(__name__)

ENVELOPE_BYTES = 256
ENVELOPE_VERSION = 1
MAGIC = b"LMCNPUEV"
MAX_CHUNK_HASH_BYTES = 80
MIN_SECRET_BYTES = 16
FLAG_MAC = 0x01
_DIGEST_FIELD = 32
_MAC_OFFSET = 160

_FIELDS = struct.Struct("<8sHHBBBB16sII Q80s32s")
assert _FIELDS.size == _MAC_OFFSET


# BLAKE3 hashes a large payload on several cores (its tree makes the digest independent of the thread count); a
# bounded share of the host, so the io and model threads keep theirs
_BLAKE3_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))
_BLAKE3_THREADED_FROM = 1 << 20


def _blake3(data: memoryview) -> bytes:
    import blake3  # a dependency of the package; imported here so the no-secret path never needs it

    # a thread that yields to compute (sealing for disk and puts) hashes alone: BLAKE3's helpers run at normal priority
    threads = _BLAKE3_THREADS if data.nbytes >= _BLAKE3_THREADED_FROM and not in_background() else 1
    return blake3.blake3(data, max_threads=threads).digest()


# id -> (name, digest function, cryptographic)
DIGESTS: dict[int, tuple[str, Callable[[memoryview], bytes], bool]] = {
    1: ("xxh3-128", xxhash.xxh3_128_digest, False),
    2: ("blake3", _blake3, True),
    3: ("blake2b", lambda data: hashlib.blake2b(data, digest_size=32).digest(), True),
    4: ("sha256", lambda data: hashlib.sha256(data).digest(), True),
}
DIGEST_IDS = {name: ident for ident, (name, _, _) in DIGESTS.items()}
# chosen by lmcache_npu/tools/bench/studies/envelope_bench.py on this project's machines: the fastest of each kind
DEFAULT_DIGEST = "xxh3-128"
DEFAULT_KEYED_DIGEST = "blake3"

Buffer = Union[memoryview, bytearray, np.ndarray]


class Sealer:
    """The digest choice and the optional store-wide secret. The secret never appears in repr or str."""

    def __init__(self, secret: Optional[bytes] = None, digest: Optional[str] = None) -> None:
        if secret is not None and not isinstance(secret, (bytes, bytearray)):  # a str would fail in hmac, later
            raise ValueError(f"the store secret must be bytes, got {type(secret).__name__}")
        if digest is not None and not isinstance(digest, str):
            raise ValueError(f"the envelope digest must be a name ({', '.join(DIGEST_IDS)}), got "
                             f"{type(digest).__name__}")
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the store secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        name = digest or (DEFAULT_KEYED_DIGEST if secret is not None else DEFAULT_DIGEST)
        if name not in DIGEST_IDS:
            raise ValueError(f"unknown envelope digest {name!r}; choose one of {', '.join(DIGEST_IDS)}")
        if secret is not None and not DIGESTS[DIGEST_IDS[name]][2]:
            raise ValueError(f"envelope digest {name!r} is not cryptographic: with a secret use blake3, blake2b or "
                             f"sha256")
        self._secret = None if secret is None else bytes(secret)
        self.digest_name = name
        self.digest_id = DIGEST_IDS[name]

    @property
    def keyed(self) -> bool:
        """A secret is configured: seals carry a MAC and verification demands one."""
        return self._secret is not None

    def mac(self, fields: bytes) -> bytes:
        if self._secret is None:
            raise RuntimeError("this sealer has no secret")
        return hmac.new(self._secret, fields, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"Sealer(digest={self.digest_name!r}, keyed={self.keyed})"


def sealed_bytes(object_bytes: int) -> int:
    """Bytes of a chunk object with its envelope: what disk files and Mooncake objects hold."""
    if isinstance(object_bytes, bool) or not isinstance(object_bytes, (int, np.integer)) or object_bytes < 0:
        raise ValueError(f"object_bytes must be a byte count >= 0, got {object_bytes!r}")
    return object_bytes + ENVELOPE_BYTES


def _bytes_of(view: Buffer, writable: bool = False) -> memoryview:
    if writable and isinstance(view, np.ndarray) and not view.flags.c_contiguous:
        raise ValueError("seal needs one contiguous buffer: reshape would write the envelope into a copy")
    try:
        out = memoryview(view).cast("B") if not isinstance(view, np.ndarray) else memoryview(view.reshape(-1))
    except TypeError:  # not a buffer (a str, None), or a strided memoryview
        raise ValueError(f"a sealed chunk must be a contiguous bytes-like buffer, got {type(view).__name__}") from None
    if writable and out.readonly:
        raise ValueError("seal needs a writable buffer")
    if out.nbytes < ENVELOPE_BYTES:
        raise ValueError(f"a sealed chunk needs at least {ENVELOPE_BYTES} bytes for its envelope, got {out.nbytes}")
    return out


def _key_fields(key: ChunkKey, rank: int) -> tuple[bytes, bytes]:
    # the public entry points take outside values: every wrong type is a ValueError, like every wrong value
    if not isinstance(key, tuple) or len(key) != 2:
        raise ValueError(f"a chunk key must be a ChunkKey (namespace, chunk_hash), got {type(key).__name__}")
    namespace_text, chunk_hash = key
    try:
        namespace = bytes.fromhex(namespace_text) if isinstance(namespace_text, str) else b""
    except ValueError:
        namespace = b""
    if len(namespace) != 16:
        raise ValueError(f"chunk key namespace must be 32 hex digits, got {namespace_text!r}")
    if not isinstance(chunk_hash, (bytes, bytearray)):
        raise ValueError(f"chunk key chunk_hash must be bytes, got {type(chunk_hash).__name__}")
    if len(chunk_hash) > MAX_CHUNK_HASH_BYTES:
        raise ValueError(f"chunk hash of {len(chunk_hash)} bytes is longer than the envelope holds "
                         f"({MAX_CHUNK_HASH_BYTES} bytes)")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < 2**32:
        raise ValueError(f"rank must be an integer that fits in 32 bits, got {rank!r}")
    return namespace, bytes(chunk_hash)


def _check_sealer(sealer: Sealer) -> None:
    if not isinstance(sealer, Sealer):
        raise ValueError(f"sealing and checking a chunk needs a Sealer, got {type(sealer).__name__}")


def seal(view: Buffer, key: ChunkKey, rank: int, sealer: Sealer) -> None:
    """Writes the envelope over the last `ENVELOPE_BYTES` of `view` (the payload is everything before them)."""
    data = _bytes_of(view, writable=True)
    namespace, chunk_hash = _key_fields(key, rank)
    _check_sealer(sealer)
    payload = data[:-ENVELOPE_BYTES]
    digest = DIGESTS[sealer.digest_id][1](payload)
    fields = _FIELDS.pack(MAGIC, ENVELOPE_VERSION, ENVELOPE_BYTES, sealer.digest_id, FLAG_MAC if sealer.keyed else 0,
                          len(chunk_hash), 0, namespace, rank, 0, payload.nbytes, chunk_hash, digest)
    mac = sealer.mac(fields) if sealer.keyed else bytes(32)
    data[-ENVELOPE_BYTES:] = fields + mac + bytes(ENVELOPE_BYTES - _MAC_OFFSET - 32)


def verify(view: Buffer, key: ChunkKey, rank: int, sealer: Sealer) -> Optional[str]:
    """None when `view`'s envelope is a valid seal of its payload for `key` and `rank`; otherwise why not: "magic",
    "version", "namespace", "key", "rank", "length", "digest", "mac", "mac missing" or "unexpected mac"."""
    data = _bytes_of(view)
    namespace, chunk_hash = _key_fields(key, rank)
    _check_sealer(sealer)
    trailer = bytes(data[-ENVELOPE_BYTES:])
    (magic, version, size, digest_id, flags, hash_len, reserved1, got_namespace, got_rank, reserved2, length,
     got_hash, digest) = _FIELDS.unpack_from(trailer)
    if magic != MAGIC:
        return "magic"
    if (version != ENVELOPE_VERSION or size != ENVELOPE_BYTES or reserved1 or reserved2 or flags & ~FLAG_MAC
            or any(trailer[_MAC_OFFSET + 32:])):
        return "version"
    if got_namespace != namespace:
        return "namespace"
    if hash_len != len(chunk_hash) or got_hash != chunk_hash.ljust(MAX_CHUNK_HASH_BYTES, b"\0"):
        return "key"
    if got_rank != rank:
        return "rank"
    if length != data.nbytes - ENVELOPE_BYTES:
        return "length"
    has_mac = bool(flags & FLAG_MAC)
    if sealer.keyed and not has_mac:
        return "mac missing"
    if has_mac and not sealer.keyed:
        return "unexpected mac"
    if sealer.keyed:
        if not hmac.compare_digest(sealer.mac(trailer[:_MAC_OFFSET]), trailer[_MAC_OFFSET:_MAC_OFFSET + 32]):
            return "mac"
        if digest_id not in DIGESTS or not DIGESTS[digest_id][2]:
            return "digest"  # a MAC over a digest anyone can collide proves nothing
    elif any(trailer[_MAC_OFFSET:_MAC_OFFSET + 32]):
        return "version"
    elif digest_id not in DIGESTS:
        return "digest"
    expected = DIGESTS[digest_id][1](data[:-ENVELOPE_BYTES])
    if digest != expected.ljust(_DIGEST_FIELD, b"\0"):
        return "digest"
    return None


def unseal(view: Buffer) -> None:
    """Voids `view`'s envelope (its magic): new bytes are coming, and until they are sealed again the slot names no
    chunk, so a restart that finds it mid-write never takes it for its old chunk."""
    data = _bytes_of(view, writable=True)
    data[-ENVELOPE_BYTES:-ENVELOPE_BYTES + len(MAGIC)] = bytes(len(MAGIC))


def unseal_at(trailer_address: int) -> None:
    """`unseal` of the trailer at `trailer_address` (a slot's address plus its object bytes): a store handed out
    pays a few bytes' write, not a view."""
    ctypes.memset(trailer_address, 0, len(MAGIC))


def sealed_names(trailers: np.ndarray) -> list[Optional[tuple[str, bytes, int]]]:
    """For each row of `trailers` (n x ENVELOPE_BYTES uint8: the trailers of n sealed slots) the (namespace, chunk
    hash, rank) its envelope names, None where it is no envelope of this format. A name proves nothing: `verify`
    checks the bytes against it."""
    if trailers.ndim != 2 or trailers.shape[1] != ENVELOPE_BYTES or trailers.dtype != np.uint8:
        raise ValueError(f"trailers must be an n x {ENVELOPE_BYTES} uint8 array, got {trailers.shape} "
                         f"{trailers.dtype}")
    sealed = (trailers[:, :len(MAGIC)] == np.frombuffer(MAGIC, np.uint8)).all(axis=1)  # C speed for 500K slots
    names: list[Optional[tuple[str, bytes, int]]] = [None] * len(trailers)
    for row in np.flatnonzero(sealed):
        (_, version, size, _, _, hash_len, _, namespace, rank, _, _, chunk_hash, _) = _FIELDS.unpack_from(
            trailers[row].tobytes())
        if version == ENVELOPE_VERSION and size == ENVELOPE_BYTES and hash_len <= MAX_CHUNK_HASH_BYTES:
            names[row] = (namespace.hex(), chunk_hash[:hash_len], rank)
    return names


_HINTS = {
    "mac missing": "the object has no MAC but this store has a secret: written by a client without the secret",
    "unexpected mac": "the object has a MAC but this store has no secret: set mooncake.secret_file or "
                      "LMCACHE_NPU_SECRET as its writer did",
    "mac": "the MAC does not match: written with another secret, or forged",
}


class RejectionLog:
    """One log line per rejected chunk, naming the tier, the storage name and the reason; past `per_second` lines a
    second the rest are counted and summed up in the next line (a flood of forged objects must not flood the log)."""

    def __init__(self, tier: str, per_second: int = 10) -> None:
        self.tier = tier
        self.per_second = per_second
        self._lock = threading.Lock()
        self._window = 0.0
        self._in_window = 0
        self._suppressed = 0

    def record(self, name: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= 1.0:
                self._window, self._in_window = now, 0
            if self._in_window >= self.per_second:
                self._suppressed += 1
                return
            self._in_window += 1
            suppressed, self._suppressed = self._suppressed, 0
        hint = _HINTS.get(why, "")
        logger.warning("%s: chunk %s rejected: %s%s%s", self.tier, name, why, f" ({hint})" if hint else "",
                       f"; {suppressed} more rejections not logged" if suppressed else "")
