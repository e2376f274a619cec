"""Stream and event operations of one device family, so the worker code is the same on NPU, CUDA and CPU.

On NPU and CUDA the transfers run on a side stream; an event recorded on the model's stream orders them after the
model's writes, and an event recorded after a kernel lets the model's stream wait for it, never the host for the
device. Host memory (the CPU attention backend) has no streams: the transfer thread runs each copy to its end,
so its events are `None` and waiting is done on the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Hashable, Iterator, Optional

import torch


class StreamKit:
    """Host memory: no streams, no events."""

    def bind_thread(self) -> None:
        """Called once on the transfer thread before its first transfer."""

    def record(self) -> Optional[Any]:
        """An event at the current stream's present position (None on the host)."""
        return None

    def wait(self, event: Optional[Any]) -> None:
        """The current stream waits for `event` before its later work (the host never blocks here)."""

    def stream_key(self) -> Hashable:
        """Which stream is current on this thread, as a key equal for the same stream (None on the host): a sliced
        load's per-layer waits skip a slice the stream already waits for."""
        return None

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """The transfer thread's own stream becomes current inside."""
        yield

    @staticmethod
    def for_device(device: torch.device) -> "StreamKit":
        if device.type == "cpu":
            return StreamKit()
        if device.type == "cuda":
            # High priority: a transfer's blocks take SMs as the model's free them, instead of waiting out a whole
            # forward, and the model loses no time to them (docs/performance.md, `bench --overlap`).
            return DeviceStreamKit(device, torch.cuda, high_priority=True)
        if device.type == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu; imported only when NPU tensors exist)

            return DeviceStreamKit(device, torch.npu)  # type: ignore[attr-defined]
        raise ValueError(f"KV caches on {device} are not supported: expected npu, cuda or cpu tensors")


class DeviceStreamKit(StreamKit):
    """torch.cuda or torch.npu, which share the stream and event API."""

    def __init__(self, device: torch.device, module: Any, high_priority: bool = False) -> None:
        self.device = device
        self._module = module
        self._high_priority = high_priority  # else the module's default stream priority
        self._stream: Optional[Any] = None
        # torch's own current-stream lookup without building a Stream object (CUDA builds; a hook calls it per layer)
        self._fast_current = getattr(torch._C, "_cuda_getCurrentStream", None) if device.type == "cuda" else None

    def bind_thread(self) -> None:
        self._module.set_device(self.device)
        if self._high_priority:
            highest = self._module.Stream.priority_range()[1]  # (least, greatest): lower numbers come first
            self._stream = self._module.Stream(self.device, priority=highest)
        else:
            self._stream = self._module.Stream(self.device)

    def record(self) -> Any:
        event = self._module.Event()
        event.record(self._module.current_stream(self.device))
        return event

    def wait(self, event: Optional[Any]) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def stream_key(self) -> Hashable:
        if self._fast_current is not None and self.device.index is not None:
            try:
                return tuple(self._fast_current(self.device.index))  # (stream id, device index, device type)
            except Exception:  # a torch whose private lookup changed: the public one from now on, never a failed hook
                self._fast_current = None
        stream = self._module.current_stream(self.device)
        return (stream.stream_id, stream.device_index, stream.device_type)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        # the device's current stream set and restored directly: torch's stream context looks the current device
        # up several times, which a sliced load pays on its path to slice 0
        assert self._stream is not None, "bind_thread() first"
        previous = self._module.current_stream(self.device)
        self._module.set_stream(self._stream)
        try:
            yield
        finally:
            self._module.set_stream(previous)
