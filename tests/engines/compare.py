"""Prompts for the engine tests, and the assertion that two engines' completions are identical."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lmcache_npu.replay.compare import LOGPROB_TOLERANCE, differences
from lmcache_npu.replay.engine import Completion
from lmcache_npu.replay.models import VOCAB


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, VOCAB, length).tolist()


def assert_identical(reference: Sequence[Completion], candidate: Sequence[Completion],
                     tolerance: float = LOGPROB_TOLERANCE) -> None:
    found = differences(reference, candidate, tolerance)
    assert not found, "; ".join(found[:5])
