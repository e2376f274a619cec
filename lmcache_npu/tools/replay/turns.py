"""Token identity between two runs of one workload: per turn, how many conversations got the same tokens (a near
tie of the model's precision excused and counted apart), and where the first departure was."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from .compare import compare, tolerance_for
from .runner import TurnRun

RUNS = ("without", "with")  # the two runs `compare_turns` sets side by side: the reference, then the candidate


@dataclass(frozen=True)
class TurnReport:
    """One turn of every conversation that has it, both runs."""

    turn: int
    requests: int
    prompt_tokens: int
    loaded_tokens: int  # prompt tokens the candidate did not compute (vLLM's prefix cache and a connector together)
    computed_tokens: int
    prefill_s: dict[str, float]  # run -> the turn's prefill: from its submission until every request had a token
    ttft_s: dict[str, float]  # run -> median over the requests (arrival to first token, queueing included)
    wall_s: dict[str, float]  # run -> the whole turn, every request's prefill and decode
    identical: int  # conversations whose tokens were the same in both runs (logprobs within the tolerance)
    first_difference: str = ""  # the first departure beyond the tolerance, when some departed
    near_ties: int = 0  # conversations that took the other token of a near tie in the model's precision
    first_near_tie: str = ""

    @property
    def matching(self) -> int:
        """Conversations without a difference beyond the tolerance (near ties count as matching)."""
        return self.identical + self.near_ties

    @property
    def hit_rate(self) -> float:
        return self.loaded_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def compare_turns(without: Sequence[TurnRun], with_plugin: Sequence[TurnRun],
                  tolerance: float = tolerance_for("float32")) -> list[TurnReport]:
    """Turn reports from the two runs of one workload; `tolerance`: the model dtype's (`compare.tolerance_for`)."""
    if [r.conversations for r in without] != [r.conversations for r in with_plugin]:
        raise ValueError("the two runs did not run the same turns")
    reports = []
    for base, run in zip(without, with_plugin):
        # tokens, as a user sees them (a near tie excused); the engine tests also hold logprobs and rows to account
        verdicts = [(conv, compare(a, b, tolerance, logprobs=False))
                    for conv, a, b in zip(run.conversations, base.completions, run.completions)]
        differences = [f"conversation {conv}: {v.difference}" for conv, v in verdicts if v.difference]
        ties = [f"conversation {conv} {v.near_tie}" for conv, v in verdicts if v.near_tie and not v.difference]
        prompt = sum(c.prompt_tokens for c in run.completions)
        loaded = sum(c.cached_tokens for c in run.completions)
        reports.append(TurnReport(
            turn=run.turn + 1, requests=len(run.completions), prompt_tokens=prompt, loaded_tokens=loaded,
            computed_tokens=prompt - loaded,
            prefill_s={name: max(c.ttft_s for c in r.completions) for name, r in zip(RUNS, (base, run))},
            ttft_s={name: statistics.median(c.ttft_s for c in r.completions) for name, r in zip(RUNS, (base, run))},
            wall_s={"without": base.wall_s, "with": run.wall_s},
            identical=len(run.completions) - len(differences) - len(ties),
            first_difference=differences[0] if differences else "", near_ties=len(ties),
            first_near_tie=ties[0] if ties else ""))
    return reports


