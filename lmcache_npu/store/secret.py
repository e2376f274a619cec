"""The store-wide secret (issue 21): where it comes from, and the checks before it is trusted.

One secret serves the disk and Mooncake tiers: it keys the MAC in every chunk envelope (`envelope.Sealer`). It is
read from `mooncake.secret_file` or the environment variable `LMCACHE_NPU_SECRET`, never from a plain config value
(configs end up in logs and bug reports), and its bytes are never logged: only where it came from.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Mapping, Optional

from .envelope import MIN_SECRET_BYTES

logger = logging.getLogger(__name__)

SECRET_ENV = "LMCACHE_NPU_SECRET"


def _from_file(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            secret = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"mooncake.secret_file {path!r} cannot be read: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"mooncake.secret_file {path!r} holds {len(secret)} bytes (stripped); the store secret needs "
                         f"at least {MIN_SECRET_BYTES} (e.g. head -c 32 /dev/urandom | base64 > {path})")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("mooncake.secret_file %s is accessible to group or others (mode %o); chmod 600 it", path,
                       stat.S_IMODE(mode))
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
