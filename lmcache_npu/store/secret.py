"""The store-wide secret (issue 21): where it comes from, and the checks before it is trusted.

One secret serves the disk and Mooncake tiers: it keys the MAC in every chunk envelope (`envelope.Sealer`). It is
read from `mooncake.secret_file` or the environment variable `LMCACHE_NPU_SECRET`, never from a plain config value
(configs end up in logs and bug reports), and its bytes are never logged: only where it came from.

The file is trusted only when it is (each checked on the opened descriptor, so nothing can be swapped in between):
not a symlink (opened with O_NOFOLLOW), a regular file (checked with fstat before a byte is read; the open is
non-blocking, so a FIFO or a device cannot stall start-up), owned by the effective uid, readable and writable by
no one else (mode 0600 or 0400, say), and at most `MAX_SECRET_FILE_BYTES`. Anything else is refused with a ValueError
that names the path, the rule and the fix: a secret others can read lets them forge chunks, one they can write lets
them choose it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Mapping, Optional

from .envelope import MIN_SECRET_BYTES

logger = logging.getLogger(__name__)

SECRET_ENV = "LMCACHE_NPU_SECRET"
MAX_SECRET_FILE_BYTES = 4096  # a secret is tens of bytes: anything longer is the wrong file
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before fstat could refuse it
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_MAKE_ONE = "head -c 32 /dev/urandom | base64 > {path} && chmod 600 {path}"


def _refusal(path: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"mooncake.secret_file {path!r} {problem}: the store secret must be a regular file owned by "
                      f"the service user (uid {os.geteuid()}), accessible to no one else and at most "
                      f"{MAX_SECRET_FILE_BYTES} bytes; fix: {fix}")


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return f"file of type {stat.S_IFMT(mode):o}"


def _check_opened(path: str, info: os.stat_result) -> None:
    """Refuses what the descriptor's fstat shows is not a private regular file of ours."""
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, f"is not a regular file (it is a {_file_type(info.st_mode)})",
                       f"point secret_file at a regular file, e.g. `{_MAKE_ONE.format(path='<file>')}`")
    if info.st_uid != os.geteuid():
        raise _refusal(path, f"is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}",
                       f"`chown {os.geteuid()} {path}` (as root), or run the service as its owner")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise _refusal(path, f"is accessible to group or others (mode {mode:04o})", f"`chmod 600 {path}`")
    if info.st_size > MAX_SECRET_FILE_BYTES:
        raise _refusal(path, f"holds {info.st_size} bytes", "write only the secret into it (e.g. 32 random bytes, "
                       f"base64: `{_MAKE_ONE.format(path=path)}`)")


def _read_capped(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes, whatever size each read returns."""
    parts: list[bytes] = []
    left = limit
    while left:
        part = os.read(fd, left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _from_file(path: str) -> bytes:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refusal(path, "is a symlink", "point secret_file at the file itself, not at a link") from None
        raise ValueError(f"mooncake.secret_file {path!r} cannot be read: {exc.strerror or exc}") from None
    try:
        _check_opened(path, os.fstat(fd))
        raw = _read_capped(fd, MAX_SECRET_FILE_BYTES + 1)  # one byte more: a file that grew after fstat is seen
    except OSError as exc:
        raise ValueError(f"mooncake.secret_file {path!r} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise _refusal(path, f"holds more than {MAX_SECRET_FILE_BYTES} bytes", "write only the secret into it "
                       f"(`{_MAKE_ONE.format(path=path)}`)")
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"mooncake.secret_file {path!r} holds {len(secret)} bytes (stripped); the store secret needs "
                         f"at least {MIN_SECRET_BYTES} (e.g. {_MAKE_ONE.format(path=path)})")
    return secret


def resolve_secret(secret_file: str = "", environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The store secret: the file's bytes (stripped) when `secret_file` is set, else `LMCACHE_NPU_SECRET`'s, else
    None (envelopes then carry digests only). A set but unusable source is an error naming it, never a silent None."""
    env = os.environ if environ is None else environ
    if secret_file:
        secret = _from_file(secret_file)
        logger.info("secret: configured (from file %s)", secret_file)
        return secret
    text = env.get(SECRET_ENV)
    if text is None:
        return None
    secret = text.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_ENV} holds {len(secret)} bytes (stripped); the store secret needs at least "
                         f"{MIN_SECRET_BYTES}")
    logger.info("secret: configured (from %s)", SECRET_ENV)
    return secret
