"""Scheduler steps from admission to first token for the plugin's hits (issue 41: a sliced hit computes in the step
that admits it, an asynchronous one sits out at least one step while its load runs).

Admission: the step in which vLLM allocated a request's blocks with external tokens (`update_state_after_alloc` with
`num_external_tokens > 0`). First token: the step whose scheduled tokens complete the request's prompt (that step
samples it). Steps are counted by `build_connector_meta`, which vLLM calls once per `schedule()`, after the step's
allocations; the count is inclusive, so a hit computed in the step that admitted it takes 1. Only our own connector's
methods are wrapped, on the instance, and each wrapper calls the original with the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .spread import percentile


@dataclass(frozen=True)
class StepCounts:
    """Steps from admission to first token of every hit request that got its first token (one entry each)."""

    steps: tuple[int, ...] = ()
    sliced: int = 0  # of those, the hits the scheduler chose to load sliced (its lookup's choice)

    @property
    def hits(self) -> int:
        return len(self.steps)

    def histogram(self) -> dict[int, int]:
        """Steps -> how many hit requests took that many."""
        out: dict[int, int] = {}
        for s in sorted(self.steps):
            out[s] = out.get(s, 0) + 1
        return out

    def median(self) -> float:
        return percentile(self.steps, 50) if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"hits": self.hits, "sliced": self.sliced, "min": min(self.steps, default=0), "median": self.median(),
                "p90": percentile(self.steps, 90) if self.steps else 0.0, "max": max(self.steps, default=0),
                "mean": sum(self.steps) / self.hits if self.steps else 0.0,
                "histogram": {str(k): v for k, v in self.histogram().items()}}

    @classmethod
    def merged(cls, counts: "list[StepCounts]") -> "StepCounts":
        return cls(tuple(s for c in counts for s in c.steps), sum(c.sliced for c in counts))


@dataclass
class _Admitted:
    step: int  # the step that admitted it (1-based)
    prompt_tokens: int
    sliced: bool = False  # the scheduler chose a sliced load for it


@dataclass
class StepCounter:
    """Counts steps on one scheduler connector; `take()` hands over what finished and forgets it."""

    step: int = 0  # steps scheduled so far
    _admitted: dict[str, _Admitted] = field(default_factory=dict)
    _done: list[tuple[int, bool]] = field(default_factory=list)

    def attach(self, connector: Any) -> None:
        """Wraps `connector`'s (an `LMCacheNPUConnector`'s) `update_state_after_alloc` and `build_connector_meta` on
        the instance; each wrapper records, then calls whatever was there (another recorder's wrapper, or ours)."""
        allocated: Callable[[Any, Any, int], None] = connector.update_state_after_alloc
        build: Callable[[Any], Any] = connector.build_connector_meta

        half = connector.scheduler_half

        def recorded_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            lookup = getattr(half.requests.get(request.request_id), "lookup", None)  # the mode chosen at lookup
            self.admitted(request.request_id, int(request.num_prompt_tokens), num_external_tokens,
                          bool(getattr(lookup, "sliced", False)))
            allocated(request, blocks, num_external_tokens)

        def recorded_build(scheduler_output: Any) -> Any:
            self.scheduled(scheduler_output)
            return build(scheduler_output)

        connector.update_state_after_alloc = recorded_alloc
        connector.build_connector_meta = recorded_build

    def admitted(self, request_id: str, prompt_tokens: int, num_external_tokens: int, sliced: bool = False) -> None:
        """An allocation in the step being scheduled; only a request's first with external tokens is its admission
        (an async hit is allocated again, without them, when it is scheduled after its load)."""
        if num_external_tokens > 0 and request_id not in self._admitted:
            self._admitted[request_id] = _Admitted(self.step + 1, prompt_tokens, sliced)

    def scheduled(self, scheduler_output: Any) -> None:
        """One step: every admitted request whose scheduled tokens reach the end of its prompt samples now."""
        self.step += 1
        for req_id, computed in _computed_before(scheduler_output).items():
            hit = self._admitted.get(req_id)
            scheduled = int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if hit is not None and computed + scheduled >= hit.prompt_tokens:
                self._done.append((self.step - hit.step + 1, hit.sliced))
                del self._admitted[req_id]

    def take(self) -> StepCounts:
        """The counts since the last take (requests still waiting stay counted for the next one)."""
        done, self._done = self._done, []
        return StepCounts(tuple(steps for steps, _ in done), sum(sliced for _, sliced in done))

    def restart(self) -> None:
        """Forgets everything admitted or counted so far (a warm-up's hits are not the workload's)."""
        self._admitted.clear()
        self._done.clear()

    @property
    def waiting(self) -> int:
        """Hit requests admitted whose first token has not been scheduled yet."""
        return len(self._admitted)


def _computed_before(scheduler_output: Any) -> dict[str, int]:
    """Request id -> tokens computed before this step, for every request the step schedules (both eras' fields)."""
    out = {new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs}
    cached: Optional[Any] = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        out.update({req_id: int(n) for req_id, n in zip(cached.req_ids, cached.num_computed_tokens)})
    return out


__all__ = ["StepCounter", "StepCounts"]
