"""Directories made once and shared by processes: written in a private staging directory beside the target, then
renamed into place, so no process ever sees a half-written model or tokenizer."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def publish_directory(target: Path, write: Callable[[Path], None], marker: str) -> None:
    """Runs `write(staging)` and renames the staging directory to `target`. Another process that published `target`
    first (its `marker` file exists) wins: both wrote the same content."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / marker).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
