"""Comparing two engines' completions of the same prompts: greedy tokens must match exactly, and the logprobs both
recorded within a tolerance (a loaded prefix must give what computing it gives)."""

from __future__ import annotations

from typing import Optional, Sequence

from .engine import Completion

LOGPROB_TOLERANCE = 1e-4  # fp32


def first_difference(reference: Completion, candidate: Completion,
                     tolerance: Optional[float] = LOGPROB_TOLERANCE) -> str:
    """Where `candidate` first departs from `reference` ("" when it does not); `tolerance` None: tokens only."""
    if reference.token_ids != candidate.token_ids:
        step = next((k for k, (a, b) in enumerate(zip(reference.token_ids, candidate.token_ids)) if a != b),
                    min(len(reference.token_ids), len(candidate.token_ids)))
        return f"tokens differ from step {step} on"
    if tolerance is None:
        return ""
    departures = ((step, token, a[token], b[token])
                  for step, (a, b) in enumerate(zip(reference.logprobs, candidate.logprobs))
                  for token in sorted(a.keys() & b.keys()) if abs(a[token] - b[token]) > tolerance)
    first = next(departures, None)
    if first is None:
        return ""
    step, token, expected, actual = first
    return f"step {step}, token {token}: logprob {actual:.6f} vs {expected:.6f}"


def differences(reference: Sequence[Completion], candidate: Sequence[Completion],
                tolerance: Optional[float] = LOGPROB_TOLERANCE) -> list[str]:
    """The first departure of each request of `candidate` (empty: every request identical)."""
    if len(reference) != len(candidate):
        return [f"{len(candidate)} completions, expected {len(reference)}"]
    return [f"request {i}: {found}" for i, (ref, got) in enumerate(zip(reference, candidate))
            if (found := first_difference(ref, got, tolerance))]
