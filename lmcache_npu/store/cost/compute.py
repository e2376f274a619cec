"""The compute side of the cost model: an engine step's seconds from what it schedules, learned from the steps.

A step that schedules tokens `[sᵣ, sᵣ + nᵣ)` of each request r takes `a + b·Σnᵣ + c·Σ attention(sᵣ, nᵣ)` seconds,
where attention counts, per scheduled token, the context it attends to (its position + 1): the linear terms of a
transformer step (weights, per-token work) in b, the attention over the context in c, and everything a step pays
once (the scheduler, launch, sampling, the output's way back) in a. A request's prefill of `[s, e)` then costs
`a·steps + b·(e − s) + c·attention(s, e − s)` when vLLM's token budget splits it into `steps` steps.

What is observed, and why: the time from one `build_connector_meta` to the next. Both API eras call it once per
schedule with the scheduled tokens (and each request's computed tokens), in the scheduler's process, whatever the
device; a worker's host time around the forward is only the launch time on an NPU or GPU. With async scheduling the
next schedule runs while the step executes, so the interval is the engine's step period, which is what a waiting
request waits for. An interval is not a step where the engine may have idled inside it (no request left
unfinished: `StepClock.interrupt`) or where it scheduled nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from .fit import FitState, LinearFit

# steps before the compute side is trusted to decline a hit: until then every hit is claimed, as without the model
MIN_STEPS = 16
_SCALES = (1.0, 1024.0, 1024.0 * 1024.0)  # a step, 1K tokens, 1K tokens over a 1K context
_STEP_HALF_LIFE = 500.0  # steps: a workload's shape changes over minutes, a model's speed does not


def attention(start: int, count: int) -> float:
    """Σ (p + 1) for p in [start, start + count): the context each of `count` tokens from position `start` reads."""
    return count * start + count * (count + 1) / 2


@dataclass(frozen=True)
class StepShape:
    """What one step schedules, as the fit's features."""

    tokens: int
    attention: float

    @classmethod
    def of(cls, scheduled: Iterable[tuple[int, int]]) -> "StepShape":
        """From (computed tokens, scheduled tokens) of each scheduled request."""
        tokens, context = 0, 0.0
        for start, count in scheduled:
            tokens += count
            context += attention(start, count)
        return cls(tokens, context)

    def features(self) -> tuple[float, float, float]:
        return (1.0, float(self.tokens), self.attention)


class ComputeModel:
    """The step-time fit and the recent step period; `budget` is vLLM's token budget per step
    (`max_num_batched_tokens`), which splits a long prefill into steps."""

    def __init__(self, budget: int) -> None:
        self.budget = max(int(budget), 1)
        self.fit = LinearFit(seed=(0.0, 0.0, 0.0), scales=_SCALES, prior_weight=1e-3, half_life=_STEP_HALF_LIFE)
        self.recent_step_s = 0.0  # an EWMA of observed step seconds: how long a request waits for one step
        self.busy = False  # the last schedule computed something: a load waits a whole step of the others
        self._open: Optional[tuple[StepShape, float]] = None

    @property
    def fitted(self) -> bool:
        return self.fit.observations >= MIN_STEPS

    def on_step(self, shape: StepShape, now: float) -> Optional[tuple[float, float]]:
        """A schedule at `now`: closes the previous step; returns its (predicted, observed) seconds when it counts."""
        closed, self._open = self._open, (shape, now)
        self.busy = shape.tokens > 0
        if closed is None or closed[0].tokens <= 0:
            return None
        observed = now - closed[1]
        if observed <= 0:
            return None
        predicted = self.fit.observe(closed[0].features(), observed)
        self.recent_step_s = observed if self.recent_step_s == 0 else 0.9 * self.recent_step_s + 0.1 * observed
        return predicted, observed

    def interrupt(self) -> None:
        """The engine may idle before the next schedule: the open step's interval would not be a step."""
        self._open = None

    def prefill_s(self, start: np.ndarray, end: int) -> np.ndarray:
        """Predicted seconds to compute a request's tokens [start, end) per start (at least the token vLLM always
        computes)."""
        a, b, c = self.fit.coefficients
        count = np.maximum(end - start, 1).astype(np.float64)
        return a * np.ceil(count / self.budget) + b * count + c * attention(start, count)  # type: ignore[arg-type]

    def step_floor_s(self) -> float:
        """The least a load delays its request: the recent step period while others compute, else an empty step
        (what every step pays: the fit's constant)."""
        overhead = self.fit.coefficients[0]
        return max(self.recent_step_s, overhead) if self.busy else overhead

    def state(self) -> FitState:
        return self.fit.state()
