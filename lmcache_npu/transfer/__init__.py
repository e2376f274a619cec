"""Moving chunks between device pages and host arena slots off the model's path (the worker side of a step).

`KVMover` is the store executor's `DeviceMover`: a lane per direction (thread, backend, stream) runs each step's
loads and stores as one kernel launch each, ordered against the model's stream by events (`streams.py`), from the
device moves the scheduler sent (each a command with its block window, `plans.py`). Nothing here knows vLLM.
"""

from ..store.commands import BlockWindow, DeviceMove
from .mover import KVMover
from .plans import LoadPlan, StorePlan
from .streams import DeviceStreamKit, StreamKit

__all__ = ["BlockWindow", "DeviceMove", "DeviceStreamKit", "KVMover", "LoadPlan", "StorePlan", "StreamKit"]
