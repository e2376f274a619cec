"""Local-disk (NVMe) tier, worker side: one file per chunk shard under one directory.

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

Writing: a temp file ``{name}.{pid}-{incarnation}.{seq}.tmp`` in the same subdirectory (O_CREAT|O_EXCL, mode
0600), header + payload, fsync, rename over the final name, fsync the subdirectory (batched per writer thread).
Readers only ever open final names, and rename is atomic, so a reader sees a whole file or none.

Restart: ``scan_disk_directory`` validates every header and the file length, removes invalid files and crash
leftovers (temp files whose writer process is gone or that are older than ten minutes), skips without touching
files of another layout fingerprint or format version (another model or build may share the
directory), and returns the rest oldest first.
Checksums are verified on every read, not at startup.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import re
import secrets
import struct
import threading
import time
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
# No dots: a name can never look like a temp file or climb out of the directory; short enough for the temp suffix.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,200}")
_FAN_PATTERN = re.compile(r"[0-9a-f]{2}")
# A temp file this old is a leftover even if a process with its writer's pid is alive (no write takes this long).
_TEMP_GRACE_SECONDS = 600.0
# Renames a writer makes durable with one directory fsync before it reports them.
_DIR_SYNC_BATCH = 32
# Tells this process's temp files from those of a crashed process that had the same pid (common in containers).
_INCARNATION = secrets.token_hex(4)
# A header from another layout: valid for its owner, so never removed by this tier.
_FOREIGN = ("fingerprint", "version")  # another layout's or another build's file: valid for its owner, never removed

_REFUSAL_COUNTERS = {"closed": "closed_refused", "queue full": "queue_full", "capacity": "capacity_refused"}


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


def _byte_view(buffer: Any, writable: bool) -> memoryview:
    """A flat byte view of a caller's buffer; a non-contiguous or read-only one is a caller bug, not an I/O error."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("disk tier buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read_into needs a writable buffer")
    return view.cast("B")


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


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _writer_alive(pid: int, incarnation: str) -> bool:
    if pid == os.getpid():
        return incarnation == _INCARNATION
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to another user
    return True


def _temp_is_stale(file_name: str, mtime: float) -> bool:
    """A temp file is a crash leftover unless its writer may still be writing it."""
    parts = file_name.split(".")
    if time.time() - mtime > _TEMP_GRACE_SECONDS or len(parts) != 4:
        return True
    pid_text, _, incarnation = parts[1].partition("-")
    return not pid_text.isdigit() or not _writer_alive(int(pid_text), incarnation)


def _scan_file(path: str, name: str, fan: str, fingerprint: bytes, found: TierCounters) -> Optional[DiskEntry]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header, stat = _read_header(fd)
        finally:
            os.close(fd)
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
        _remove_quietly(path)
        found.add("corrupt")
        return None
    assert header is not None
    return DiskEntry(name, header.payload_bytes, stat.st_mtime)


