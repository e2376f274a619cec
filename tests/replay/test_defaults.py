"""The automatic chunk size the replay's plugin runs with: the smallest whole number of vLLM's blocks and of every
group's granularity that holds the target, and what a 128-token target (one CPU/Ascend block, what a block-keyed
peer connector reuses) would give."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from lmcache_npu.layout.discovery import DEFAULT_CHUNK_TOKENS, default_chunk_tokens


def test_a_128_token_target_is_one_cpu_block_and_eight_cuda_blocks():
    assert default_chunk_tokens(1, 128) == DEFAULT_CHUNK_TOKENS == 128  # the automatic size: one CPU/Ascend block
    assert default_chunk_tokens(1, 128, target=128) == 128  # vLLM's CPU and Ascend block: the peer's key unit
    assert default_chunk_tokens(1, 16, target=128) == 128  # CUDA's 16-token blocks: eight of them
    assert default_chunk_tokens(544, 128, target=128) == 2176  # a mamba state interval rules: lcm(544, 128)
    assert default_chunk_tokens(1, 128, target=129) == 256  # negative control: one token more takes a second block


@given(st.integers(1, 1024), st.integers(1, 512), st.integers(1, 4096))
def test_the_automatic_size_is_the_smallest_whole_unit_holding_the_target(granularity, block, target):
    chunk = default_chunk_tokens(granularity, block, target)
    unit = math.lcm(granularity, block)
    assert chunk % unit == 0 and chunk >= target
    assert chunk == unit or chunk - unit < target  # one unit less would not hold the target


def test_sizes_below_one_are_refused_by_name():
    with pytest.raises(ValueError, match="granularity=0"):
        default_chunk_tokens(0, 128)
    with pytest.raises(ValueError, match="target=0"):
        default_chunk_tokens(1, 128, target=0)
