"""The compute side of the cost model: an engine step's seconds from what it schedules, learned from the steps.

A step that schedules tokens `[sᵣ, sᵣ + nᵣ)` of each request r takes `a + b·Σnᵣ + c·Σ attention(sᵣ, nᵣ)` seconds,
where attention counts, per scheduled token, the context it attends to (its position + 1): the linear terms of a
transformer step (weights, per-token work) in b, the attention over the context in c, and everything a step pays
once (the scheduler, launch, sampling, the output's way back) in a. A request's prefill of `[s, e)` then costs
`a·steps + b·(e − s) + c·attention(s, e − s)` when vLLM's token budget splits it into `steps` steps.

What is observed, and why: a step's time in the scheduler's process, from its `build_connector_meta` (both API
eras call it once per schedule, with each request's scheduled and computed tokens) to the `update_connector_output`
that brings back its output, identified by the step number the workers echo in their metadata: a worker's host
time around the forward is only the launch time on an NPU or a GPU, while the output comes back once the step is
done, whatever the device. With async scheduling the next schedule runs while a step executes, so a step counts
from the later of its schedule and the previous output: the engine's step period, which is what a waiting request
waits for. Pairing by number keeps a step's time with its own shape (the interval between two schedules belongs to
the step before under async scheduling) and never spans an idle engine. Steps that schedule nothing are not timed.
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
_OPEN_KEPT = 64  # steps scheduled and not yet done that are remembered (vLLM keeps at most two in flight)


def attention(start: int, count: int) -> float:
    """Σ (p + 1) for p in [start, start + count): the context each of `count` tokens from position `start` reads."""
    return count * start + count * (count + 1) / 2


@dataclass(frozen=True)
class StepShape:
    """What one step schedules, as the fit's features."""

    tokens: int
    attention: float
    requests: int = 0  # requests it computes for (not a feature: who a new request's compute would delay)

    @classmethod
    def of(cls, scheduled: Iterable[tuple[int, int]]) -> "StepShape":
        """From (computed tokens, scheduled tokens) of each scheduled request."""
        tokens, context, requests = 0, 0.0, 0
        for start, count in scheduled:
            tokens += count
            context += attention(start, count)
            requests += count > 0
        return cls(tokens, context, requests)

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
        self.sharing = 0  # requests the last schedule computed for: a new request's compute lengthens their steps
        self._open: dict[int, tuple[StepShape, float]] = {}  # step number -> (shape, when scheduled), until done
        self._next = 0
        self._last_done = float("-inf")  # when the last output came back

    @property
    def fitted(self) -> bool:
        return self.fit.observations >= MIN_STEPS

    def on_schedule(self, shape: StepShape, now: float) -> Optional[int]:
        """A schedule at `now`: its step number (for the workers to echo), or None when it computes nothing."""
        self.busy = shape.tokens > 0
        self.sharing = shape.requests
        if not self.busy:
            return None
        step, self._next = self._next, self._next + 1
        self._open[step] = (shape, now)
        if len(self._open) > _OPEN_KEPT:  # an echo that never came (a step that did not run)
            del self._open[next(iter(self._open))]
        return step

    def on_done(self, steps: Iterable[int], now: float) -> list[tuple[float, float]]:
        """An output came back at `now` with these steps done; returns (predicted, observed) seconds of each timed."""
        seen = []
        for step in sorted(set(steps)):
            opened = self._open.pop(step, None)
            if opened is None:
                continue
            observed = now - max(opened[1], self._last_done)
            if observed <= 0:
                continue
            seen.append((self.fit.observe(opened[0].features(), observed), observed))
            self.recent_step_s = observed if self.recent_step_s == 0 else 0.9 * self.recent_step_s + 0.1 * observed
        self._last_done = now
        return seen

    def idle(self) -> None:
        """No request is left: a load waits for no one else's step."""
        self.busy = False
        self.sharing = 0

    def prefill_s(self, start: np.ndarray, end: int) -> np.ndarray:
        """Predicted seconds to compute a request's tokens [start, end) per start (at least the token vLLM always
        computes)."""
        a, b, c = self.fit.coefficients
        count = np.maximum(end - start, 1).astype(np.float64)
        return a * np.ceil(count / self.budget) + b * count + c * attention(start, count)  # type: ignore[arg-type]

    def backlog_s(self, spans: Iterable[tuple[int, int]]) -> float:
        """Predicted seconds to compute tokens [start, end) of several requests scheduled together: the step's fixed
        cost once per budget's worth of tokens, not once per request."""
        a, b, c = self.fit.coefficients
        tokens, context = 0, 0.0
        for start, end in spans:
            if end > start:
                tokens += end - start
                context += attention(start, end - start)
        return a * -(-tokens // self.budget) + b * tokens + c * context if tokens else 0.0

    def sharers(self) -> float:
        """Requests whose steps a new request's compute lengthens (those the last schedule computed for; 0 idle)."""
        return float(self.sharing)  # set with `busy` from the same schedule, and 0 whenever it is not busy

    def step_floor_s(self) -> float:
        """The least a load delays its request: while other requests compute, the step they run meanwhile (the
        recent step period); on an otherwise idle engine nothing (the empty step that runs the load costs the load)."""
        return self.recent_step_s if self.busy else 0.0

    def state(self) -> FitState:
        return self.fit.state()
