"""Local-disk (NVMe) tier, worker side: one file per chunk shard under a directory taken on trust only after it is
checked, a write-behind queue, reads straight into arena slots, deletes (the file format in `format`, the directory
checks in `trust`, the lock in `lock`, the restart scan in `scan`). It stores and returns bytes and hashes none: the
envelope, verified by the executor on every promotion, is the one check of them. Trust, the lock, restart and
integrity: docs/storage.md §4.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import stat as stat_mode
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ...platform import threads as platform_threads
from ..tier import OK, Failure, TierCounters, TierResult
from .format import (FILE_SUFFIX, FOREIGN_PROBLEMS, HEADER_BYTES, TEMP_SUFFIX, Header, check_fingerprint,
                     check_lock_name, check_name, fan_of, read_header)
from .lock import acquire_lock, release_lock
from .scan import scan_root
from .trust import Untrusted, open_chunk_file, open_fan_dir, open_root, remove_if_same, remove_quietly, write_all
from ..metrics import Metric

logger = logging.getLogger(__name__)

# Renames a writer makes durable with one directory fsync before it reports them.
_DIR_SYNC_BATCH = 32
# Keeps temp names of two processes with the same pid (other PID namespaces, a pid reused) apart.
_INCARNATION = secrets.token_hex(4)
_REFUSAL_COUNTERS = {Failure.CLOSED: Metric.CLOSED_REFUSED, Failure.QUEUE_FULL: Metric.QUEUE_FULL,
                     Failure.CAPACITY: Metric.CAPACITY_REFUSED}


def _byte_view(buffer: Any, writable: bool) -> memoryview:
    """A flat byte view of a caller's buffer; a non-contiguous or read-only one is a caller bug, not an I/O error."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("disk tier buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read_into needs a writable buffer")
    return view.cast("B")


@dataclass(eq=False)
class _PendingWrite:
    name: str
    data: Optional[bytes | memoryview]  # a copy, or the caller's buffer (copy=False); None once cancelled
    file_bytes: int
    done: Optional[Callable[[TierResult], None]]
    cancel_reason: Optional[Failure] = None  # CANCELLED (deleted) or SUPERSEDED (written again): it must not land
    counted: bool = True  # its bytes still count as pending
    queued_at: float = 0.0  # time.monotonic() when queued: the rescuer writes what waited the yield bound


