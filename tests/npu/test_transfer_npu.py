"""The transfer lanes on an Ascend NPU (torch_npu streams and events): the same ordering checks as on CUDA."""

from __future__ import annotations


import pytest
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, select_device

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]


@pytest.fixture(scope="module")
def npu():
    import torch
    import torch_npu  # noqa: F401

    if not torch.npu.is_available():
        pytest.skip("torch_npu is installed but no Ascend NPU is visible")
    select_device(0)
    return torch.device("npu", 0)


def test_a_store_sees_the_forwards_writes_and_the_host_never_waits(npu):
    from ..transfer import ordering

    stored, run_early, fence_early = ordering.store_after_the_forwards_writes(npu)
    assert stored == {7.0} and run_early and fence_early
    assert ordering.store_after_the_forwards_writes(npu, ordered=False)[0] == {1.0}


def test_the_page_fence_holds_the_next_forward_until_the_store_read_its_pages(npu):
    from ..transfer import ordering

    assert ordering.fence_orders_the_next_forward(npu) == {5.0}
    assert ordering.fence_orders_the_next_forward(npu, fence=False) == {9.0}


def test_a_load_lands_after_the_models_earlier_writes(npu):
    from ..transfer import ordering

    assert ordering.load_after_the_models_earlier_writes(npu) == {3.0}
    assert ordering.load_after_the_models_earlier_writes(npu, ordered=False) == {0.0}
