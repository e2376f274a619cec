"""The tier's lock: an exclusive flock per (namespace, rank) name, so two engines never serve one name from one
directory; a forked child drops its copies of the lock fds.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat as stat_mode
import threading

from .format import LOCK_PREFIX

logger = logging.getLogger(__name__)

_LOCK_INFO_BYTES = 4096
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


def _lock_holder(fd: int) -> tuple[str, str]:
    """(pid, host) the holder wrote into the lock file; "unknown" while it has not written them yet."""
    try:
        parts = os.pread(fd, _LOCK_INFO_BYTES, 0).decode("utf-8", "replace").split()
    except OSError:
        parts = []
    if len(parts) == 2 and parts[0].isdigit():
        return parts[0], parts[1]
    return "unknown", "unknown"


def acquire_lock(root_fd: int, root: str, lock_name: str) -> int:
    """Holds an exclusive flock on the root's lock file for `lock_name`; ValueError naming the holder if taken."""
    file_name = LOCK_PREFIX + lock_name
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


def release_lock(fd: int) -> None:
    with _HELD_LOCK_FDS_GUARD:
        _HELD_LOCK_FDS.discard(fd)
    try:
        os.ftruncate(fd, 0)  # so a stale "pid host" never names a process that no longer holds it
    except OSError as error:
        logger.warning("disk tier: cannot clear the lock file: %s", error)
    os.close(fd)  # closing the only description releases the flock
