"""Local-disk (NVMe) tier, worker side: one file per chunk shard under one directory it does not take on trust.

File format, version 1
----------------------
Path: ``{dir}/{fan}/{name}.kv``. ``fan`` is the first two hex digits of ``sha256(name)``: a 256-way fan-out
subdirectory (mode 0700). It is taken from the digest, not from ``name[:2]``, because every name of one model
starts with the same 32-hex namespace, so ``name[:2]`` would put a whole model's files in a single directory.

A 64-byte little-endian header (``struct`` format ``<8sII16sQQ12s4x``), then the payload:

    offset  size  field
    0       8     magic b"LMCNPUKV"
    8       4     format version, u32 (= 1)
    12      4     header size, u32 (= 64)
    16      16    layout fingerprint (``keys.layout_fingerprint``)
    32      8     payload length in bytes, u64
    40      8     checksum, u64: xxhash.xxh3_64 of the payload
    48      12    first 12 bytes of sha256(name.encode()): detects a file renamed or copied to another name
    60      4     reserved, zero
    64      ...   payload

Writing: a temp file ``{name}.{pid}-{incarnation}.{seq}.tmp`` in the same subdirectory (O_CREAT|O_EXCL|O_NOFOLLOW,
mode 0600), header + payload, fsync, rename over the final name, fsync the subdirectory (batched per writer
thread). Readers only ever open final names, and rename is atomic, so a reader sees a whole file or none.

Trust
-----
At start (``DiskTier`` and ``scan_disk_directory``) the root and every existing fan directory must be a real
directory (checked with lstat, opened with O_NOFOLLOW), owned by the effective uid and writable by neither group
nor others; anything else is refused with a ValueError that says how to fix it. A missing root is created 0700.
With data parallelism the root is ``disk_path/dp<rank>``, and ``check_disk_parent`` (called before the root is made
or used) holds ``disk_path`` to the same rule, except that root may own it: a sticky bit is not enough.
After the start every operation works relative to the checked root's file descriptor; a fan directory is opened
with O_NOFOLLOW and checked again on each use, and files are opened with O_NOFOLLOW, so a symlink or a foreign
directory that appears later makes that one operation fail (reason "untrusted: ...", counter "untrusted") and is
never followed. A symlink where a chunk file belongs is never read or removed (a write renames over the link).

Lock: a tier given a ``lock_name`` holds an exclusive ``flock`` on ``{dir}/.lock-{lock_name}`` (0600, holding
"pid hostname") for its lifetime; a second tier with that name, in any process on any host that shares the
directory's locks, is refused naming the holder. `factory.build_executor` names it ``f"{namespace}-r{rank}"``.

Restart: the scan validates every header and the file length, removes invalid files, skips without touching files
of another layout fingerprint or format version (another model or build may share the directory), and returns
the rest oldest first. Temp files: one whose final name this tier owns, found while the tier holds its lock, is a
crashed earlier holder's leftover and is removed; any other is removed only once older than ten minutes (writer
pids prove nothing across containers and PID namespaces). Checksums are verified on every read, not at startup.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import secrets
import socket
import stat as stat_mode
import struct
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import xxhash

from .tier import OK, TierCounters, TierResult

logger = logging.getLogger(__name__)

HEADER_BYTES = 64
DISK_FORMAT_VERSION = 1
MAGIC = b"LMCNPUKV"
FINGERPRINT_BYTES = 16
NAME_DIGEST_BYTES = 12

_HEADER = struct.Struct("<8sII16sQQ12s4x")
assert _HEADER.size == HEADER_BYTES

_FILE_SUFFIX = ".kv"
_TEMP_SUFFIX = ".tmp"
_LOCK_PREFIX = ".lock-"
# No dots: a name can never look like a temp file or climb out of the directory; short enough for the temp suffix.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
_FAN_PATTERN = re.compile(r"[0-9a-f]{2}")
# A temp file this old is a leftover whoever wrote it (no write takes this long).
_TEMP_GRACE_SECONDS = 600.0
# Renames a writer makes durable with one directory fsync before it reports them.
_DIR_SYNC_BATCH = 32
# Keeps temp names of two processes with the same pid (other PID namespaces, a pid reused) apart.
_INCARNATION = secrets.token_hex(4)
# A header from another layout: valid for its owner, so never removed by this tier.
_FOREIGN = ("fingerprint", "version")  # another layout's or another build's file: valid for its owner, never removed
# Group or other write permission on a cache directory lets someone else plant or swap files.
_UNSAFE_MODE_BITS = 0o022
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a chunk name must not hang the reader; no effect on regular files.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOCK_INFO_BYTES = 4096

_REFUSAL_COUNTERS = {"closed": "closed_refused", "queue full": "queue_full", "capacity": "capacity_refused"}

# Lock fds this process holds: a child made by fork() closes its copies so the lock ends with its real holder.
_HELD_LOCK_FDS: set[int] = set()
_HELD_LOCK_FDS_GUARD = threading.Lock()


def _close_inherited_locks() -> None:
    for fd in list(_HELD_LOCK_FDS):
        try:
            os.close(fd)  # close, never LOCK_UN: unlocking would release the parent's lock too
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class _Untrusted(Exception):
    """A path inside the cache directory that must not be followed or used: a symlink, a foreign directory."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DiskEntry:
    name: str
    payload_bytes: int
    mtime: float


