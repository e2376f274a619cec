"""A tool's run log: while a tool drives engines in its own process, everything they print goes to one file, and the
tool keeps the terminal for its progress, tables and verdicts.

Engines print through every channel there is: vLLM's loggers and tqdm bars (Python's `sys.stdout`/`sys.stderr`),
torch's C++ warnings, Mooncake's glog (straight to file descriptor 2), child processes that inherit the descriptors.
So the run log moves descriptors 1 and 2 themselves onto the file (`dup2`) and hands the tool duplicates of the
terminal's (`console_out`, `console_err`). On an error the descriptors are put back and the log's last lines are
printed with its path: an engine that failed to start says why. After a run that ended well, `until_exit` sends what
native libraries print while the interpreter shuts down (Mooncake's clients say goodbye then) to the log as well.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import IO, Optional

logger = logging.getLogger(__name__)

TAIL_LINES = 40  # enough for vLLM's root-cause traceback after an engine failed to start


class RunLog:
    """Use as a context manager; `path` is created (parents too) or emptied."""

    def __init__(self, path: Path, tail_lines: int = TAIL_LINES, until_exit: bool = False) -> None:
        self.path = Path(path)
        self.tail_lines = tail_lines
        self.until_exit = until_exit
        self.console_out: IO[str] = sys.stdout
        self.console_err: IO[str] = sys.stderr
        self._saved: list[tuple[int, int]] = []  # (descriptor, its duplicate to restore)

    def __enter__(self) -> "RunLog":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for fd in (1, 2):
                self._saved.append((fd, os.dup(fd)))
                os.dup2(log_fd, fd)  # dup2's copy is inheritable: child processes write here too
        except OSError:
            self._restore()
            raise
        finally:
            os.close(log_fd)
        # line-buffered: the tool's lines reach the terminal in the order it prints them
        self.console_out = os.fdopen(os.dup(self._saved[0][1]), "w", buffering=1, encoding="utf-8", errors="replace")
        self.console_err = os.fdopen(os.dup(self._saved[1][1]), "w", buffering=1, encoding="utf-8", errors="replace")
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        gc.collect()  # closed engines' native clients log as they are freed: into the log, not after it
        self._restore()
        tail = self.tail() if kind is not None and not issubclass(kind, KeyboardInterrupt) else ""
        if tail:
            self.console_err.write(f"the last lines of {self.path}:\n{tail}")
        for stream in (self.console_out, self.console_err):
            stream.flush()
            stream.close()
        self.console_out, self.console_err = sys.stdout, sys.stderr
        if kind is None and self.until_exit:
            atexit.register(self._attach_at_exit)  # runs before the handlers and finalizers registered earlier

    def _attach_at_exit(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            log_fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError:  # the log is gone: exit as usual
            return
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        os.close(log_fd)

    def _restore(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream must not keep the terminal from coming back
                pass
        while self._saved:
            fd, saved = self._saved.pop()
            os.dup2(saved, fd)
            os.close(saved)

    def tail(self) -> str:
        """The log's last `tail_lines` lines ("" when it is empty or gone)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return "".join(deque(f, maxlen=self.tail_lines))
        except OSError as exc:
            logger.debug("run log %s unreadable: %s", self.path, exc)
            return ""
