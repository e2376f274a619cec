"""Percentiles and spreads: TTFT p50/p90 over a turn's requests, and median/min/max over a replay's repeats."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) by linear interpolation between closest ranks (numpy's default, "linear")."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    if any(math.isnan(v) for v in ordered):
        raise ValueError("percentile of values holding a NaN")
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclass(frozen=True)
class Spread:
    """One measurement over a replay's repeats: the median and the range."""

    median: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


def spread_of(values: Iterable[float]) -> Spread:
    """The median (percentile 50), min and max of the repeats' values."""
    values = list(values)
    if not values:
        raise ValueError("spread of no values")
    return Spread(percentile(values, 50), min(values), max(values))
