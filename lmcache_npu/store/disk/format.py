"""The disk tier's file format, version 2: names, the 64-byte header, and what a file costs on disk.

A chunk shard is `{dir}/{fan}/{name}.kv` (`fan`: two hex digits of sha256(name), a 256-way fan-out); its header holds
what finds, trusts and bounds the file and no payload checksum (the sealed object's envelope is the one check of its
bytes); it is written under a temp name and renamed, so a reader sees a whole file or none. The header's fields, why
the name digest stays, version 1 files and the write protocol: docs/storage.md §4.
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
