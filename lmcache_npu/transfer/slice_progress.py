"""`SlicedLoad`: how far a sliced load (`KVMover.run_sliced`) has come, slice by slice, for the model's thread.

The lane marks each slice once its batch is launched and an event recorded after it on the lane's stream (on the
host, where the copy runs to its end and events are None, once its bytes are in the pages). `wait_for_slice` makes
the model's stream wait for that event: the host waits only until the lane has launched the slice, never for the
device. A stream that already waits for a slice (or a later one: slices land in order) is not made to wait again, so
the layers of one slice after the first cost a lookup each, not a stream wait. A failed load marks every slice not
yet marked, so no waiter hangs, and says why in `failure`.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable, Optional

from .slices import SlicePlan
from .streams import StreamKit


class SlicedLoad:
    """One sliced load's per-slice launch marks and events; made by `KVMover.run_sliced` (on the path to slice 0:
    one condition for all slices, as slices are marked in order, not one threading.Event each)."""

    def __init__(self, slices: SlicePlan, kit: StreamKit) -> None:
        self.slices = slices
        self._kit = kit  # the model thread's view: waits go on the model's stream
        self._count = len(slices.slices)
        self._marked = 0  # slices [0, _marked) are launched (all of them once the load failed)
        self._changed = threading.Condition(threading.Lock())
        self._events: list[Optional[Any]] = [None] * self._count
        self._waited: dict[Hashable, int] = {}  # per stream (StreamKit.stream_key): the last slice it waits for
        self.failure = ""  # why the load failed ("" while it has not)

    # ---- the lane's thread --------------------------------------------------------------------------------------

    def landed(self, index: int, event: Optional[Any]) -> None:
        """Slice `index` is launched; `event` completes when its bytes are in the pages (None: they are already).
        Slices are marked in order: each after the one before."""
        with self._changed:
            if index != self._marked and not self.failure:
                raise ValueError(f"slice {index} marked after {self._marked} slices: slices land in order")
            self._events[index] = event
            self._marked = max(self._marked, index + 1)
            self._changed.notify_all()

    def failed(self, reason: str) -> None:
        """The load failed: every slice not marked yet is marked (its pages hold no loaded bytes)."""
        with self._changed:
            self.failure = self.failure or reason
            self._marked = self._count
            self._changed.notify_all()

    # ---- the model's thread -------------------------------------------------------------------------------------

    def launched(self, index: int) -> bool:
        return index < self._marked

    @property
    def finished(self) -> bool:
        """Every slice is launched (or the load failed)."""
        return self._marked == self._count

    def event(self, index: int) -> Optional[Any]:
        """Slice `index`'s event (None on the host, or before the slice is launched)."""
        return self._events[index]

    def wait_for_slice(self, index: int, timeout: Optional[float] = None) -> bool:
        """The model's stream waits for slices 0..`index` (their events complete in lane order, so the last one
        covers them); the host waits only for the launch. False when it was not launched within `timeout` or the
        load failed (the caller then must not run on these pages)."""
        if not 0 <= index < self._count:
            raise ValueError(f"slice {index} does not exist: the load has {self._count} slices")
        stream = self._kit.stream_key()
        if index <= self._waited.get(stream, -1) and not self.failure:
            return True  # this stream already waits for this slice or a later one: a layer's hook adds nothing
        if self._marked <= index:  # not launched yet: wait (a launched slice is read without the lock)
            with self._changed:
                if not self._changed.wait_for(lambda: self._marked > index, timeout):
                    return False
        if self.failure:
            return False
        self._kit.wait(self._events[index])
        self._waited[stream] = index
        return True

    def wait_for_layer(self, layer: str, timeout: Optional[float] = None) -> bool:
        """`wait_for_slice` for the slice holding what `layer` consumes; a layer that was not announced waits for
        the whole load (its planes' slice is unknown)."""
        index = self.slices.slice_of_layer(layer)
        return self.wait_for_slice(self._count - 1 if index is None else index, timeout)
