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
from .cuda_marks import CUDA_KERNELS

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


class _NeverRecordedNatively(torch.cuda.Event):
    """The negative control: the backend reads a null handle, so the native call records nothing after the kernel
    and the event keeps the position the backend gave it before the transfer."""

    @property
    def cuda_event(self) -> int:
        return 0


def _pages_free_while_the_kernel_waits(monkeypatch: pytest.MonkeyPatch, native: bool) -> tuple[bool, bool]:
    """A pipelined load whose copies are held by a gate on the backend's copy stream: its kernel cannot finish. Returns
    whether the event the backend handed over had completed then, and once the gate opened."""
    import threading
    import time

    import numpy as np

    from lmcache_npu.ops import ChunkBatch, Direction, get_backend

    s = ordering.Setup(CUDA)
    gate = ordering.Gate(s)
    if gate.flag is None:
        s.close()
        pytest.skip("no CUDA stream memory operations: the copy stream cannot be held without timing")
    backend = get_backend("cuda", **SLICED)
    try:
        backend.prepare(s.layout.plan)
        slots = [np.arange(ordering.CHUNK).reshape(1, -1) + ordering.BLOCK]  # chunk 0 in blocks 1..16
        batch = ChunkBatch.build(s.layout.plan, slots, [s.arena.slot(0)], Direction.LOAD)
        backend.transfer(batch)  # the backend's streams and events exist from here on
        assert backend.pipelined(batch)
        if not native:
            monkeypatch.setattr(torch.cuda, "Event", _NeverRecordedNatively)
        with torch.cuda.stream(backend._native.copy_stream):
            gate.hold()
        handed: list = []
        enqueued = threading.Event()
        worker = threading.Thread(target=backend.transfer, args=(batch,),
                                  kwargs={"after_kernel": lambda e: (handed.append(e), enqueued.set())})
        worker.start()
        try:
            assert enqueued.wait(30), "the transfer never handed over its event"
            time.sleep(0.05)  # the GPU has long reached the held copies
            while_held = handed[0].query()
        finally:
            gate.open()
            worker.join(60)
        torch.cuda.synchronize()
        return while_held, handed[0].query()
    finally:
        s.close()


def test_the_pages_free_event_completes_only_after_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event is recorded by the native call that enqueues the whole transfer, right after the kernel (no host step
    between the kernel and a store's copies): held copies hold it too."""
    assert _pages_free_while_the_kernel_waits(monkeypatch, native=True) == (False, True)


def test_without_the_native_record_the_event_completes_before_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _pages_free_while_the_kernel_waits(monkeypatch, native=False) == (True, True)