class DiskTier:
    """One file per chunk shard under `path`; writes go through a bounded queue to background writer threads.

    Never raises for I/O: failures are `TierResult.fail(...)` plus a counter. ValueError only for caller bugs
    (a name outside [A-Za-z0-9_-], a non-contiguous or read-only buffer) and, at construction, for a directory that
    cannot be trusted or a lock another tier holds. Do not call flush() or close() from a `done` callback: it runs
    on a writer thread."""

    def __init__(self, path: str | os.PathLike[str], layout_fingerprint: bytes, capacity_bytes: Optional[int] = None,
                 max_pending_bytes: int = 256 << 20, writer_threads: int = 1,
                 owns: Optional[Callable[[str], bool]] = None, lock_name: Optional[str] = None,
                 yields: bool = False) -> None:
        """`owns(name)` says which valid files found at start are this tier's (count against its capacity): ranks
        and models may share one directory, each tier counting only its own names. None: every file.

        `lock_name` (e.g. f"{namespace}-r{rank}"): hold an exclusive lock on that name for the tier's lifetime, and
        treat fresh temp files of owned names as a crashed holder's leftovers; `owns` must then accept no name that a
        tier under another lock name writes. None: no lock (tools, tiers sharing names), temp files go only by age.

        `yields`: the writer threads yield to compute (`platform/threads.py`): nothing waits for a write but the
        queue's bound, and the copy into the page cache and the fsync must not take a core from the model."""
        check_fingerprint(layout_fingerprint)
        check_lock_name(lock_name)
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
        self._urgent: deque[_PendingWrite] = deque()  # writes something waits for: the rescuer takes them at once
        self._pending: dict[str, _PendingWrite] = {}  # latest accepted write of each name not yet on disk
        self._pending_bytes = 0  # header + payload bytes of accepted writes not yet finished
        self._unfinished = 0  # accepted writes whose `done` has not run yet
        self._closed = False
        self._stopping = False
        self._disk_full = False  # so a full disk logs one warning, not one per write
        self._warned_untrusted: set[str] = set()  # so a planted link logs once, not once per access
        self._temp_seq = itertools.count()
        self._root_fd = open_root(self._root)
        # Reads stay valid after close(), so the checked root fd lives as long as the tier object.
        self._release_root = weakref.finalize(self, os.close, self._root_fd)
        self._lock_fd: Optional[int] = None
        try:
            if lock_name is not None:
                self._lock_fd = acquire_lock(self._root_fd, self._root, lock_name)
            entries = scan_root(self._root_fd, self._root, self._fingerprint, self.counters, owns,
                                 lock_held=self._lock_fd is not None)
        except BaseException:
            if self._lock_fd is not None:
                release_lock(self._lock_fd)
                self._lock_fd = None
            self._release_root()
            raise
        self._on_disk: dict[str, int] = {e.name: HEADER_BYTES + e.payload_bytes for e in entries}
        self._used = sum(self._on_disk.values())
        self._yields = yields
        self._threads = [threading.Thread(target=self._run_writer, name=f"lmcache-npu-disk-writer-{i}", daemon=True)
                         for i in range(writer_threads)]
        if yields:  # a write that waited the yield bound for an idle core runs at normal priority (platform/threads)
            self._threads.append(threading.Thread(target=self._run_writer, args=(True,), daemon=True,
                                                  name="lmcache-npu-disk-writer-rescuer"))
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
        return os.path.join(self._root, fan_of(name), name + FILE_SUFFIX)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def _open_fan(self, fan: str, create: bool) -> int:
        """The checked fan directory's fd (made 0700 first when `create`); Untrusted, FileNotFoundError, OSError."""
        if create:
            try:
                os.mkdir(fan, 0o700, dir_fd=self._root_fd)
            except FileExistsError:
                pass
            else:
                os.fsync(self._root_fd)  # the new subdirectory's entry must survive a crash too
        return open_fan_dir(self._root_fd, fan)

    def _untrusted(self, name: str, untrusted: Untrusted) -> TierResult:
        self.counters.add(Metric.UNTRUSTED)
        path = self.file_path(name)
        with self._lock:
            first = path not in self._warned_untrusted
            self._warned_untrusted.add(path)
        if first:
            logger.warning("disk tier: refusing %s: %s; it is never followed", path, untrusted.reason)
        return TierResult.fail(Failure.UNTRUSTED, untrusted.reason)

    # ---- writes -------------------------------------------------------------------------------------------------

    def write_async(self, name: str, data: Any, done: Optional[Callable[[TierResult], None]] = None,
                    copy: bool = True, urgent: bool = False) -> TierResult:
        """Copies `data` and queues it; OK when queued, else CLOSED, QUEUE_FULL or CAPACITY. `done` runs exactly once
        (writer thread) for queued writes only: OK, DISK_FULL, IO, UNTRUSTED, or CANCELLED/SUPERSEDED when a delete
        or a newer write overtook it.

        `copy=False` queues a reference to `data` instead of a copy: the caller must keep those bytes unchanged
        until `done` has run (no writer reads them after that). It still counts against `max_pending_bytes`,
        which then bounds how much of the caller's memory waits on the disk. `urgent`: something waits for the write
        (the caller's memory is short): it goes first and waits for no idle core."""
        check_name(name)
        view = _byte_view(data, writable=False)
        file_bytes = HEADER_BYTES + view.nbytes
        refusal = self._refusal(file_bytes)  # unlocked pre-check, so a refused write costs no copy
        if refusal is None:
            payload = bytes(view) if copy else view
            with self._lock:
                refusal = self._refusal(file_bytes)
                if refusal is None:
                    self._enqueue(_PendingWrite(name, payload, file_bytes, done), urgent)
                    return OK
        self.counters.add(_REFUSAL_COUNTERS[refusal])
        return TierResult.fail(refusal)

    def _refusal(self, file_bytes: int) -> Optional[Failure]:
        if self._closed:
            return Failure.CLOSED
        if self._pending_bytes + file_bytes > self._max_pending:
            return Failure.QUEUE_FULL
        if self._capacity is not None and self._used + self._pending_bytes + file_bytes > self._capacity:
            return Failure.CAPACITY
        return None

    def _enqueue(self, item: _PendingWrite, urgent: bool = False) -> None:
        previous = self._pending.get(item.name)
        if previous is not None:
            self._cancel(previous, Failure.SUPERSEDED)
        self._pending[item.name] = item
        item.queued_at = time.monotonic()
        if urgent and self._yields:  # never left to a writer that yields: the rescuer takes it at once
            self._urgent.append(item)
        elif urgent:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        self._pending_bytes += item.file_bytes
        self._unfinished += 1
        self._work.notify_all()  # the rescuer too: it times the queue's head

    def _cancel(self, item: _PendingWrite, reason: Failure) -> None:
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

    def _run_writer(self, rescuer: bool = False) -> None:
        if self._yields and not rescuer:
            platform_threads.yield_to_compute()
        landed: list[_PendingWrite] = []  # renamed, waiting for their directory fsync before `done`
        dirty_fans: set[str] = set()
        while True:
            with self._lock:
                item = self._take(rescuer, bool(landed))
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
            dirty_fans.add(fan_of(item.name))
            if len(landed) >= _DIR_SYNC_BATCH:
                self._report_landed(landed, dirty_fans)

    def _take(self, rescuer: bool, landing: bool) -> Optional[_PendingWrite]:
        """Under the lock: a writer's next item; None when it has files `landing` to report first, or the tier
        stops. The rescuer takes the urgent items and those that waited the yield bound (any, once stopping)."""
        while True:
            wait: Optional[float] = None
            if rescuer and self._urgent:
                self.counters.add(Metric.RESCUED_WRITES)
                return self._urgent.popleft()
            if self._queue:
                if not rescuer or self._stopping:
                    return self._queue.popleft()
                wait = self._queue[0].queued_at + platform_threads.YIELD_BOUND_S - time.monotonic()
                if wait <= 0:
                    self.counters.add(Metric.RESCUED_WRITES)
                    return self._queue.popleft()
            if landing or self._stopping:
                return None
            self._work.wait(wait)

    def _write_one(self, item: _PendingWrite, payload: Optional[bytes | memoryview]) -> TierResult:
        if payload is None:
            assert item.cancel_reason is not None  # `_cancel` sets it as it takes the bytes away
            return TierResult.fail(item.cancel_reason)
        temp = f"{item.name}.{os.getpid()}-{_INCARNATION}.{next(self._temp_seq)}{TEMP_SUFFIX}"
        fan_fd: Optional[int] = None
        created = False
        try:
            fan_fd = self._open_fan(fan_of(item.name), create=True)
            header = Header.describe(item.name, self._fingerprint, len(payload)).pack()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=fan_fd)
            created = True
            try:
                write_all(fd, header)
                write_all(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                # Checked and renamed under the lock that delete() holds while it unlinks: no resurrection.
                if item.cancel_reason is None:
                    os.replace(temp, item.name + FILE_SUFFIX, src_dir_fd=fan_fd, dst_dir_fd=fan_fd)
                    created = False
                    self._land(item)
            if created:
                remove_quietly(temp, fan_fd)
                assert item.cancel_reason is not None  # only a cancel keeps the rename from happening
                return TierResult.fail(item.cancel_reason)
            return OK
        except Exception as error:  # nothing may escape a writer thread
            if created and fan_fd is not None:
                remove_quietly(temp, fan_fd)
            with self._lock:
                self._drop(item)
            if isinstance(error, Untrusted):
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
        self.counters.add(Metric.WRITES)
        self.counters.add(Metric.WRITE_BYTES, item.file_bytes - HEADER_BYTES)

    def _write_failure(self, name: str, error: Exception) -> TierResult:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.counters.add(Metric.DISK_FULL)
            if not self._disk_full:
                logger.warning("disk tier %s is full; writes fail until space frees up", self._root)
            self._disk_full = True
            return TierResult.fail(Failure.DISK_FULL)
        self.counters.add(Metric.IO_ERRORS)
        if isinstance(error, OSError):
            logger.warning("disk tier: writing %s failed: %s", name, error)
            return TierResult.fail(Failure.IO, str(error.strerror or error))
        logger.exception("disk tier: unexpected error writing %s", name)
        return TierResult.fail(Failure.IO, repr(error))

    def _report_landed(self, landed: list[_PendingWrite], dirty_fans: set[str]) -> None:
        for fan in dirty_fans:
            try:
                fan_fd = self._open_fan(fan, create=False)
                try:
                    os.fsync(fan_fd)
                finally:
                    os.close(fan_fd)
            except (OSError, Untrusted) as error:  # the files are in place; only their crash safety is unsure
                self.counters.add(Metric.IO_ERRORS)
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
        """Fills `out` (its length must equal the stored payload's) from the pending copy or the file whose header
        fits `name`. The bytes are not hashed here: the caller verifies their envelope before using them. On failure
        `out` holds garbage. A file of another layout is refused but left in place; a symlink or a foreign fan
        directory is refused (UNTRUSTED) and never followed."""
        check_name(name)
        view = _byte_view(out, writable=True)
        with self._lock:
            item = self._pending.get(name)
            pending = item.data if item is not None else None
        if pending is not None:
            if len(pending) != view.nbytes:
                return TierResult.fail(Failure.CORRUPT, "length")  # the caller's size is wrong; the write stands
            view[:] = pending
            self.counters.add(Metric.READS)
            self.counters.add(Metric.PENDING_READS)
            self.counters.add(Metric.READ_BYTES, view.nbytes)
            return OK
        fan_fd: Optional[int] = None
        fd: Optional[int] = None
        try:
            fan_fd = self._open_fan(fan_of(name), create=False)
            fd = open_chunk_file(fan_fd, name + FILE_SUFFIX)
            return self._read_open_file(name, fan_fd, fd, view)
        except FileNotFoundError:
            self.counters.add(Metric.MISSES)
            with self._lock:
                self._forget(name)
            return TierResult.fail(Failure.MISS)
        except Untrusted as untrusted:
            return self._untrusted(name, untrusted)
        except OSError as error:
            self.counters.add(Metric.IO_ERRORS)
            logger.warning("disk tier: reading %s failed: %s", self.file_path(name), error)
            return TierResult.fail(Failure.IO, str(error.strerror or error))
        finally:
            if fd is not None:
                os.close(fd)
            if fan_fd is not None:
                os.close(fan_fd)

    def _read_open_file(self, name: str, fan_fd: int, fd: int, view: memoryview) -> TierResult:
        header, stat = read_header(fd)
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
        if problem is not None:
            return self._reject(name, fan_fd, stat, problem)
        with self._lock:
            if name not in self._on_disk:  # written by another process sharing the directory
                self._on_disk[name] = stat.st_size
                self._used += stat.st_size
        self.counters.add(Metric.READS)
        self.counters.add(Metric.READ_BYTES, view.nbytes)
        return OK

    def _reject(self, name: str, fan_fd: int, stat: os.stat_result, problem: str) -> TierResult:
        path = self.file_path(name)
        if problem in FOREIGN_PROBLEMS:
            self.counters.add(Metric.FOREIGN)
            logger.warning("disk tier: %s belongs to another layout or format version; left in place", path)
            return TierResult.fail(Failure.CORRUPT, problem)
        self.counters.add(Metric.CORRUPT)
        logger.warning("disk tier: removing corrupt cache file %s (%s)", path, problem)
        with self._lock:
            try:
                # Only the file we judged: a newer write may have renamed a good one over it meanwhile.
                if remove_if_same(name + FILE_SUFFIX, fan_fd, stat):
                    self._forget(name)
            except FileNotFoundError:
                self._forget(name)
            except OSError as error:
                self.counters.add(Metric.IO_ERRORS)
                logger.warning("disk tier: cannot remove %s: %s", path, error)
        return TierResult.fail(Failure.CORRUPT, problem)

    def _forget(self, name: str) -> None:
        self._used -= self._on_disk.pop(name, 0)

    def exists(self, name: str) -> bool:
        """A pending write, or a regular file under the name in a trusted fan directory (a symlink is not one)."""
        check_name(name)
        with self._lock:
            if name in self._pending:
                return True
        try:
            fan_fd = self._open_fan(fan_of(name), create=False)
        except Untrusted as untrusted:
            self._untrusted(name, untrusted)
            return False
        except OSError:
            return False
        try:
            return stat_mode.S_ISREG(os.stat(name + FILE_SUFFIX, dir_fd=fan_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False
        finally:
            os.close(fan_fd)

    def delete(self, name: str) -> bool:
        """Removes the file (a symlink under the name: the link, never its target) and cancels a pending write of
        `name`; True if either was there."""
        check_name(name)
        with self._lock:
            item = self._pending.get(name)
            if item is not None:
                self._cancel(item, Failure.CANCELLED)
            removed = self._unlink_locked(name)  # under the lock, so no writer renames between the cancel and this
            if removed:
                self._forget(name)
        if item is not None or removed:
            self.counters.add(Metric.DELETED)
            return True
        return False

    def _unlink_locked(self, name: str) -> bool:
        try:
            fan_fd = self._open_fan(fan_of(name), create=False)
        except FileNotFoundError:
            return False
        except Untrusted as untrusted:
            self.counters.add(Metric.UNTRUSTED)
            logger.warning("disk tier: cannot delete %s: %s", self.file_path(name), untrusted.reason)
            return False
        except OSError as error:
            self.counters.add(Metric.IO_ERRORS)
            logger.warning("disk tier: cannot delete %s: %s", self.file_path(name), error)
            return False
        try:
            os.unlink(name + FILE_SUFFIX, dir_fd=fan_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            self.counters.add(Metric.IO_ERRORS)
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
            release_lock(lock_fd)
