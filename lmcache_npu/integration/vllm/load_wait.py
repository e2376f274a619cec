"""How long `get_finished` may wait for loads, so a request's KV is reported in the step it lands.

A load reported one step late costs its request a whole step of TTFT: vLLM schedules a request waiting for its KV
only after a step's output says the load finished. Two waits keep that step:

* an idle step (vLLM computes nothing: every runnable request waits for its KV) waits up to `IDLE_WAIT_S` for any
  pending load, rather than spin through empty steps that take CPU from the transfer;
* where the model runs on the host (a CPU KV cache), a step waits for the loads it queued itself, up to a share of
  the step: vLLM >= 0.30 starts loads after the forward, which on the host has already run, so without the wait
  every load would be seen a step later; an arena load of a few chunks is a memory copy of about a millisecond.
  On an accelerator the host thread is ahead of the device, and async scheduling keeps it there: a load waits for
  the model's stream as it was when queued, which on vLLM >= 0.30 is after the forward, so waiting would hold the
  host until the forward ended; loads there are seen when polled.

The step's share is bounded by the step itself: the time from the end of one `get_finished` to the start of the next
(the wait left out, so a wait never lengthens the step it is a share of), smoothed, and a sample counts for at most
twice the estimate (an engine that idled for seconds between requests does not step; that gap is not a step). A load
slower than expected costs at most that share of one step, never a stall.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

# The longest an empty step waits for a load: short, so a request arriving meanwhile is scheduled almost at once.
IDLE_WAIT_S = 0.01
# A busy step waits for its own loads at most this share of a step, and never longer than STEP_WAIT_CAP_S.
STEP_WAIT_SHARE = 0.25
STEP_WAIT_CAP_S = 0.02
# Before any step interval is known (the first steps), the budget is this.
FIRST_STEP_WAIT_S = 0.002
_SMOOTHING = 0.2  # weight of the newest interval in the running step estimate


class StepLoadWait:
    """The step's length between `get_finished` calls, and from it the wait budget for a step's own loads: `begin` as
    `get_finished` starts, `budget` for its wait, `end` once the wait is over."""

    def __init__(self, share: float = STEP_WAIT_SHARE, cap_s: float = STEP_WAIT_CAP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"step load wait share {share} must lie in [0, 1]")
        if cap_s < 0:
            raise ValueError(f"step load wait cap {cap_s} s must not be negative")
        self.share = share
        self.cap_s = cap_s
        self._clock = clock
        self._last: Optional[float] = None
        self.step_s: Optional[float] = None  # the smoothed step length, once a whole step was seen

    def begin(self) -> None:
        """`get_finished` starts: a step ran since the previous `end`."""
        now = self._clock()
        if self._last is not None:
            sample = now - self._last
            if self.step_s is None:
                self.step_s = sample
            else:  # an idle gap is no step: a sample counts for at most twice the estimate
                self.step_s += _SMOOTHING * (min(sample, 2 * self.step_s) - self.step_s)
        self._last = None

    def end(self) -> None:
        """`get_finished`'s wait is over: the next step starts now."""
        self._last = self._clock()

    def budget(self) -> float:
        """Seconds this step may wait for the loads it queued."""
        if self.step_s is None:
            return min(FIRST_STEP_WAIT_S, self.cap_s)
        return min(self.share * self.step_s, self.cap_s)
