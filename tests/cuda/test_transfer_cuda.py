"""The transfer lanes on a GPU: a store waits for the forward's writes, the page fence holds the next forward until
the store has read its pages, a load waits for the model's earlier writes, and the host never waits for the
device. Each has a negative control that sees the wrong bytes without the ordering. Each runs with the backend's
own choice (one 4 MiB chunk: kernel, then copies on the lane's stream) and pipelined (copies on the backend's copy
stream, meeting the kernel through slice flags)."""

from __future__ import annotations

import pytest
import torch

from lmcache_npu.transfer import StreamKit

from ..transfer import ordering
from .marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS
CUDA = torch.device("cuda", 0)
SLICED = {"pipeline": True, "store_first_slice_bytes": 256 << 10, "load_tail_bytes": 1 << 20}


@pytest.fixture(params=[None, SLICED], ids=["auto", "pipelined"])
def options(request: pytest.FixtureRequest) -> dict:
    return request.param


def test_a_store_sees_the_forwards_writes_and_the_host_never_waits(options: dict) -> None:
    stored, run_early, fence_early = ordering.store_after_the_forwards_writes(CUDA, options=options)
    assert stored == {7.0}
    assert run_early and fence_early, "the host waited for the model's stream"


def test_without_its_event_the_store_reads_before_the_forward_wrote(options: dict) -> None:
    stored, _, _ = ordering.store_after_the_forwards_writes(CUDA, ordered=False, options=options)
    assert stored == {1.0}


def test_the_page_fence_holds_the_next_forward_until_the_store_read_its_pages(options: dict) -> None:
    assert ordering.fence_orders_the_next_forward(CUDA, options=options) == {5.0}
    assert ordering.fence_orders_the_next_forward(CUDA, fence=False, options=options) == {9.0}


def test_a_load_lands_after_the_models_earlier_writes(options: dict) -> None:
    assert ordering.load_after_the_models_earlier_writes(CUDA, options=options) == {3.0}
    assert ordering.load_after_the_models_earlier_writes(CUDA, ordered=False, options=options) == {0.0}


def test_the_transfer_stream_has_the_highest_priority() -> None:
    kit = StreamKit.for_device(CUDA)
    kit.bind_thread()
    with kit.side_stream():
        lane = torch.cuda.current_stream(CUDA)
    highest = torch.cuda.Stream.priority_range()[1]  # (least, greatest); lower numbers are higher priorities
    assert highest < 0, "this device has no stream priorities"
    assert lane.priority == highest, f"the transfer stream's priority is {lane.priority}, the highest is {highest}"


@pytest.mark.parametrize("direction", ["store", "load"])
def test_the_backend_hands_over_an_event_recorded_right_after_its_kernel(direction: str) -> None:
    """The pages-free event is recorded by the native call that enqueues the whole transfer (no host step between the
    kernel and a store's copies), so the backend passes its own event; None would mean the caller records one."""
    import numpy as np

    from lmcache_npu.ops import ChunkBatch, Direction, get_backend

    s = ordering.Setup(CUDA)
    try:
        backend = get_backend("cuda")
        backend.prepare(s.layout.plan)
        slots = [np.arange(ordering.CHUNK).reshape(1, -1) + ordering.BLOCK]  # chunk 0 in blocks 1..16
        batch = ChunkBatch.build(s.layout.plan, slots, [s.arena.slot(0)], Direction[direction.upper()])
        handed: list = []
        backend.transfer(batch, after_kernel=handed.append)
        assert len(handed) == 1 and isinstance(handed[0], torch.cuda.Event)
        torch.cuda.current_stream(CUDA).wait_event(handed[0])
        torch.cuda.synchronize()
        assert handed[0].query()
    finally:
        s.close()
