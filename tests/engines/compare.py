"""Prompts for the engine tests, and the assertion that two engines' completions are the same."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lmcache_npu.tools.replay.compare import differences, tolerance_for
from lmcache_npu.tools.replay.engine import Completion
from lmcache_npu.tools.replay.models import VOCAB


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, VOCAB, length).tolist()


def assert_identical(reference: Sequence[Completion], candidate: Sequence[Completion], dtype: str) -> None:
    """Same greedy tokens and logprobs within the tolerance of the model's `dtype` (near ties of a bf16 model's
    logits aside: `lmcache_npu.tools.replay.compare`)."""
    found = differences(reference, candidate, tolerance_for(dtype))
    assert not found, "; ".join(found[:5])
