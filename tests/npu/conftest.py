"""Fixtures every NPU test module shares."""

from __future__ import annotations

import pytest

from .marks import enforce, status


@pytest.fixture(scope="session")
def npu_module() -> None:
    """Skips where no card is visible; fails, with the import error, where a card is and lmcache_npu._npu does not
    load (tests/npu/marks.py says why)."""
    enforce(*status())
