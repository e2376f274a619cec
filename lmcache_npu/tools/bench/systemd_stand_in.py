"""What systemd does between fork and exec for a service with a descriptor store, for the restart bench and the
descriptor-store tests: the inherited descriptors named in `<prefix>PASSED_FDS` (comma-separated, with their names
colon-separated in `<prefix>PASSED_NAMES`) move to 3, 4, ... and are announced in LISTEN_FDS, LISTEN_FDNAMES and
LISTEN_PID. Standard library only: it runs before any import of the service opens a descriptor of its own."""

from __future__ import annotations

import fcntl
import os


def place_passed_descriptors(prefix: str) -> int:
    """Moves the passed descriptors into place as systemd would; how many there were."""
    passed = [int(fd) for fd in os.environ.pop(f"{prefix}PASSED_FDS", "").split(",") if fd]
    names = os.environ.pop(f"{prefix}PASSED_NAMES", "")
    if not passed:
        return 0
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in passed]  # first out of the way: none is overwritten
    for fd in passed:
        os.close(fd)
    for number, fd in enumerate(high):
        os.dup2(fd, 3 + number)
        os.close(fd)
    os.environ.update(LISTEN_FDS=str(len(passed)), LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES=names)
    return len(passed)
