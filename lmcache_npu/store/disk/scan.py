"""The restart scan: every header and file length validated, invalid and leftover temp files removed, files of
another layout or build left alone; what is left, oldest first.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

from ..tier import TierCounters
from .format import (FAN_PATTERN, FILE_SUFFIX, FOREIGN_PROBLEMS, NAME_PATTERN, TEMP_SUFFIX, DiskEntry,
                     check_fingerprint, fan_of, read_header)
from .trust import (Untrusted, directory_problem, open_chunk_file, open_fan_dir, open_root, remove_if_same,
                    untrusted_directory)
from ..metrics import Metric

logger = logging.getLogger(__name__)

# A temp file this old is a leftover whoever wrote it (no write takes this long).
_TEMP_GRACE_SECONDS = 600.0


def _temp_removable(file_name: str, mtime: float, owns: Optional[Callable[[str], bool]], lock_held: bool) -> bool:
    """A temp file may go when it is old, or when its final name is ours and our lock proves no one writes it."""
    if time.time() - mtime > _TEMP_GRACE_SECONDS:
        return True
    final_name = file_name.split(".", 1)[0]
    return lock_held and bool(NAME_PATTERN.fullmatch(final_name)) and (owns is None or owns(final_name))


def _scan_temp(fan_fd: int, path: str, item: os.DirEntry, owns: Optional[Callable[[str], bool]], lock_held: bool,
               found: TierCounters) -> None:
    try:
        if _temp_removable(item.name, item.stat(follow_symlinks=False).st_mtime, owns, lock_held):
            os.unlink(item.name, dir_fd=fan_fd)
            found.add(Metric.TEMP_REMOVED)
    except FileNotFoundError:
        pass  # its writer renamed or removed it meanwhile
    except OSError as error:
        logger.warning("disk tier: cannot remove leftover %s (%s)", path, error)


def _scan_file(fan_fd: int, path: str, name: str, fan: str, fingerprint: bytes,
               found: TierCounters) -> Optional[DiskEntry]:
    file_name = name + FILE_SUFFIX
    try:
        fd = open_chunk_file(fan_fd, file_name)
        try:
            header, stat = read_header(fd)
        finally:
            os.close(fd)
    except Untrusted as untrusted:
        logger.warning("disk tier: %s: %s; skipped, never followed", path, untrusted.reason)
        found.add(Metric.UNTRUSTED)
        return None
    except OSError as error:
        logger.warning("disk tier: cannot inspect %s (%s); skipped", path, error)
        found.add(Metric.IO_ERRORS)
        return None
    problem = "short" if header is None else header.problem(stat.st_size, name, fingerprint)
    if problem is None and fan != fan_of(name):
        problem = "misplaced"  # unreachable under this name, so it would only hold space
    if problem in FOREIGN_PROBLEMS:
        found.add(Metric.FOREIGN)
        return None
    if problem is not None:
        logger.warning("disk tier: removing invalid cache file %s (%s)", path, problem)
        try:
            remove_if_same(file_name, fan_fd, stat)
        except OSError:
            pass  # gone already, or replaced by its writer: either way not ours to judge again now
        found.add(Metric.CORRUPT)
        return None
    assert header is not None
    return DiskEntry(name, header.payload_bytes, stat.st_mtime)


def _check_fan_dirs(root_fd: int, root: str) -> list[str]:
    """The fan directories under the root, each checked with lstat; ValueError naming the first untrusted one."""
    fans = []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if not FAN_PATTERN.fullmatch(entry.name):
                continue
            info = entry.stat(follow_symlinks=False)
            problem = directory_problem(info)
            if problem is not None:
                raise untrusted_directory("fan directory", os.path.join(root, entry.name), info, problem)
            fans.append(entry.name)
    return sorted(fans)


def scan_root(root_fd: int, root: str, layout_fingerprint: bytes, counters: Optional[TierCounters],
               owns: Optional[Callable[[str], bool]], lock_held: bool) -> list[DiskEntry]:
    found = TierCounters()
    entries: list[DiskEntry] = []
    for fan in _check_fan_dirs(root_fd, root):  # all checked before anything is removed
        fan_path = os.path.join(root, fan)
        try:
            fan_fd = open_fan_dir(root_fd, fan)
        except Untrusted as untrusted:  # swapped after the check above
            raise ValueError(f"disk tier fan directory {fan_path!r} changed during the start-up check "
                             f"({untrusted.reason}); refusing the directory") from None
        try:
            with os.scandir(fan_fd) as items:
                for item in items:
                    path = os.path.join(fan_path, item.name)
                    if item.is_symlink():
                        logger.warning("disk tier: %s is a symlink; left alone, never followed", path)
                        found.add(Metric.UNTRUSTED)
                        continue
                    if not item.is_file(follow_symlinks=False):
                        continue
                    if item.name.endswith(TEMP_SUFFIX):
                        _scan_temp(fan_fd, path, item, owns, lock_held, found)
                        continue
                    name = item.name[:-len(FILE_SUFFIX)]
                    if (item.name.endswith(FILE_SUFFIX) and NAME_PATTERN.fullmatch(name)
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
                summary.get(Metric.CORRUPT, 0), summary.get(Metric.TEMP_REMOVED, 0), summary.get(Metric.FOREIGN, 0),
                summary.get(Metric.UNTRUSTED, 0))
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
    check_fingerprint(layout_fingerprint)
    root = os.fspath(path)
    root_fd = open_root(root)
    try:
        return scan_root(root_fd, root, layout_fingerprint, counters, owns, lock_held=False)
    finally:
        os.close(root_fd)
