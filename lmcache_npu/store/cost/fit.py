"""An online least-squares fit `y ≈ θ·x` with θ ≥ 0, recency-weighted and pulled towards a seed.

Both halves of the cost model are linear in their unknowns: a step's seconds in (1, tokens, tokens × context) and a
transfer's seconds in (1, bytes). The fit keeps decayed sufficient statistics (Σ w·u·uᵀ, Σ w·u·y over features scaled
to order one) and solves the small normal equations when asked, so an observation costs a few multiplications and
old observations fade with a half-life counted in observations, not seconds (an idle engine forgets nothing).
A seed enters as a ridge of `prior_weight` pseudo-observations towards the seed's coefficients: it rules while
nothing was measured and halves with every `_SEED_HALF_LIFE` observations, since it stands only for what was not
measured yet (a ridge of 1e-9 stays, so a direction the data never varies, such as the latency of batches that all
have one size, keeps the seed's split). Coefficients are kept non-negative (a step never gets faster with more tokens;
a transfer never with more bytes) by refitting without any that came out negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

_RIDGE = 1e-9  # what stays of the seed's pull once its pseudo-observations have faded
_RESOLVE = 16  # observations a solution may lag behind
_SEED_HALF_LIFE = 8.0  # observations: a handful of measurements outweigh any seed


@dataclass(frozen=True)
class FitState:
    """What a fit says now (for logs, stats gauges and `doctor`)."""

    coefficients: tuple[float, ...]
    observations: float  # effective (decayed) count, the seed's pseudo-observations left out
    relative_sd: float  # the typical size of a prediction's error, as a share of the prediction


class LinearFit:
    """`y ≈ Σ θᵢ·xᵢ`, θ ≥ 0. `scales` are the typical size of each feature (what makes them comparable);
    `half_life` is in observations."""

    def __init__(self, seed: Sequence[float], scales: Sequence[float], prior_weight: float = 1.0,
                 half_life: float = 200.0) -> None:
        if len(seed) != len(scales) or not seed:
            raise ValueError(f"a fit needs one seed coefficient per feature scale, got {len(seed)} and {len(scales)}")
        if any(s <= 0 for s in scales) or any(c < 0 for c in seed) or prior_weight <= 0 or half_life <= 0:
            raise ValueError("feature scales, prior weight and half-life must be positive, seeds non-negative")
        self._scales = np.asarray(scales, dtype=np.float64)
        self._seed = np.asarray(seed, dtype=np.float64) * self._scales  # in scaled units
        self._prior = float(prior_weight)
        self._decay = 0.5 ** (1.0 / half_life)
        n = len(seed)
        self._gram = np.zeros((n, n))
        self._moment = np.zeros(n)
        self._count = 0  # observations ever taken (the seed's age)
        self._weight = 0.0  # decayed count of observations
        self._sq_rel_error = 0.0  # decayed mean of squared relative errors (before each update)
        self._theta = self._seed.copy()  # the last solution (scaled units)
        self._stale = 0  # observations since the last solve: solved again when asked, or every _RESOLVE of them

    def predict(self, x: Sequence[float]) -> float:
        u = np.asarray(x, dtype=np.float64) / self._scales
        return float(max(u @ self._coefficients_scaled(), 0.0))

    def observe(self, x: Sequence[float], y: float) -> float:
        """Takes one observation; returns what the last solution predicted for it (the caller's calibration counter;
        a step observes every time, so solving waits until a decision asks)."""
        u = np.asarray(x, dtype=np.float64) / self._scales
        before = max(float(u @ self._theta), 0.0)
        if not math.isfinite(y) or y < 0:
            return before
        scale = max(before, y, 1e-9)
        d = self._decay
        self._sq_rel_error = d * self._sq_rel_error + (1 - d) * ((y - before) / scale) ** 2
        self._gram = d * self._gram + np.outer(u, u)
        self._moment = d * self._moment + u * y
        self._weight = d * self._weight + 1.0
        self._count += 1
        self._stale += 1
        if self._stale >= _RESOLVE:  # the calibration counters compare against a recent solution
            self._coefficients_scaled()
        return before

    @property
    def observations(self) -> float:
        return self._weight

    @property
    def relative_sd(self) -> float:
        """The recency-weighted root mean square of relative prediction errors; 1 (no trust) before the first."""
        if self._weight < 1.0:
            return 1.0
        return math.sqrt(self._sq_rel_error / (self._weight * (1 - self._decay)))  # bias of the decayed mean removed

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(float(c) for c in self._coefficients_scaled() / self._scales)

    def state(self) -> FitState:
        return FitState(self.coefficients, round(self._weight, 3), self.relative_sd)

    def _coefficients_scaled(self) -> np.ndarray:
        if self._stale:
            self._theta, self._stale = self._solve(), 0
        return self._theta

    def _solve(self) -> np.ndarray:
        """Ridge towards the seed; a coefficient that comes out negative is pinned at 0 and the rest refit."""
        n = len(self._seed)
        free = np.ones(n, dtype=bool)
        theta = np.zeros(n)
        ridge = self._prior * 0.5 ** (self._count / _SEED_HALF_LIFE) + _RIDGE
        for _ in range(n):
            a = self._gram[np.ix_(free, free)] + ridge * np.eye(int(free.sum()))
            b = self._moment[free] + ridge * self._seed[free]
            try:
                solved = np.linalg.solve(a, b)
            except np.linalg.LinAlgError:  # cannot happen with a positive prior; keep the seed rather than raise
                return self._seed.copy()
            theta = np.zeros(n)
            theta[free] = solved
            if (solved >= 0).all():
                return theta
            free &= theta > 0
            if not free.any():
                break
        return np.clip(theta, 0.0, None)
