"""How the index reports a command that failed on some rank: at once, a WARNING each (in process), or kept for the
node cache, which logs them in aggregate once its lock is released (an engine's death fails hundreds at once)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Optional

from ..commands import Command

logger = logging.getLogger("lmcache_npu.store.index.chunk_index")  # the index's own records, as before
MAX_KEPT = 4096  # failures kept between two `take` calls; beyond, only counted (nobody is taking them)


class FailureLog:
    def __init__(self) -> None:
        self._kept: Optional[list[tuple[str, str, str]]] = None  # None: log at once
        self.quiet = False  # abandoning: the caller reports the failures itself, in one line

    @contextmanager
    def quieted(self) -> Iterator[None]:
        """Failures reported inside are only counted (abandoning: the caller reports them itself, in one line)."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def defer(self) -> None:
        """From now on failures are kept for `take` instead of logged."""
        if self._kept is None:
            self._kept = []

    def report(self, command: Command, failures: list[str]) -> None:
        if self.quiet:
            return
        chunk, why = command.key.chunk_hash.hex()[:16], "; ".join(failures)
        if self._kept is None:
            logger.warning("%s of chunk %s failed: %s", type(command).__name__, chunk, why)
        elif len(self._kept) < MAX_KEPT:
            self._kept.append((type(command).__name__, chunk, why))

    @property
    def kept(self) -> int:
        return len(self._kept) if self._kept else 0

    def take(self) -> list[tuple[str, str, str]]:
        """The failures kept since the last call: (kind, chunk hash prefix, why), oldest first."""
        if not self._kept:
            return []
        kept, self._kept = self._kept, []
        return kept
