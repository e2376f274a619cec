"""The device <-> arena routes: stores and loads move bytes between the device's paged KV cache and arena slots
through a `DeviceMover` (the connector's transfer lanes; a fake in tests), one batch per call. The connector's
commands are `DeviceMove`s (each Store/Load with its block window); the route passes them on whole."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch

from ..commands import ARENA_TO_DEVICE, DEVICE_TO_ARENA, DeviceMove, Load, Store, arena_end
from ..tier import Failure, TierResult
from .context import Report, RouteContext

logger = logging.getLogger(__name__)

# what a device route carries: device moves (the connector's), or bare Stores/Loads for movers that need no window
DeviceMovable = Union[DeviceMove, Store, Load]


class DeviceMover(Protocol):
    """Moves chunk objects between the device's paged KV cache and arena slots (one batch per call). It may raise
    only before any copy started (then the batch fails and its slots are freed); afterwards it must report."""

    def run(self, commands: Sequence[DeviceMovable], objects: Sequence[torch.Tensor], report: Report) -> None:
        """Store: device → objects[i]; Load: objects[i] → device. Calls `report(cmd_id, result)` once per command,
        now or later (an asynchronous copy reports when its event completes)."""
        ...


class DeviceRoute:
    """Device <-> arena on the model's thread: the mover copies (or starts copying) each batch; each command is
    answered once even when the mover reports and then raises. `tier` is the mover (None: every command fails)."""

    routes = frozenset({DEVICE_TO_ARENA, ARENA_TO_DEVICE})
    batched = True  # consecutive stores (or loads) are one transfer, one kernel launch

    def __init__(self, context: RouteContext, mover: Optional[DeviceMover]) -> None:
        self.context = context
        self.tier = mover

    def submit(self, batch: Sequence[DeviceMovable]) -> None:
        self._run(batch, lambda objects, report: self.tier.run(batch, objects, report))  # type: ignore[union-attr]

    def submit_sliced(self, batch: Sequence[DeviceMove], slices: Any) -> Optional[Any]:
        """Loads launched slice by slice (`SlicingMover.run_sliced`); returns the mover's handle, None when the batch
        was refused (then every command is answered as failed)."""
        if self.tier is not None and not hasattr(self.tier, "run_sliced"):
            raise ValueError(f"the device mover {type(self.tier).__name__} cannot launch a load slice by slice")
        return self._run(batch, lambda objects, report: self.tier.run_sliced(  # type: ignore[union-attr]
            batch, objects, report, slices))

    def _run(self, batch: Sequence[DeviceMovable], launch: Callable[[list[torch.Tensor], Report], Any]) -> Any:
        """`launch(objects, report)` with each command answered once even when the mover reports and then raises."""
        report = self.context.report
        if self.tier is None:
            for command in batch:
                report(command.cmd_id, TierResult.fail(Failure.NO_DEVICE_MOVER))
            return None
        objects = [self.context.arena.slot(c.slot) for c in batch]
        unanswered = {c.cmd_id for c in batch}

        def report_once(cmd_id: int, result: TierResult) -> None:
            with self.context.lock:
                if cmd_id not in unanswered:
                    return
                unanswered.discard(cmd_id)
            report(cmd_id, result)

        try:
            return launch(objects, report_once)
        except Exception as exc:  # a refused transfer fails its commands; the index frees their slots
            logger.exception("rank %d: device %s of %d chunks raised", self.context.rank,
                             "store" if isinstance(arena_end(batch[0]), Store) else "load", len(batch))
            for command in batch:
                report_once(command.cmd_id, TierResult.fail(Failure.DEVICE, str(exc)))
            return None

    def close(self) -> None:
        """The mover is the pipeline's: it closes it."""
