"""The NPU backend's staging buffer: a store after a load never copies host gap bytes into another object."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                       reason="no torch_npu: the NPU suite needs an Ascend NPU with CANN and torch_npu"),
    pytest.mark.skipif(importlib.util.find_spec("lmcache_npu._npu") is None,
                       reason="lmcache_npu._npu is not built (needs CANN at install time)"),
]


def test_a_store_after_a_load_writes_no_host_gap_bytes() -> None:
    import torch
    import torch_npu  # noqa: F401

    from lmcache_npu.ops import get_backend

    from ..ops.staging_cases import HOST_GAP, gap_bytes_of_a_store_after_a_load

    if not torch.npu.is_available():
        pytest.skip("torch_npu is installed but no Ascend NPU is visible")
    gap_bytes = gap_bytes_of_a_store_after_a_load(get_backend("npu"), torch.device("npu", 0))
    assert not (gap_bytes == HOST_GAP).any(), "a store copied another object's gap bytes out of staging"
