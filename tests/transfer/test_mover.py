"""The transfer lanes on the host (the CPU attention backend): the page fence makes the next step wait until a
queued store has read its pages; without it the next step's writes reach the store first. The same scenarios run
on CUDA (tests/cuda) and NPU (tests/npu) with streams and events."""

from __future__ import annotations

import torch

from . import ordering

CPU = torch.device("cpu")


def test_the_page_fence_holds_the_next_step_until_the_store_read_its_pages():
    assert ordering.fence_orders_the_next_forward(CPU) == {5.0}


def test_without_the_fence_the_next_steps_writes_reach_the_store_first():
    assert ordering.fence_orders_the_next_forward(CPU, fence=False) == {9.0}


def test_a_load_lands_in_the_pages():
    assert ordering.load_after_the_models_earlier_writes(CPU) == {3.0}