def _name_digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _fan_of(name: str) -> str:
    return _name_digest(name)[:1].hex()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(f"disk tier name {name!r} is not 1-200 characters of [A-Za-z0-9_-]")


def _check_fingerprint(fingerprint: bytes) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")


def _check_lock_name(lock_name: Optional[str]) -> None:
    if lock_name is not None and (not isinstance(lock_name, str) or not _NAME_PATTERN.fullmatch(lock_name)):
        raise ValueError(f"disk tier lock_name {lock_name!r} is not 1-200 characters of [A-Za-z0-9_-]")


def _byte_view(buffer: Any, writable: bool) -> memoryview:
    """A flat byte view of a caller's buffer; a non-contiguous or read-only one is a caller bug, not an I/O error."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("disk tier buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read_into needs a writable buffer")
    return view.cast("B")


# ---- trust in the directory -------------------------------------------------------------------------------------

def _directory_problem(info: os.stat_result) -> Optional[str]:
    """Why a directory with this (l)stat cannot hold the cache, or None."""
    if stat_mode.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat_mode.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    if info.st_mode & _UNSAFE_MODE_BITS:
        return "is writable by group or others"
    return None


def _untrusted_directory(what: str, path: str, info: os.stat_result, problem: str) -> ValueError:
    """The start-up refusal: names the path, its owner and mode, the rule, and the fix."""
    if problem == "is a symlink":
        fix = ("point disk_path at the real directory instead of a link" if what == "disk_path"
               else f"remove the link (`rm {path}`); the tier recreates its subdirectories")
    elif problem == "is not a directory":
        fix = ("choose a directory for disk_path" if what == "disk_path"
               else f"move it away (`mv {path} <elsewhere>`); the tier recreates its subdirectories")
    else:
        fix = f"run `chown {os.geteuid()} {path} && chmod 700 {path}` as its owner or root"
    return ValueError(
        f"disk tier {what} {path!r} {problem} (owner uid {info.st_uid}, mode {stat_mode.S_IMODE(info.st_mode):04o}):"
        f" a cache directory must be a real directory owned by the service user (uid {os.geteuid()}) and writable"
        f" by no one else, or other users could plant KV the engine would load; fix: {fix}")


def _open_root(root: str) -> int:
    """An fd of the checked root directory, created 0700 when missing; ValueError when it cannot be trusted."""
    created = False
    try:
        before = os.lstat(root)
    except FileNotFoundError:
        try:
            os.makedirs(root, mode=0o700)
            created = True
        except FileExistsError:
            pass  # another process created it meanwhile: checked like any existing directory
        before = os.lstat(root)
    problem = _directory_problem(before)
    if problem is not None:
        raise _untrusted_directory("disk_path", root, before, problem)
    fd = os.open(root, _DIR_FLAGS)
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or _directory_problem(after) is not None:
            raise ValueError(f"disk tier disk_path {root!r} was replaced while it was being checked; refusing it")
        if created:
            os.fchmod(fd, 0o700)  # exactly 0700 whatever the umask did to it
    except BaseException:
        os.close(fd)
        raise
    return fd


def _parent_problem(info: os.stat_result) -> Optional[str]:
    """Why a directory with this lstat cannot hold per-rank cache directories, or None: the root's rule, except
    that root may own it (root can replace anything anyway). A sticky bit does not make a shared directory safe:
    others can still create a rank's directory before its engine does."""
    if stat_mode.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat_mode.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {info.st_uid}, neither this process's uid {os.geteuid()} nor root"
    if info.st_mode & _UNSAFE_MODE_BITS:
        sticky = " (sticky or not)" if info.st_mode & stat_mode.S_ISVTX else ""
        return f"is writable by group or others{sticky}"
    return None


def check_disk_parent(parent: str) -> None:
    """Refuses a `disk_path` whose per-rank directories (`disk_path/dp<rank>`, data-parallel engines) others could
    rename away or create first; creates it 0700 when missing. Call it before a per-rank directory is made or used."""
    try:
        info = os.lstat(parent)
    except FileNotFoundError:
        try:
            os.makedirs(parent, mode=0o700)
        except FileExistsError:
            pass  # another engine created it meanwhile: checked like any existing directory
        info = os.lstat(parent)
    problem = _parent_problem(info)
    if problem is None:
        return
    if problem == "is a symlink":
        fix = "point disk_path at the real directory instead of a link"
    elif problem == "is not a directory":
        fix = "choose a directory for disk_path"
    else:
        fix = f"run `chown {os.geteuid()} {parent} && chmod 700 {parent}` as its owner or root"
    raise ValueError(
        f"disk tier disk_path {parent!r} {problem} (owner uid {info.st_uid}, mode "
        f"{stat_mode.S_IMODE(info.st_mode):04o}): with data parallelism it holds each engine's directory dp<rank>, "
        f"so it must be a real directory owned by the service user (uid {os.geteuid()}) or root and writable by no"
        f" one else, or other users could rename a rank's directory away or create it first; fix: {fix}")


