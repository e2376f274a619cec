"""Trust in the cache directory: the root, its parent and its fan directories are checked before use, and every
later operation works relative to a checked directory's fd, never following a link.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mode
from typing import Optional


# Group or other write permission on a cache directory lets someone else plant or swap files.
UNSAFE_MODE_BITS = 0o022
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a chunk name must not hang the reader; no effect on regular files.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Untrusted(Exception):
    """A path inside the cache directory that must not be followed or used: a symlink, a foreign directory."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def directory_problem(info: os.stat_result) -> Optional[str]:
    """Why a directory with this (l)stat cannot hold the cache, or None."""
    if stat_mode.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat_mode.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    if info.st_mode & UNSAFE_MODE_BITS:
        return "is writable by group or others"
    return None


def untrusted_directory(what: str, path: str, info: os.stat_result, problem: str) -> ValueError:
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


def root_refusal(root: str, info: Optional[os.stat_result] = None) -> Optional[ValueError]:
    """The refusal `open_root` raises for `root` as it stands (its lstat `info`, read when not given), or None; None
    too for a missing root, which `open_root` makes private. `lmcache-npu doctor` asks this without making it."""
    if info is None:
        try:
            info = os.lstat(root)
        except FileNotFoundError:
            return None
    problem = directory_problem(info)
    return None if problem is None else untrusted_directory("disk_path", root, info, problem)


def open_root(root: str) -> int:
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
    refusal = root_refusal(root, before)
    if refusal is not None:
        raise refusal
    fd = os.open(root, DIR_FLAGS)
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or directory_problem(after) is not None:
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
    if info.st_mode & UNSAFE_MODE_BITS:
        sticky = " (sticky or not)" if info.st_mode & stat_mode.S_ISVTX else ""
        return f"is writable by group or others{sticky}"
    return None


def data_parallel_root(disk_path: str, dp_rank: int) -> str:
    """The disk tier directory of data-parallel rank `dp_rank` under `disk_path` (each engine manages its own files)."""
    return f"{disk_path.rstrip('/')}/dp{dp_rank}"


def parent_refusal(parent: str) -> Optional[ValueError]:
    """The refusal `check_disk_parent` raises for `parent` as it stands, or None (None too when it is missing: it is
    then made private). `lmcache-npu doctor` asks this without making it."""
    try:
        info = os.lstat(parent)
    except FileNotFoundError:
        return None
    problem = _parent_problem(info)
    if problem is None:
        return None
    if problem == "is a symlink":
        fix = "point disk_path at the real directory instead of a link"
    elif problem == "is not a directory":
        fix = "choose a directory for disk_path"
    else:
        fix = f"run `chown {os.geteuid()} {parent} && chmod 700 {parent}` as its owner or root"
    return ValueError(
        f"disk tier disk_path {parent!r} {problem} (owner uid {info.st_uid}, mode "
        f"{stat_mode.S_IMODE(info.st_mode):04o}): with data parallelism it holds each engine's directory dp<rank>, "
        f"so it must be a real directory owned by the service user (uid {os.geteuid()}) or root and writable by no"
        f" one else, or other users could rename a rank's directory away or create it first; fix: {fix}")


def check_disk_parent(parent: str) -> None:
    """Refuses a `disk_path` whose per-rank directories (`disk_path/dp<rank>`, data-parallel engines) others could
    rename away or create first; creates it 0700 when missing. Call it before a per-rank directory is made or used."""
    try:
        os.lstat(parent)
    except FileNotFoundError:
        try:
            os.makedirs(parent, mode=0o700)
        except FileExistsError:
            pass  # another engine created it meanwhile: checked like any existing directory
    refusal = parent_refusal(parent)
    if refusal is not None:
        raise refusal


def open_fan_dir(root_fd: int, fan: str) -> int:
    """An fd of fan directory `fan` under the root, checked; Untrusted when it is a link or foreign."""
    try:
        fd = os.open(fan, DIR_FLAGS, dir_fd=root_fd)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        info = os.stat(fan, dir_fd=root_fd, follow_symlinks=False)
        raise Untrusted(f"fan directory {fan} {directory_problem(info) or 'changed while opened'}") from None
    try:
        problem = directory_problem(os.fstat(fd))
        if problem is not None:
            raise Untrusted(f"fan directory {fan} {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_chunk_file(fan_fd: int, file_name: str) -> int:
    """A read-only fd of a regular file, never through a symlink; Untrusted otherwise."""
    try:
        fd = os.open(file_name, READ_FLAGS, dir_fd=fan_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Untrusted("symlink") from None
        raise
    try:
        if not stat_mode.S_ISREG(os.fstat(fd).st_mode):
            raise Untrusted("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def remove_quietly(file_name: str, dir_fd: int) -> None:
    try:
        os.unlink(file_name, dir_fd=dir_fd)
    except OSError:
        pass


def remove_if_same(file_name: str, dir_fd: int, judged: os.stat_result) -> bool:
    """Unlinks `file_name` only if it is still the judged file (a writer may have renamed a new one over it)."""
    current = os.stat(file_name, dir_fd=dir_fd, follow_symlinks=False)
    if (current.st_dev, current.st_ino) != (judged.st_dev, judged.st_ino):
        return False
    os.unlink(file_name, dir_fd=dir_fd)
    return True
