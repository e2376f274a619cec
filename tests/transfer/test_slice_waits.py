"""`SlicedLoad.wait_for_slice` on the model's thread: each stream waits once per slice it needs, in forward order,
so a layer whose slice its stream already waits for adds no stream wait (the hook costs a lookup); another stream
still waits (negative control), and a failed load lets no waiter through."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Hashable, Optional

from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.transfer.slice_progress import SlicedLoad
from lmcache_npu.transfer.streams import StreamKit


class CountingKit(StreamKit):
    """A device kit stand-in: which stream is current, and every stream wait made, as (stream, event)."""

    def __init__(self) -> None:
        self.current: Hashable = "model"
        self.waits: list[tuple[Hashable, Any]] = []

    def wait(self, event: Optional[Any]) -> None:
        self.waits.append((self.current, event))

    def stream_key(self) -> Hashable:
        return self.current


def _landed(slices: int) -> tuple[SlicedLoad, CountingKit]:
    kit = CountingKit()
    progress = SlicedLoad(SimpleNamespace(slices=[object()] * slices, slice_of_layer=lambda layer: None), kit)
    for index in range(slices):
        progress.landed(index, f"event {index}")
    return progress, kit


@given(layer_slices=st.lists(st.integers(0, 7), min_size=1, max_size=60))
def test_a_stream_waits_once_for_each_slice_beyond_what_it_waits_for(layer_slices: list[int]) -> None:
    progress, kit = _landed(8)
    for index in layer_slices:
        assert progress.wait_for_slice(index)
    expected, furthest = [], -1
    for index in layer_slices:  # slices land in order: a wait for slice k covers every slice before it
        if index > furthest:
            expected.append(("model", f"event {index}"))
            furthest = index
    assert kit.waits == expected


def test_another_stream_still_waits_for_a_slice_the_first_waits_for() -> None:
    progress, kit = _landed(4)
    assert progress.wait_for_slice(2) and progress.wait_for_slice(1)
    kit.current = "ubatch 1"  # e.g. a second micro-batch's stream
    assert progress.wait_for_slice(1)
    assert kit.waits == [("model", "event 2"), ("ubatch 1", "event 1")]


def test_a_failed_load_lets_no_later_waiter_through_even_a_waited_slice() -> None:
    progress, kit = _landed(4)
    assert progress.wait_for_slice(3)
    progress.failed("the kernel moved 0 of 10 items")
    assert not progress.wait_for_slice(1) and not progress.wait_for_slice(3)


class _Stream(SimpleNamespace):
    pass


def test_the_device_kit_keys_streams_by_torchs_lookup_or_the_public_one(monkeypatch) -> None:
    """The CUDA kit's key is torch's current-stream triple (its private lookup where present, else the public
    current_stream), equal for the same stream and different for another; a private lookup that fails falls back."""
    import torch

    from lmcache_npu.transfer.streams import DeviceStreamKit

    current = {"id": 7}
    module = SimpleNamespace(current_stream=lambda device: _Stream(stream_id=current["id"], device_index=0,
                                                                   device_type=1))
    public = DeviceStreamKit(torch.device("cpu"), module)  # no private lookup off CUDA
    first = public.stream_key()
    current["id"] = 9
    assert first == (7, 0, 1) and public.stream_key() == (9, 0, 1) != first

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (current["id"], index, 1), raising=False)
    fast = DeviceStreamKit(torch.device("cuda", 0), module)
    assert fast.stream_key() == (9, 0, 1)

    def changed(index: int) -> Any:
        raise TypeError("the private lookup takes other arguments now")

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", changed, raising=False)
    broken = DeviceStreamKit(torch.device("cuda", 0), module)
    assert broken.stream_key() == (9, 0, 1) and broken.stream_key() == (9, 0, 1)  # the public lookup, twice