def _open_fan_dir(root_fd: int, fan: str) -> int:
    """An fd of fan directory `fan` under the root, checked; _Untrusted when it is a link or foreign."""
    try:
        fd = os.open(fan, _DIR_FLAGS, dir_fd=root_fd)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        info = os.stat(fan, dir_fd=root_fd, follow_symlinks=False)
        raise _Untrusted(f"fan directory {fan} {_directory_problem(info) or 'changed while opened'}") from None
    try:
        problem = _directory_problem(os.fstat(fd))
        if problem is not None:
            raise _Untrusted(f"fan directory {fan} {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_chunk_file(fan_fd: int, file_name: str) -> int:
    """A read-only fd of a regular file, never through a symlink; _Untrusted otherwise."""
    try:
        fd = os.open(file_name, _READ_FLAGS, dir_fd=fan_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _Untrusted("symlink") from None
        raise
    try:
        if not stat_mode.S_ISREG(os.fstat(fd).st_mode):
            raise _Untrusted("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- the lock ---------------------------------------------------------------------------------------------------

def _lock_holder(fd: int) -> tuple[str, str]:
    """(pid, host) the holder wrote into the lock file; "unknown" while it has not written them yet."""
    try:
        parts = os.pread(fd, _LOCK_INFO_BYTES, 0).decode("utf-8", "replace").split()
    except OSError:
        parts = []
    if len(parts) == 2 and parts[0].isdigit():
        return parts[0], parts[1]
    return "unknown", "unknown"


def _acquire_lock(root_fd: int, root: str, lock_name: str) -> int:
    """Holds an exclusive flock on the root's lock file for `lock_name`; ValueError naming the holder if taken."""
    file_name = _LOCK_PREFIX + lock_name
    path = os.path.join(root, file_name)
    try:
        fd = os.open(file_name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"disk tier lock file {path!r} is a symlink; remove it (`rm {path}`)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat_mode.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            mode = stat_mode.S_IMODE(info.st_mode)
            raise ValueError(f"disk tier lock file {path!r} is not a regular file owned by uid {os.geteuid()} (owner"
                             f" uid {info.st_uid}, mode {mode:04o}); remove it (`rm {path}`)")
        if stat_mode.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, host = _lock_holder(fd)
            raise ValueError(
                f"disk tier {root!r} is in use for {lock_name!r}: lock {path!r} is held by pid {pid} on host {host}."
                f" Two engines (or two tiers of one process) must not serve the same namespace and rank from one"
                f" disk_path; stop the holder or give this engine its own disk_path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    with _HELD_LOCK_FDS_GUARD:
        _HELD_LOCK_FDS.add(fd)
    return fd


def _release_lock(fd: int) -> None:
    with _HELD_LOCK_FDS_GUARD:
        _HELD_LOCK_FDS.discard(fd)
    try:
        os.ftruncate(fd, 0)  # so a stale "pid host" never names a process that no longer holds it
    except OSError as error:
        logger.warning("disk tier: cannot clear the lock file: %s", error)
    os.close(fd)  # closing the only description releases the flock


@dataclass(frozen=True)
class _Header:
    magic: bytes
    version: int
    header_bytes: int
    fingerprint: bytes
    payload_bytes: int
    checksum: int
    name_digest: bytes

    @classmethod
    def describe(cls, name: str, fingerprint: bytes, payload: memoryview | bytes) -> "_Header":
        return cls(MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, fingerprint, len(payload),
                   xxhash.xxh3_64_intdigest(payload), _name_digest(name)[:NAME_DIGEST_BYTES])

    @classmethod
    def unpack(cls, raw: bytes) -> "_Header":
        return cls(*_HEADER.unpack(raw))

    def pack(self) -> bytes:
        return _HEADER.pack(self.magic, self.version, self.header_bytes, self.fingerprint, self.payload_bytes,
                            self.checksum, self.name_digest)

    def problem(self, file_bytes: int, name: str, fingerprint: bytes) -> Optional[str]:
        """Why a file with this header cannot be `name` of this layout, or None; the checksum is not looked at."""
        if self.magic != MAGIC:
            return "magic"
        if self.version != DISK_FORMAT_VERSION:
            return "version"  # a newer (or older) build sharing the directory owns it
        if self.header_bytes != HEADER_BYTES:
            return "header size"
        # Before the name and length checks, so another layout's files are never judged (or removed) by us.
        if self.fingerprint != fingerprint:
            return "fingerprint"
        if self.name_digest != _name_digest(name)[:NAME_DIGEST_BYTES]:
            return "name"
        if file_bytes < HEADER_BYTES + self.payload_bytes:
            return "short"
        if file_bytes > HEADER_BYTES + self.payload_bytes:
            return "size"
        return None


def _read_header(fd: int) -> tuple[Optional[_Header], os.stat_result]:
    """The header of an open file (None when the file is shorter than a header) and the file's stat."""
    stat = os.fstat(fd)
    raw = os.pread(fd, HEADER_BYTES, 0)
    return (_Header.unpack(raw) if len(raw) == HEADER_BYTES else None), stat


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _remove_quietly(file_name: str, dir_fd: int) -> None:
    try:
        os.unlink(file_name, dir_fd=dir_fd)
    except OSError:
        pass


def _remove_if_same(file_name: str, dir_fd: int, judged: os.stat_result) -> bool:
    """Unlinks `file_name` only if it is still the judged file (a writer may have renamed a new one over it)."""
    current = os.stat(file_name, dir_fd=dir_fd, follow_symlinks=False)
    if (current.st_dev, current.st_ino) != (judged.st_dev, judged.st_ino):
        return False
    os.unlink(file_name, dir_fd=dir_fd)
    return True


# ---- the restart scan -------------------------------------------------------------------------------------------

def _temp_removable(file_name: str, mtime: float, owns: Optional[Callable[[str], bool]], lock_held: bool) -> bool:
    """A temp file may go when it is old, or when its final name is ours and our lock proves no one writes it."""
    if time.time() - mtime > _TEMP_GRACE_SECONDS:
        return True
    final_name = file_name.split(".", 1)[0]
    return lock_held and bool(_NAME_PATTERN.fullmatch(final_name)) and (owns is None or owns(final_name))


def _scan_temp(fan_fd: int, path: str, item: os.DirEntry, owns: Optional[Callable[[str], bool]], lock_held: bool,
               found: TierCounters) -> None:
    try:
        if _temp_removable(item.name, item.stat(follow_symlinks=False).st_mtime, owns, lock_held):
            os.unlink(item.name, dir_fd=fan_fd)
            found.add("temp_removed")
    except FileNotFoundError:
        pass  # its writer renamed or removed it meanwhile
    except OSError as error:
        logger.warning("disk tier: cannot remove leftover %s (%s)", path, error)


def _scan_file(fan_fd: int, path: str, name: str, fan: str, fingerprint: bytes,
               found: TierCounters) -> Optional[DiskEntry]:
    file_name = name + _FILE_SUFFIX
    try:
        fd = _open_chunk_file(fan_fd, file_name)
        try:
            header, stat = _read_header(fd)
        finally:
            os.close(fd)
    except _Untrusted as untrusted:
        logger.warning("disk tier: %s: %s; skipped, never followed", path, untrusted.reason)
        found.add("untrusted")
        return None
    except OSError as error:
        logger.warning("disk tier: cannot inspect %s (%s); skipped", path, error)
        found.add("io_errors")
        return None
    problem = "short" if header is None else header.problem(stat.st_size, name, fingerprint)
    if problem is None and fan != _fan_of(name):
        problem = "misplaced"  # unreachable under this name, so it would only hold space
    if problem in _FOREIGN:
        found.add("foreign")
        return None
    if problem is not None:
        logger.warning("disk tier: removing invalid cache file %s (%s)", path, problem)
        try:
            _remove_if_same(file_name, fan_fd, stat)
        except OSError:
            pass  # gone already, or replaced by its writer: either way not ours to judge again now
        found.add("corrupt")
        return None
    assert header is not None
    return DiskEntry(name, header.payload_bytes, stat.st_mtime)


def _check_fan_dirs(root_fd: int, root: str) -> list[str]:
    """The fan directories under the root, each checked with lstat; ValueError naming the first untrusted one."""
    fans = []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if not _FAN_PATTERN.fullmatch(entry.name):
                continue
            info = entry.stat(follow_symlinks=False)
            problem = _directory_problem(info)
            if problem is not None:
                raise _untrusted_directory("fan directory", os.path.join(root, entry.name), info, problem)
            fans.append(entry.name)
    return sorted(fans)


def _scan_root(root_fd: int, root: str, layout_fingerprint: bytes, counters: Optional[TierCounters],
               owns: Optional[Callable[[str], bool]], lock_held: bool) -> list[DiskEntry]:
    found = TierCounters()
    entries: list[DiskEntry] = []
    for fan in _check_fan_dirs(root_fd, root):  # all checked before anything is removed
        fan_path = os.path.join(root, fan)
        try:
            fan_fd = _open_fan_dir(root_fd, fan)
        except _Untrusted as untrusted:  # swapped after the check above
            raise ValueError(f"disk tier fan directory {fan_path!r} changed during the start-up check "
                             f"({untrusted.reason}); refusing the directory") from None
        try:
            with os.scandir(fan_fd) as items:
                for item in items:
                    path = os.path.join(fan_path, item.name)
                    if item.is_symlink():
                        logger.warning("disk tier: %s is a symlink; left alone, never followed", path)
                        found.add("untrusted")
                        continue
                    if not item.is_file(follow_symlinks=False):
                        continue
                    if item.name.endswith(_TEMP_SUFFIX):
                        _scan_temp(fan_fd, path, item, owns, lock_held, found)
                        continue
                    name = item.name[:-len(_FILE_SUFFIX)]
                    if (item.name.endswith(_FILE_SUFFIX) and _NAME_PATTERN.fullmatch(name)
                            and (owns is None or owns(name))):
                        entry = _scan_file(fan_fd, path, name, fan, layout_fingerprint, found)
                        if entry is not None:
                            entries.append(entry)
        finally:
            os.close(fan_fd)
    entries.sort(key=lambda e: (e.mtime, e.name))
    summary = found.snapshot()
    logger.info("disk tier %s: %d entries (%d payload bytes); removed %d invalid and %d temp files; skipped %d of "
                "another layout and %d symlinks", root, len(entries), sum(e.payload_bytes for e in entries),
                summary.get("corrupt", 0), summary.get("temp_removed", 0), summary.get("foreign", 0),
                summary.get("untrusted", 0))
    if counters is not None:
        for key, amount in summary.items():
            counters.add(key, amount)
    return entries


def scan_disk_directory(path: str | os.PathLike[str], layout_fingerprint: bytes,
                        counters: Optional[TierCounters] = None,
                        owns: Optional[Callable[[str], bool]] = None) -> list[DiskEntry]:
    """What a restart finds under `path`, oldest first; removes invalid files and old temp files on the way.

    Takes no lock, so it removes only temp files older than the grace period: a fresh one may belong to a live
    writer of any container. Refuses (ValueError) a root or fan directory that is a symlink, foreign, or writable
    by group or others; creates a missing root 0700.

    `owns(name)`, when given, limits the scan to those names: files of other ranks or models sharing the directory
    are neither opened nor judged (their owners scan them). `counters`, when given, receives "corrupt" (invalid files
    removed), "foreign" (another layout's files skipped), "untrusted" (symlinks skipped), "temp_removed" and
    "io_errors"."""
    _check_fingerprint(layout_fingerprint)
    root = os.fspath(path)
    root_fd = _open_root(root)
    try:
        return _scan_root(root_fd, root, layout_fingerprint, counters, owns, lock_held=False)
    finally:
        os.close(root_fd)


@dataclass(eq=False)
class _PendingWrite:
    name: str
    data: Optional[bytes | memoryview]  # a copy, or the caller's buffer (copy=False); None once cancelled
    file_bytes: int
    done: Optional[Callable[[TierResult], None]]
    cancel_reason: str = ""  # "cancelled" (deleted) or "superseded" (written again) once it must not land
    counted: bool = True  # its bytes still count as pending


class DiskTier:
    """One file per chunk shard under `path`; writes go through a bounded queue to background writer threads.

    Never raises for I/O: failures are `TierResult.fail(...)` plus a counter. ValueError only for caller bugs
    (a name outside [A-Za-z0-9_-], a non-contiguous or read-only buffer) and, at construction, for a directory that
    cannot be trusted or a lock another tier holds. Do not call flush() or close() from a `done` callback: it runs
    on a writer thread."""

    def __init__(self, path: str | os.PathLike[str], layout_fingerprint: bytes, capacity_bytes: Optional[int] = None,
                 max_pending_bytes: int = 256 << 20, writer_threads: int = 1,
                 owns: Optional[Callable[[str], bool]] = None, lock_name: Optional[str] = None) -> None:
        """`owns(name)` says which valid files found at start are this tier's (count against its capacity): ranks
        and models may share one directory, each tier counting only its own names. None: every file.

        `lock_name` (e.g. f"{namespace}-r{rank}"): hold an exclusive lock on that name for the tier's lifetime, and
        treat fresh temp files of owned names as a crashed holder's leftovers; `owns` must then accept no name that a
        tier under another lock name writes. None: no lock (tools, tiers sharing names), temp files go only by age."""
        _check_fingerprint(layout_fingerprint)
        _check_lock_name(lock_name)
        if writer_threads < 1:
            raise ValueError("writer_threads must be at least 1")
        self.counters = TierCounters()
        self._root = os.fspath(path)
        self._fingerprint = bytes(layout_fingerprint)
        self._capacity = capacity_bytes
        self._max_pending = max_pending_bytes
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # writers wait here for items
        self._idle = threading.Condition(self._lock)  # flush waits here for the last done
        self._queue: deque[_PendingWrite] = deque()
        self._pending: dict[str, _PendingWrite] = {}  # latest accepted write of each name not yet on disk
        self._pending_bytes = 0  # header + payload bytes of accepted writes not yet finished
        self._unfinished = 0  # accepted writes whose `done` has not run yet
        self._closed = False
        self._stopping = False
        self._disk_full = False  # so a full disk logs one warning, not one per write
        self._warned_untrusted: set[str] = set()  # so a planted link logs once, not once per access
        self._temp_seq = itertools.count()
        self._root_fd = _open_root(self._root)
        # Reads stay valid after close(), so the checked root fd lives as long as the tier object.
        self._release_root = weakref.finalize(self, os.close, self._root_fd)
        self._lock_fd: Optional[int] = None
        try:
            if lock_name is not None:
                self._lock_fd = _acquire_lock(self._root_fd, self._root, lock_name)
            entries = _scan_root(self._root_fd, self._root, self._fingerprint, self.counters, owns,
                                 lock_held=self._lock_fd is not None)
        except BaseException:
            if self._lock_fd is not None:
                _release_lock(self._lock_fd)
                self._lock_fd = None
            self._release_root()
            raise
        self._on_disk: dict[str, int] = {e.name: HEADER_BYTES + e.payload_bytes for e in entries}
        self._used = sum(self._on_disk.values())
        self._threads = [threading.Thread(target=self._run_writer, name=f"lmcache-npu-disk-writer-{i}", daemon=True)
                         for i in range(writer_threads)]
        for thread in self._threads:
            thread.start()

    @property
    def root(self) -> str:
        return self._root

    @property
    def holds_lock(self) -> bool:
        """True while this tier holds its `lock_name` lock (from construction until close())."""
        with self._lock:
            return self._lock_fd is not None

    def file_path(self, name: str) -> str:
        """Where the chunk `name` lives (or would live) on disk."""
        return os.path.join(self._root, _fan_of(name), name + _FILE_SUFFIX)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def _open_fan(self, fan: str, create: bool) -> int:
        """The checked fan directory's fd (made 0700 first when `create`); _Untrusted, FileNotFoundError, OSError."""
        if create:
            try:
                os.mkdir(fan, 0o700, dir_fd=self._root_fd)
            except FileExistsError:
                pass
            else:
                os.fsync(self._root_fd)  # the new subdirectory's entry must survive a crash too
        return _open_fan_dir(self._root_fd, fan)

    def _untrusted(self, name: str, untrusted: _Untrusted) -> TierResult:
        self.counters.add("untrusted")
        path = self.file_path(name)
        with self._lock:
            first = path not in self._warned_untrusted
            self._warned_untrusted.add(path)
        if first:
            logger.warning("disk tier: refusing %s: %s; it is never followed", path, untrusted.reason)
        return TierResult.fail(f"untrusted: {untrusted.reason}")

    # ---- writes -------------------------------------------------------------------------------------------------

    def write_async(self, name: str, data: Any, done: Optional[Callable[[TierResult], None]] = None,
                    copy: bool = True) -> TierResult:
        """Copies `data` and queues it; OK when queued. `done` runs exactly once (writer thread) for queued writes
        only: OK, "disk full", "io: ...", "untrusted: ...", or "cancelled"/"superseded" when a delete or a newer
        write overtook it.

        `copy=False` queues a reference to `data` instead of a copy: the caller must keep those bytes unchanged
        until `done` has run (no writer reads them after that). It still counts against `max_pending_bytes`,
        which then bounds how much of the caller's memory waits on the disk."""
        _check_name(name)
        view = _byte_view(data, writable=False)
        file_bytes = HEADER_BYTES + view.nbytes
        refusal = self._refusal(file_bytes)  # unlocked pre-check, so a refused write costs no copy
        if refusal is None:
            payload = bytes(view) if copy else view
            with self._lock:
                refusal = self._refusal(file_bytes)
                if refusal is None:
                    self._enqueue(_PendingWrite(name, payload, file_bytes, done))
                    return OK
        self.counters.add(_REFUSAL_COUNTERS[refusal])
        return TierResult.fail(refusal)

    def _refusal(self, file_bytes: int) -> Optional[str]:
        if self._closed:
            return "closed"
        if self._pending_bytes + file_bytes > self._max_pending:
            return "queue full"
        if self._capacity is not None and self._used + self._pending_bytes + file_bytes > self._capacity:
            return "capacity"
        return None

    def _enqueue(self, item: _PendingWrite) -> None:
        previous = self._pending.get(item.name)
        if previous is not None:
            self._cancel(previous, "superseded")
        self._pending[item.name] = item
        self._queue.append(item)
        self._pending_bytes += item.file_bytes
        self._unfinished += 1
        self._work.notify()

    def _cancel(self, item: _PendingWrite, reason: str) -> None:
        """Under the lock: the write must not land; a writer already holding its bytes discards its temp file."""
        item.cancel_reason = reason
        item.data = None
        self._drop(item)

    def _drop(self, item: _PendingWrite) -> None:
        if item.counted:
            self._pending_bytes -= item.file_bytes
            item.counted = False
        if self._pending.get(item.name) is item:
            del self._pending[item.name]

    def _run_writer(self) -> None:
        landed: list[_PendingWrite] = []  # renamed, waiting for their directory fsync before `done`
        dirty_fans: set[str] = set()
        while True:
            with self._lock:
                while not self._queue and not landed and not self._stopping:
                    self._work.wait()
                item = self._queue.popleft() if self._queue else None
                payload = item.data if item is not None else None
            if item is None:
                if not landed:
                    return  # stopping, and nothing left to do
                self._report_landed(landed, dirty_fans)
                continue
            result = self._write_one(item, payload)
            if not result.ok:
                self._finish(item, result)
                continue
            landed.append(item)
            dirty_fans.add(_fan_of(item.name))
            if len(landed) >= _DIR_SYNC_BATCH:
                self._report_landed(landed, dirty_fans)

    def _write_one(self, item: _PendingWrite, payload: Optional[bytes | memoryview]) -> TierResult:
        if payload is None:
            return TierResult.fail(item.cancel_reason)
        temp = f"{item.name}.{os.getpid()}-{_INCARNATION}.{next(self._temp_seq)}{_TEMP_SUFFIX}"
        fan_fd: Optional[int] = None
        created = False
        try:
            fan_fd = self._open_fan(_fan_of(item.name), create=True)
            header = _Header.describe(item.name, self._fingerprint, payload).pack()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=fan_fd)
            created = True
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                # Checked and renamed under the lock that delete() holds while it unlinks: no resurrection.
                if not item.cancel_reason:
                    os.replace(temp, item.name + _FILE_SUFFIX, src_dir_fd=fan_fd, dst_dir_fd=fan_fd)
                    created = False
                    self._land(item)
            if created:
                _remove_quietly(temp, fan_fd)
                return TierResult.fail(item.cancel_reason)
            return OK
        except Exception as error:  # nothing may escape a writer thread
            if created and fan_fd is not None:
                _remove_quietly(temp, fan_fd)
            with self._lock:
                self._drop(item)
            if isinstance(error, _Untrusted):
                return self._untrusted(item.name, error)
            return self._write_failure(item.name, error)
        finally:
            if fan_fd is not None:
                os.close(fan_fd)

    def _land(self, item: _PendingWrite) -> None:
        """Under the lock, right after the rename."""
        self._used += item.file_bytes - self._on_disk.get(item.name, 0)
        self._on_disk[item.name] = item.file_bytes
        self._drop(item)
        self._disk_full = False
        self.counters.add("writes")
        self.counters.add("write_bytes", item.file_bytes - HEADER_BYTES)

    def _write_failure(self, name: str, error: Exception) -> TierResult:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.counters.add("disk_full")
            if not self._disk_full:
                logger.warning("disk tier %s is full; writes fail until space frees up", self._root)
            self._disk_full = True
            return TierResult.fail("disk full")
        self.counters.add("io_errors")
        if isinstance(error, OSError):
            logger.warning("disk tier: writing %s failed: %s", name, error)
            return TierResult.fail(f"io: {error.strerror or error}")
        logger.exception("disk tier: unexpected error writing %s", name)
        return TierResult.fail(f"io: {error!r}")

    def _report_landed(self, landed: list[_PendingWrite], dirty_fans: set[str]) -> None:
        for fan in dirty_fans:
            try:
                fan_fd = self._open_fan(fan, create=False)
                try:
                    os.fsync(fan_fd)
                finally:
                    os.close(fan_fd)
            except (OSError, _Untrusted) as error:  # the files are in place; only their crash safety is unsure
                self.counters.add("io_errors")
                logger.warning("disk tier: fsync of %s failed: %s", os.path.join(self._root, fan), error)
        for item in landed:
            self._finish(item, OK)
        landed.clear()
        dirty_fans.clear()

    def _finish(self, item: _PendingWrite, result: TierResult) -> None:
        if item.done is not None:
            try:
                item.done(result)
            except Exception:
                logger.exception("disk tier: done callback for %s raised", item.name)
        with self._lock:
            self._unfinished -= 1
            if self._unfinished == 0:
                self._idle.notify_all()

    # ---- reads and the rest -------------------------------------------------------------------------------------

    def read_into(self, name: str, out: Any) -> TierResult:
        """Fills `out` (its length must equal the stored payload's) from the pending copy or the file, checksum
        verified. On failure `out` holds garbage. A file of another layout is refused but left in place; a symlink
        or a foreign fan directory is refused ("untrusted: ...") and never followed."""
        _check_name(name)
        view = _byte_view(out, writable=True)
        with self._lock:
            item = self._pending.get(name)
            pending = item.data if item is not None else None
        if pending is not None:
            if len(pending) != view.nbytes:
                return TierResult.fail("corrupt: length")  # the caller's size is wrong; the pending write stands
            view[:] = pending
            self.counters.add("reads")
            self.counters.add("pending_reads")
            self.counters.add("read_bytes", view.nbytes)
            return OK
        fan_fd: Optional[int] = None
        fd: Optional[int] = None
        try:
            fan_fd = self._open_fan(_fan_of(name), create=False)
            fd = _open_chunk_file(fan_fd, name + _FILE_SUFFIX)
            return self._read_open_file(name, fan_fd, fd, view)
        except FileNotFoundError:
            self.counters.add("misses")
            with self._lock:
                self._forget(name)
            return TierResult.fail("miss")
        except _Untrusted as untrusted:
            return self._untrusted(name, untrusted)
        except OSError as error:
            self.counters.add("io_errors")
            logger.warning("disk tier: reading %s failed: %s", self.file_path(name), error)
            return TierResult.fail(f"io: {error.strerror or error}")
        finally:
            if fd is not None:
                os.close(fd)
            if fan_fd is not None:
                os.close(fan_fd)

    def _read_open_file(self, name: str, fan_fd: int, fd: int, view: memoryview) -> TierResult:
        header, stat = _read_header(fd)
        problem = "short" if header is None else header.problem(stat.st_size, name, self._fingerprint)
        if problem is None and header is not None and header.payload_bytes != view.nbytes:
            problem = "length"
        if problem is None and header is not None:
            filled = 0
            while filled < view.nbytes:
                got = os.preadv(fd, [view[filled:]], HEADER_BYTES + filled)
                if got == 0:
                    break
                filled += got
            if filled < view.nbytes:
                problem = "short"
            elif xxhash.xxh3_64_intdigest(view) != header.checksum:
                problem = "checksum"
        if problem is not None:
            return self._reject(name, fan_fd, stat, problem)
        with self._lock:
            if name not in self._on_disk:  # written by another process sharing the directory
                self._on_disk[name] = stat.st_size
                self._used += stat.st_size
        self.counters.add("reads")
        self.counters.add("read_bytes", view.nbytes)
        return OK

    def _reject(self, name: str, fan_fd: int, stat: os.stat_result, problem: str) -> TierResult:
        path = self.file_path(name)
        if problem in _FOREIGN:
            self.counters.add("foreign")
            logger.warning("disk tier: %s belongs to another layout or format version; left in place", path)
            return TierResult.fail(f"corrupt: {problem}")
        self.counters.add("corrupt")
        logger.warning("disk tier: removing corrupt cache file %s (%s)", path, problem)
        with self._lock:
            try:
                # Only the file we judged: a newer write may have renamed a good one over it meanwhile.
                if _remove_if_same(name + _FILE_SUFFIX, fan_fd, stat):
                    self._forget(name)
            except FileNotFoundError:
                self._forget(name)
            except OSError as error:
                self.counters.add("io_errors")
                logger.warning("disk tier: cannot remove %s: %s", path, error)
        return TierResult.fail(f"corrupt: {problem}")

    def _forget(self, name: str) -> None:
        self._used -= self._on_disk.pop(name, 0)

    def exists(self, name: str) -> bool:
        """A pending write, or a regular file under the name in a trusted fan directory (a symlink is not one)."""
        _check_name(name)
        with self._lock:
            if name in self._pending:
                return True
        try:
            fan_fd = self._open_fan(_fan_of(name), create=False)
        except _Untrusted as untrusted:
            self._untrusted(name, untrusted)
            return False
        except OSError:
            return False
        try:
            return stat_mode.S_ISREG(os.stat(name + _FILE_SUFFIX, dir_fd=fan_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False
        finally:
            os.close(fan_fd)

    def delete(self, name: str) -> bool:
        """Removes the file (a symlink under the name: the link, never its target) and cancels a pending write of
        `name`; True if either was there."""
        _check_name(name)
        with self._lock:
            item = self._pending.get(name)
            if item is not None:
                self._cancel(item, "cancelled")
            removed = self._unlink_locked(name)  # under the lock, so no writer renames between the cancel and this
            if removed:
                self._forget(name)
        if item is not None or removed:
            self.counters.add("deleted")
            return True
        return False

    def _unlink_locked(self, name: str) -> bool:
        try:
            fan_fd = self._open_fan(_fan_of(name), create=False)
        except FileNotFoundError:
            return False
        except _Untrusted as untrusted:
            self.counters.add("untrusted")
            logger.warning("disk tier: cannot delete %s: %s", self.file_path(name), untrusted.reason)
            return False
        except OSError as error:
            self.counters.add("io_errors")
            logger.warning("disk tier: cannot delete %s: %s", self.file_path(name), error)
            return False
        try:
            os.unlink(name + _FILE_SUFFIX, dir_fd=fan_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            self.counters.add("io_errors")
            logger.warning("disk tier: cannot delete %s: %s", self.file_path(name), error)
            return False
        finally:
            os.close(fan_fd)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every accepted write has finished and its `done` has run; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        """Refuses new writes, finishes the queued ones, stops the writer threads, releases the lock; idempotent.
        Reads still work afterwards."""
        with self._lock:
            self._closed = True
        self.flush()
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join()
        with self._lock:
            lock_fd, self._lock_fd = self._lock_fd, None
        if lock_fd is not None:
            _release_lock(lock_fd)
