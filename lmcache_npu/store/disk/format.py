"""The disk tier's file format, version 2: names, the 64-byte header, and what a file costs on disk.

File format, version 2
----------------------
Path: ``{dir}/{fan}/{name}.kv``. ``fan`` is the first two hex digits of ``sha256(name)``: a 256-way fan-out
subdirectory (mode 0700). It is taken from the digest, not from ``name[:2]``, because every name of one model
starts with the same 32-hex namespace, so ``name[:2]`` would put a whole model's files in a single directory.

A 64-byte little-endian header (``struct`` format ``<8sII16sQ12s12x``), then the payload:

    offset  size  field
    0       8     magic b"LMCNPUKV"
    8       4     format version, u32 (= 2)
    12      4     header size, u32 (= 64)
    16      16    layout fingerprint (``TransferPlan.fingerprint``)
    32      8     payload length in bytes, u64
    40      12    first 12 bytes of sha256(name.encode()): detects a file renamed or copied to another name
    52      12    reserved, zero
    64      ...   payload

The header holds what finds, trusts and bounds a file; it has no payload checksum. The payload is a sealed chunk
object (``envelope.py``) whose envelope digest is its one integrity check: the executor verifies it on every
promotion before the bytes are used, so a second hash here would only read every byte twice. Version 1 files (which
carried an xxh3-64 checksum at offset 40) are another version's: skipped at scan and refused on read, never removed.

The name digest stays: the scan and the tier know names, not keys, and it lets them judge a renamed or copied file
from its header alone (removed at scan instead of adopted, advertised to the index and rejected at its first read).

Writing: a temp file ``{name}.{pid}-{incarnation}.{seq}.tmp`` in the same subdirectory (O_CREAT|O_EXCL|O_NOFOLLOW,
mode 0600), header + payload, fsync, rename over the final name, fsync the subdirectory (batched per writer
thread). Readers only ever open final names, and rename is atomic, so a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from typing import Optional

HEADER_BYTES = 64
DISK_FORMAT_VERSION = 2
MAGIC = b"LMCNPUKV"
FINGERPRINT_BYTES = 16
NAME_DIGEST_BYTES = 12
HEADER_STRUCT = struct.Struct("<8sII16sQ12s12x")
assert HEADER_STRUCT.size == HEADER_BYTES
FILE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
LOCK_PREFIX = ".lock-"
# No dots: a name can never look like a temp file or climb out of the directory; short enough for the temp suffix.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
FAN_PATTERN = re.compile(r"[0-9a-f]{2}")
# Header problems of another layout's or another build's file: valid for its owner, so never removed by this tier.
FOREIGN_PROBLEMS = ("fingerprint", "version")


@dataclass(frozen=True)
class DiskEntry:
    name: str
    payload_bytes: int
    mtime: float


def name_digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def fan_of(name: str) -> str:
    return name_digest(name)[:1].hex()


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"disk tier name {name!r} is not 1-200 characters of [A-Za-z0-9_-]")


def check_fingerprint(fingerprint: bytes) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")


def check_lock_name(lock_name: Optional[str]) -> None:
    if lock_name is not None and (not isinstance(lock_name, str) or not NAME_PATTERN.fullmatch(lock_name)):
        raise ValueError(f"disk tier lock_name {lock_name!r} is not 1-200 characters of [A-Za-z0-9_-]")


@dataclass(frozen=True)
class Header:
    magic: bytes
    version: int
    header_bytes: int
    fingerprint: bytes
    payload_bytes: int
    name_digest: bytes

    @classmethod
    def describe(cls, name: str, fingerprint: bytes, payload_bytes: int) -> "Header":
        return cls(MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, fingerprint, payload_bytes,
                   name_digest(name)[:NAME_DIGEST_BYTES])

    @classmethod
    def unpack(cls, raw: bytes) -> "Header":
        return cls(*HEADER_STRUCT.unpack(raw))

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(self.magic, self.version, self.header_bytes, self.fingerprint, self.payload_bytes,
                                  self.name_digest)

    def problem(self, file_bytes: int, name: str, fingerprint: bytes) -> Optional[str]:
        """Why a file with this header cannot be `name` of this layout, or None."""
        if self.magic != MAGIC:
            return "magic"
        if self.version != DISK_FORMAT_VERSION:
            return "version"  # a newer (or older) build sharing the directory owns it
        if self.header_bytes != HEADER_BYTES:
            return "header size"
        # Before the name and length checks, so another layout's files are never judged (or removed) by us.
        if self.fingerprint != fingerprint:
            return "fingerprint"
        if self.name_digest != name_digest(name)[:NAME_DIGEST_BYTES]:
            return "name"
        if file_bytes < HEADER_BYTES + self.payload_bytes:
            return "short"
        if file_bytes > HEADER_BYTES + self.payload_bytes:
            return "size"
        return None


def read_header(fd: int) -> tuple[Optional[Header], os.stat_result]:
    """The header of an open file (None when the file is shorter than a header) and the file's stat."""
    stat = os.fstat(fd)
    raw = os.pread(fd, HEADER_BYTES, 0)
    return (Header.unpack(raw) if len(raw) == HEADER_BYTES else None), stat


def disk_chunks_for_capacity(disk_bytes: int, object_bytes: int) -> int:
    """How many chunk files of `object_bytes` (sealed) payload `disk_bytes` (per rank) holds."""
    return max(0, disk_bytes // (object_bytes + HEADER_BYTES))
