"""The transfer lanes on a GPU: a store waits for the forward's writes, the page fence holds the next forward until
the store has read its pages, a load waits for the model's earlier writes, and the host never waits for the
device. Each has a negative control that sees the wrong bytes without the ordering."""

from __future__ import annotations


import torch

from ..transfer import ordering
from .marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS
CUDA = torch.device("cuda", 0)


def test_a_store_sees_the_forwards_writes_and_the_host_never_waits():
    stored, run_early, fence_early = ordering.store_after_the_forwards_writes(CUDA)
    assert stored == {7.0}
    assert run_early and fence_early, "the host waited for the model's stream"


def test_without_its_event_the_store_reads_before_the_forward_wrote():
    stored, _, _ = ordering.store_after_the_forwards_writes(CUDA, ordered=False)
    assert stored == {1.0}


def test_the_page_fence_holds_the_next_forward_until_the_store_read_its_pages():
    assert ordering.fence_orders_the_next_forward(CUDA) == {5.0}
    assert ordering.fence_orders_the_next_forward(CUDA, fence=False) == {9.0}


def test_a_load_lands_after_the_models_earlier_writes():
    assert ordering.load_after_the_models_earlier_writes(CUDA) == {3.0}
    assert ordering.load_after_the_models_earlier_writes(CUDA, ordered=False) == {0.0}