def scan_disk_directory(path: str | os.PathLike[str], layout_fingerprint: bytes,
                        counters: Optional[TierCounters] = None,
                        owns: Optional[Callable[[str], bool]] = None) -> list[DiskEntry]:
    """What a restart finds under `path`, oldest first; removes invalid files and crash leftovers on the way.

    `owns(name)`, when given, limits the scan to those names: files of other ranks or models sharing the directory
    are neither opened nor judged (their owners scan them). `counters`, when given, receives "corrupt" (invalid files
    removed), "foreign" (another layout's files skipped), "temp_removed" and "io_errors"."""
    _check_fingerprint(layout_fingerprint)
    root = os.fspath(path)
    os.makedirs(root, mode=0o700, exist_ok=True)
    found = TierCounters()
    entries: list[DiskEntry] = []
    for fan_dir in os.scandir(root):
        if not (_FAN_PATTERN.fullmatch(fan_dir.name) and fan_dir.is_dir(follow_symlinks=False)):
            continue
        for item in os.scandir(fan_dir.path):
            if not item.is_file(follow_symlinks=False):
                continue
            if item.name.endswith(_TEMP_SUFFIX):
                try:
                    if _temp_is_stale(item.name, item.stat(follow_symlinks=False).st_mtime):
                        os.unlink(item.path)
                        found.add("temp_removed")
                except FileNotFoundError:
                    pass  # its writer renamed or removed it meanwhile
                except OSError as error:
                    logger.warning("disk tier: cannot remove leftover %s (%s)", item.path, error)
                continue
            name = item.name[:-len(_FILE_SUFFIX)]
            if item.name.endswith(_FILE_SUFFIX) and _NAME_PATTERN.fullmatch(name) and (owns is None or owns(name)):
                entry = _scan_file(item.path, name, fan_dir.name, layout_fingerprint, found)
                if entry is not None:
                    entries.append(entry)
    entries.sort(key=lambda e: (e.mtime, e.name))
    summary = found.snapshot()
    logger.info("disk tier %s: %d entries (%d payload bytes); removed %d invalid and %d temp files; skipped %d of "
                "another layout", root, len(entries), sum(e.payload_bytes for e in entries), summary.get("corrupt", 0),
                summary.get("temp_removed", 0), summary.get("foreign", 0))
    if counters is not None:
        for key, amount in summary.items():
            counters.add(key, amount)
    return entries


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
    (a name outside [A-Za-z0-9_-], a non-contiguous or read-only buffer). Do not call flush() or close() from a
    `done` callback: it runs on a writer thread."""

    def __init__(self, path: str | os.PathLike[str], layout_fingerprint: bytes, capacity_bytes: Optional[int] = None,
                 max_pending_bytes: int = 256 << 20, writer_threads: int = 1,
                 owns: Optional[Callable[[str], bool]] = None) -> None:
        """`owns(name)` says which valid files found at start are this tier's (count against its capacity): ranks
        and models may share one directory, each tier counting only its own names. None: every file."""
        _check_fingerprint(layout_fingerprint)
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
        self._temp_seq = itertools.count()
        entries = scan_disk_directory(self._root, self._fingerprint, self.counters, owns)
        self._on_disk: dict[str, int] = {e.name: HEADER_BYTES + e.payload_bytes for e in entries}
        self._used = sum(self._on_disk.values())
        self._threads = [threading.Thread(target=self._run_writer, name=f"lmcache-npu-disk-writer-{i}", daemon=True)
                         for i in range(writer_threads)]
        for thread in self._threads:
            thread.start()

    @property
    def root(self) -> str:
        return self._root

    def file_path(self, name: str) -> str:
        """Where the chunk `name` lives (or would live) on disk."""
        return self._path(name)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def _path(self, name: str) -> str:
        return os.path.join(self._root, _fan_of(name), name + _FILE_SUFFIX)

    # ---- writes -------------------------------------------------------------------------------------------------

    def write_async(self, name: str, data: Any, done: Optional[Callable[[TierResult], None]] = None,
                    copy: bool = True) -> TierResult:
        """Copies `data` and queues it; OK when queued. `done` runs exactly once (writer thread) for queued writes
        only: OK, "disk full", "io: ...", or "cancelled"/"superseded" when a delete or a newer write overtook it.

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
        dirty_dirs: set[str] = set()
        while True:
            with self._lock:
                while not self._queue and not landed and not self._stopping:
                    self._work.wait()
                item = self._queue.popleft() if self._queue else None
                payload = item.data if item is not None else None
            if item is None:
                if not landed:
                    return  # stopping, and nothing left to do
                self._report_landed(landed, dirty_dirs)
                continue
            result, fan_dir = self._write_one(item, payload)
            if not result.ok:
                self._finish(item, result)
                continue
            landed.append(item)
            dirty_dirs.add(fan_dir)
            if len(landed) >= _DIR_SYNC_BATCH:
                self._report_landed(landed, dirty_dirs)

    def _write_one(self, item: _PendingWrite, payload: Optional[bytes | memoryview]) -> tuple[TierResult, str]:
        if payload is None:
            return TierResult.fail(item.cancel_reason), ""
        fan_dir = os.path.join(self._root, _fan_of(item.name))
        temp = os.path.join(fan_dir, f"{item.name}.{os.getpid()}-{_INCARNATION}.{next(self._temp_seq)}{_TEMP_SUFFIX}")
        created = False
        try:
            self._ensure_fan_dir(fan_dir)
            header = _Header.describe(item.name, self._fingerprint, payload).pack()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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
                    os.replace(temp, self._path(item.name))
                    created = False
                    self._land(item)
            if created:
                _remove_quietly(temp)
                return TierResult.fail(item.cancel_reason), ""
            return OK, fan_dir
        except Exception as error:  # nothing may escape a writer thread
            if created:
                _remove_quietly(temp)
            with self._lock:
                self._drop(item)
            return self._write_failure(item.name, error), ""

    def _ensure_fan_dir(self, fan_dir: str) -> None:
        try:
            os.mkdir(fan_dir, 0o700)
        except FileExistsError:
            return
        _sync_directory(self._root)  # the new subdirectory's entry must survive a crash too

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

    def _report_landed(self, landed: list[_PendingWrite], dirty_dirs: set[str]) -> None:
        for fan_dir in dirty_dirs:
            try:
                _sync_directory(fan_dir)
            except OSError as error:  # the files are in place and readable; only their crash safety is unsure
                self.counters.add("io_errors")
                logger.warning("disk tier: fsync of %s failed: %s", fan_dir, error)
        for item in landed:
            self._finish(item, OK)
        landed.clear()
        dirty_dirs.clear()

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
        verified. On failure `out` holds garbage. A file of another layout is refused but left in place."""
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
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.counters.add("misses")
            with self._lock:
                self._forget(name)
            return TierResult.fail("miss")
        except OSError as error:
            self.counters.add("io_errors")
            return TierResult.fail(f"io: {error.strerror or error}")
        try:
            return self._read_open_file(name, path, fd, view)
        except OSError as error:
            self.counters.add("io_errors")
            logger.warning("disk tier: reading %s failed: %s", path, error)
            return TierResult.fail(f"io: {error.strerror or error}")
        finally:
            os.close(fd)

    def _read_open_file(self, name: str, path: str, fd: int, view: memoryview) -> TierResult:
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
            return self._reject(name, path, stat, problem)
        with self._lock:
            if name not in self._on_disk:  # written by another process sharing the directory
                self._on_disk[name] = stat.st_size
                self._used += stat.st_size
        self.counters.add("reads")
        self.counters.add("read_bytes", view.nbytes)
        return OK

    def _reject(self, name: str, path: str, stat: os.stat_result, problem: str) -> TierResult:
        if problem in _FOREIGN:
            self.counters.add("foreign")
            logger.warning("disk tier: %s belongs to another layout or format version; left in place", path)
            return TierResult.fail(f"corrupt: {problem}")
        self.counters.add("corrupt")
        logger.warning("disk tier: removing corrupt cache file %s (%s)", path, problem)
        with self._lock:
            try:
                current = os.stat(path)
                # Only the file we judged: a newer write may have renamed a good one over it meanwhile.
                if (current.st_dev, current.st_ino) == (stat.st_dev, stat.st_ino):
                    os.unlink(path)
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
        _check_name(name)
        with self._lock:
            if name in self._pending:
                return True
        return os.path.isfile(self._path(name))

    def delete(self, name: str) -> bool:
        """Removes the file and cancels a pending write of `name`; True if either was there."""
        _check_name(name)
        path = self._path(name)
        with self._lock:
            item = self._pending.get(name)
            if item is not None:
                self._cancel(item, "cancelled")
            try:
                os.unlink(path)  # under the lock, so no writer renames between the cancel and this
                removed = True
            except FileNotFoundError:
                removed = False
            except OSError as error:
                removed = False
                self.counters.add("io_errors")
                logger.warning("disk tier: cannot delete %s: %s", path, error)
            if removed:
                self._forget(name)
        if item is not None or removed:
            self.counters.add("deleted")
            return True
        return False

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every accepted write has finished and its `done` has run; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        """Refuses new writes, finishes the queued ones, stops the writer threads; idempotent."""
        with self._lock:
            self._closed = True
        self.flush()
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join()
