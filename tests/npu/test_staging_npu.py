"""The NPU backend's staging buffer: a store after a load never copies host gap bytes into another object."""

from __future__ import annotations


import pytest
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, select_device

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]


def test_a_store_after_a_load_writes_no_host_gap_bytes() -> None:
    import torch
    import torch_npu  # noqa: F401

    from lmcache_npu.ops import get_backend

    from ..ops.staging_cases import HOST_GAP, gap_bytes_of_a_store_after_a_load

    if not torch.npu.is_available():
        pytest.skip("torch_npu is installed but no Ascend NPU is visible")
    select_device(0)
    gap_bytes = gap_bytes_of_a_store_after_a_load(get_backend("npu"), torch.device("npu", 0))
    assert not (gap_bytes == HOST_GAP).any(), "a store copied another object's gap bytes out of staging"
