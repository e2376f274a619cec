"""The worker's sliced loads (issue 41 item 3): the loads of requests that compute in this step, waited for per layer.

`start_load_kv` launches every sliced load of the step as one `SlicedLoad` (one kernel launch per slice, in the order
the hook map learned the forward announces its layers) and makes the model's stream wait for slice 0, which holds
every plane no announced layer consumes. Each `wait_for_layer_load(layer)` then makes the model's stream wait for
the slice that layer consumes (a stream wait on the device; the host waits only until the lane has launched it).

Once the forward is done (`wait_for_save`) the guard checks that every layer whose slice came after slice 0 announced
itself: a layer that ran without calling the hook (an attention path that skips it on some steps, vllm-ascend's MLA
on short extends) may have read pages before its slice landed, so the step's sliced loads are reported failed and
vLLM recomputes their blocks and drops the step's token. The model's stream then waits for every slice, so no slice
can land under a later step's writes. A slice the lane has not launched within `SLICE_WAIT_S` fails the loads too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ...layout.discovery import KVLayout
from ...store.commands import DeviceMove
from ...store.executor import StoreExecutor
from ...store.metrics import Metric
from ...store.tier import TierCounters
from ...transfer.slice_progress import SlicedLoad
from ...transfer.slices import SlicePlan, plan_slices
from ...transfer.plans import LoadPlan

logger = logging.getLogger(__name__)

# how long the model's thread waits for the lane to launch a slice before it gives the step's sliced loads up (only a
# stalled lane reaches it: a launch takes microseconds on a device, a copy of one slice milliseconds on the host)
SLICE_WAIT_S = 30.0


@dataclass
class SlicedStep:
    """One step's sliced load: what the forward waits on, the plans it serves, and why it failed ("" while it has
    not). The plans' own commands still report their transfer's outcome."""

    progress: Optional[SlicedLoad]
    plans: list[LoadPlan]
    failure: str = ""
    unwaited: tuple[str, ...] = field(default=())  # layers that consume a late slice and never waited for it

    def fail(self, reason: str) -> None:
        self.failure = self.failure or reason


class SlicedLoads:
    """Per worker: the slice plans (one per learned layer order), and this step's sliced load."""

    def __init__(self, layout: KVLayout, slices: int, counters: TierCounters, wait_s: Optional[float] = None) -> None:
        self.layout = layout
        self.slices = slices
        self.counters = counters
        self.wait_s = SLICE_WAIT_S if wait_s is None else wait_s
        # kept for good: the lanes prepare each slice's tables once, keyed by the plan object
        self._plans: dict[tuple[tuple[str, ...], int], SlicePlan] = {}
        self.step: Optional[SlicedStep] = None

    def plan(self, announced: Sequence[str]) -> SlicePlan:
        """The slices for a forward that announces `announced` (nothing learned yet: one slice, waited for before
        the forward)."""
        order = tuple(announced)
        count = min(self.slices, max(len(order), 1))
        key = (order, count)
        if key not in self._plans:
            self._plans[key] = plan_slices(self.layout, order, count)
        return self._plans[key]

    def start(self, executor: StoreExecutor, moves: list[DeviceMove], plans: list[LoadPlan],
              announced: Sequence[str]) -> None:
        """Launches the step's sliced loads and makes the model's stream wait for slice 0."""
        step = self.step = SlicedStep(executor.submit_sliced(moves, self.plan(announced)), plans)
        if step.progress is None:
            step.fail("the sliced load was refused before it launched")
        elif not step.progress.wait_for_slice(0, self.wait_s):
            step.fail(step.progress.failure or f"slice 0 was not launched within {self.wait_s:g} s")

    def wait_for_layer(self, layer_name: str) -> None:
        """The model's stream waits for the slice `layer_name` consumes (the whole load for a layer not planned)."""
        step = self.step
        if step is None or step.failure or step.progress is None:
            return
        if not step.progress.wait_for_layer(layer_name, self.wait_s):
            step.fail(step.progress.failure or f"the slice of layer {layer_name} was not launched within "
                      f"{self.wait_s:g} s")

    def end_forward(self, announced_now: Callable[[str], bool]) -> Optional[SlicedStep]:
        """The forward is done: the guard (module docstring), then the model's stream waits for every slice. Returns
        the step's sliced load for its verdict (None: the step had none)."""
        step, self.step = self.step, None
        if step is None:
            return None
        progress = step.progress
        if progress is not None:
            late = [layer for piece in progress.slices.slices[1:] if not piece.empty for layer in piece.layers]
            step.unwaited = tuple(layer for layer in late if not announced_now(layer))
            if step.unwaited:
                self.counters.add(Metric.SLICED_LOAD_UNWAITED, len(step.plans))
                step.fail(f"layers {', '.join(step.unwaited[:3])} ran without waiting for their slice")
            if not progress.wait_for_slice(len(progress.slices) - 1, self.wait_s):
                step.fail(progress.failure or f"the load's last slice was not launched within {self.wait_s:g} s")
        return step
