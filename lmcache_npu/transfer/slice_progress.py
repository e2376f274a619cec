"""`SlicedLoad`: how far a sliced load (`KVMover.run_sliced`) has come, slice by slice, for the model's thread.

The lane marks each slice once its batch is launched and an event recorded after it on the lane's stream (on the
host, where the copy runs to its end and events are None, once its bytes are in the pages). `wait_for_slice` makes
the model's stream wait for that event: the host waits only until the lane has launched the slice, never for the
device. A failed load marks every slice not yet marked, so no waiter hangs, and says why in `failure`.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from .slices import SlicePlan
from .streams import StreamKit


class SlicedLoad:
    """One sliced load's per-slice launch marks and events; made by `KVMover.run_sliced`."""

    def __init__(self, slices: SlicePlan, kit: StreamKit) -> None:
        self.slices = slices
        self._kit = kit  # the model thread's view: waits go on the model's stream
        self._launched = [threading.Event() for _ in slices.slices]
        self._events: list[Optional[Any]] = [None] * len(slices.slices)
        self.failure = ""  # why the load failed ("" while it has not)

    # ---- the lane's thread --------------------------------------------------------------------------------------

    def landed(self, index: int, event: Optional[Any]) -> None:
        """Slice `index` is launched; `event` completes when its bytes are in the pages (None: they are already)."""
        self._events[index] = event
        self._launched[index].set()

    def failed(self, reason: str) -> None:
        """The load failed: every slice not marked yet is marked (its pages hold no loaded bytes)."""
        self.failure = self.failure or reason
        for mark in self._launched:
            mark.set()

    # ---- the model's thread -------------------------------------------------------------------------------------

    def launched(self, index: int) -> bool:
        return self._launched[index].is_set()

    @property
    def finished(self) -> bool:
        """Every slice is launched (or the load failed)."""
        return all(mark.is_set() for mark in self._launched)

    def event(self, index: int) -> Optional[Any]:
        """Slice `index`'s event (None on the host, or before the slice is launched)."""
        return self._events[index]

    def wait_for_slice(self, index: int, timeout: Optional[float] = None) -> bool:
        """The model's stream waits for slices 0..`index` (their events complete in lane order, so the last one
        covers them); the host waits only for the launch. False when it was not launched within `timeout` or the
        load failed (the caller then must not run on these pages)."""
        if not 0 <= index < len(self._launched):
            raise ValueError(f"slice {index} does not exist: the load has {len(self._launched)} slices")
        if not self._launched[index].wait(timeout):
            return False
        if self.failure:
            return False
        self._kit.wait(self._events[index])
        return True

    def wait_for_layer(self, layer: str, timeout: Optional[float] = None) -> bool:
        """`wait_for_slice` for the slice holding what `layer` consumes; a layer that was not announced waits for
        the whole load (its planes' slice is unknown)."""
        index = self.slices.slice_of_layer(layer)
        return self.wait_for_slice(len(self._launched) - 1 if index is None else index, timeout)
