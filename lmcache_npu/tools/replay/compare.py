"""Comparing two engines' completions of the same prompts: a loaded prefix must give what computing it gives.

Greedy tokens must match, and the top-k logprobs both runs recorded must agree within the model dtype's tolerance.
A bf16 or fp16 model's logits are rounded to that precision, and CPU kernels may round a prefix read back from the
cache one unit differently from the same prefix computed in one pass (vLLM's AMX attention on Intel hosts does), so
where the reference's two best tokens were within the tolerance of each other (a near tie) the candidate may take
the other one: that completion is compared up to there and the rest is another continuation. The engine tests
check the loaded rows byte for byte besides, which no rounding excuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .engine import Completion

LOGPROB_TOLERANCE = 1e-4  # fp32
# per model dtype: about two units in the last place of a logit between 2 and 4 (bf16 keeps 8 bits, fp16 11)
DTYPE_TOLERANCES = {"float32": LOGPROB_TOLERANCE, "bfloat16": 2.0 ** -5, "float16": 2.0 ** -8}


# vLLM's other names; "auto" may pick a 16-bit dtype for the model, so it gets the loosest tolerance
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16",
                 "auto": "bfloat16"}


def tolerance_for(dtype: str) -> float:
    """The logprob tolerance (and near-tie width) of a model served in `dtype` (vLLM's names and aliases)."""
    name = dtype.removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_TOLERANCES:
        raise ValueError(f"no logprob tolerance for model dtype {dtype!r}; known: "
                         f"{', '.join([*DTYPE_TOLERANCES, *DTYPE_ALIASES])}")
    return DTYPE_TOLERANCES[name]


@dataclass(frozen=True)
class Verdict:
    """How a candidate completion compares with its reference."""

    difference: str = ""  # where it departs beyond the tolerance ("" when it does not)
    near_tie: str = ""  # where it took the other token of a near tie (compared up to there)

    @property
    def identical(self) -> bool:
        return not self.difference and not self.near_tie


def _near_tie(reference: Completion, candidate: Completion, step: int, tolerance: float) -> bool:
    """Both runs saw the two tokens within `tolerance` of each other at `step` (each recorded both logprobs)."""
    if step >= len(reference.logprobs) or step >= len(candidate.logprobs):
        return False
    ours, theirs = reference.token_ids[step], candidate.token_ids[step]
    in_reference, in_candidate = reference.logprobs[step], candidate.logprobs[step]
    if not {ours, theirs} <= in_reference.keys() or not {ours, theirs} <= in_candidate.keys():
        return False
    return (in_reference[ours] - in_reference[theirs] <= tolerance
            and in_candidate[theirs] - in_candidate[ours] <= tolerance)


def compare(reference: Completion, candidate: Completion, tolerance: Optional[float] = LOGPROB_TOLERANCE,
            logprobs: bool = True) -> Verdict:
    """Where `candidate` departs from `reference`; `tolerance` None compares tokens only (no tie is excused);
    `logprobs` False compares tokens and reads the logprobs only to tell a near tie."""
    steps = min(len(reference.token_ids), len(candidate.token_ids))
    departure = next((k for k in range(steps) if reference.token_ids[k] != candidate.token_ids[k]), None)
    tie = ""
    if departure is None and len(reference.token_ids) != len(candidate.token_ids):
        return Verdict(difference=f"tokens differ from step {steps} on")
    if departure is not None:
        if tolerance is None or not _near_tie(reference, candidate, departure, tolerance):
            return Verdict(difference=f"tokens differ from step {departure} on")
        tie = f"took the other token of a near tie at step {departure}"
    if tolerance is None or not logprobs:
        return Verdict(near_tie=tie)
    compared = len(reference.token_ids) if departure is None else departure + 1
    recorded = (min(len(reference.logprobs), compared), min(len(candidate.logprobs), compared))
    if recorded[0] != recorded[1]:
        return Verdict(difference=f"logprobs recorded for {recorded[1]} steps, the reference for {recorded[0]}")
    for step, (a, b) in enumerate(zip(reference.logprobs[:compared], candidate.logprobs[:compared])):
        for token in sorted(a.keys() & b.keys()):
            if not abs(a[token] - b[token]) <= tolerance:  # a NaN on either side is a difference too
                return Verdict(difference=f"step {step}, token {token}: logprob {b[token]:.6f} vs {a[token]:.6f}")
    return Verdict(near_tie=tie)


def first_difference(reference: Completion, candidate: Completion,
                     tolerance: Optional[float] = LOGPROB_TOLERANCE) -> str:
    """Where `candidate` first departs from `reference` beyond the tolerance ("" when it does not)."""
    return compare(reference, candidate, tolerance).difference


def differences(reference: Sequence[Completion], candidate: Sequence[Completion],
                tolerance: Optional[float] = LOGPROB_TOLERANCE) -> list[str]:
    """The first departure of each request of `candidate` (empty: every request the same, near ties aside)."""
    if len(reference) != len(candidate):
        return [f"{len(candidate)} completions, expected {len(reference)}"]
    return [f"request {i}: {found}" for i, (ref, got) in enumerate(zip(reference, candidate))
            if (found := first_difference(ref, got, tolerance))]
