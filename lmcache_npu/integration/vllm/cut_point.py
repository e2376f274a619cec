"""The scheduler half's time-aware claim (issue 40): the cost model learns from every step and every transfer, and
each lookup's hit is cut where loading stops paying (`store/cost/cut.py` has the arithmetic).

Per request: the first lookup decides the cut from the model, before anything is reserved or promoted where the
manager can say where a hit lies (`claim`): a promotion the cut declines would take the tier's bandwidth from the
claims that need it and evict arena chunks for bytes nobody loads. So that a declined tier is still measured (a disk
that got faster), every `PROBE_EVERY`-th decision that declines a promotion path promotes its chunks anyway, into the
arena for later requests, without the request waiting for them. A cut that needs promotions (disk or Mooncake chunks
moving into the arena) waits for them, "ask again" as before, until a deadline the model sets: the predicted
promotion time stretched by twice its observed relative error, plus the one step the scheduler needs to see an
answer. Past the deadline the request re-decides with only the chunks already in the arena and computes the rest;
the late promotions still land in the arena for later requests. A hit is only ever cut, never grown, so vLLM's own
device cache (`num_computed_tokens`) is never claimed again. Until the compute side has seen `MIN_STEPS` steps the
model cannot tell a slow load from a fast one: every hit is claimed and every promotion waited for, as before (and
as always under `load_policy: load-all`).

Declined and claimed tokens are counted once per admission by reason, with the predictions against what was then
observed (steps, transfers, promotion waits); the fit itself is reported as gauges (`lmcache-npu status`).
"""

from __future__ import annotations

import logging
import time

import numpy as np
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

from ...store.commands import Command, Tier
from ...store.cost import CostModel, Cut, HitShape, Path, StepShape, best_cut, claim_all
from ...store.cost.admission import PROBE_EVERY  # of the decisions that decline a tier, one probes it
from ...store.index.contract import LookupResult
from ...store.metrics import Metric
from ...store.tier import TierCounters
from . import adapter
from .metadata import LMCacheNPUWorkerMetadata

logger = logging.getLogger(__name__)

# a deadline is the predicted promotion time stretched by this many relative standard deviations of its path's
# errors (two: about one promotion in forty runs past it when the errors are normal), plus one step
DEADLINE_SIGMAS = 2.0
# steps' calibration and the fit's gauges are reported once per this many steps: a busy engine's stats stay quiet
# on most steps (what vLLM ships, merges and logs each step)
REPORT_EVERY = 64
# (predicted, observed) counters per calibrated fit
_CALIBRATION = {
    "step": (Metric.COST_PREDICTED_STEP_SECONDS, Metric.COST_OBSERVED_STEP_SECONDS),
    Path.LOAD: (Metric.COST_PREDICTED_LOAD_SECONDS, Metric.COST_OBSERVED_LOAD_SECONDS),
    Path.DISK: (Metric.COST_PREDICTED_DISK_SECONDS, Metric.COST_OBSERVED_DISK_SECONDS),
    Path.REMOTE: (Metric.COST_PREDICTED_REMOTE_SECONDS, Metric.COST_OBSERVED_REMOTE_SECONDS),
}
_CLAIMED = {"faster": Metric.COST_CLAIMED_TOKENS_FASTER, "unfitted": Metric.COST_CLAIMED_TOKENS_UNFITTED,
            "load-all": Metric.COST_CLAIMED_TOKENS_LOAD_ALL}


@dataclass
class _Decision:
    """A request's cut, kept from its first lookup to its admission."""

    first_chunk: int
    cut: Cut
    reason: str  # faster | unfitted | load-all
    hit_chunks: int  # what the lookup found when the cut was made
    since: float  # when it was made
    deadline: Optional[float] = None  # set while it waits for promotions
    declined_late: int = 0  # chunks given up at the deadline
    waited: Optional[float] = None  # seconds it waited for promotions, once they landed
    promoted: tuple[tuple[Path, int], ...] = ()  # chunks the claim waits for, per promotion path
    probing: bool = False  # its lookup promotes the declined chunks too (the paths' speeds are measured again)

    @property
    def looked_up(self) -> int:
        """Hit chunks its lookups ask for: the cut, or every chunk found while it probes."""
        return self.hit_chunks if self.probing else self.cut.chunks


class CutPoint:
    """`policy`: "cost-model" or "load-all" (`load_policy`); `budget`: vLLM's tokens per step."""

    def __init__(self, policy: str, budget: int, counters: TierCounters,
                 clock: Callable[[], float] = time.monotonic,
                 ahead: Callable[[str], float] = lambda request_id: 0.0) -> None:
        self.policy = policy
        self.model = CostModel(budget)
        self.counters = counters
        self.clock = clock
        self.ahead = ahead  # request id -> predicted seconds of compute vLLM schedules before it (the scheduler's)
        self._declines: Counter[Path] = Counter()  # decisions that declined each promotion path since its last probe
        self._decisions: dict[str, _Decision] = {}
        self._gauges: dict[str, float] = {}  # as last reported
        self._reports = 0  # gauges() calls
        self._steps = [0.0, 0.0, 0]  # predicted and observed seconds of steps not yet counted, and how many

    # ---- observations ---------------------------------------------------------------------------------------

    def on_step(self, scheduler_output: Any) -> Optional[int]:
        """A schedule: its step number, which the workers echo once it ran (None: it computes nothing)."""
        if not scheduler_output.total_num_scheduled_tokens:
            return self.model.on_schedule(StepShape(0, 0.0), self.clock())
        scheduled = scheduler_output.num_scheduled_tokens
        shape = StepShape.of((r.num_computed_tokens, scheduled.get(r.request_id, 0))
                             for r in adapter.scheduled_requests(scheduler_output))
        return self.model.on_schedule(shape, self.clock())

    def on_commands(self, commands: list[Command]) -> None:
        self.model.on_commands(commands)

    def on_output(self, meta: Any, is_pending: Callable[[int], bool]) -> None:
        """The workers' transfer samples teach the tiers; answered commands leave the in-flight bytes."""
        if not isinstance(meta, LMCacheNPUWorkerMetadata):
            return
        for predicted, observed in self.model.on_done(meta.steps, self.clock()):
            steps = self._steps
            steps[0], steps[1], steps[2] = steps[0] + predicted, steps[1] + observed, steps[2] + 1
            if steps[2] >= REPORT_EVERY:
                self._calibrate("step", steps[0], steps[1])
                self._steps = [0.0, 0.0, 0]
        for path, predicted, observed in self.model.on_samples(meta.timings):
            if path in _CALIBRATION:
                self._calibrate(path, predicted, observed)
        self.model.in_flight.settled([c.cmd_id for c in meta.completions
                                      if c.cmd_id in self.model.in_flight and not is_pending(c.cmd_id)])

    def idle(self) -> None:
        """No request is left unfinished: a load would wait for no one else's step."""
        self.model.compute.idle()

    def _calibrate(self, name: Any, predicted: float, observed: float) -> None:
        predicted_metric, observed_metric = _CALIBRATION[name]
        self.counters.add(predicted_metric, predicted)
        self.counters.add(observed_metric, observed)

    # ---- decisions ------------------------------------------------------------------------------------------

    def claim(self, request_id: str, hit: HitShape) -> int:
        """Of a hit located before the lookup (nothing reserved or promoted yet), how many chunks to look up: the
        cut, or the whole hit when a declined promotion path is due a probe (the claim stays the cut)."""
        now = self.clock()
        decision = self._decisions.get(request_id)
        if decision is None or decision.first_chunk != hit.first_chunk:
            decision = self._decisions[request_id] = self._first(hit, now, request_id)
            declined = {Path.promotion(s) for s in hit.sources[max(decision.cut.chunks, hit.ready):]} - {None}
            for path in declined:
                self._declines[path] += 1
            due = [path for path in declined if self._declines[path] >= PROBE_EVERY]
            if due:
                for path in due:
                    self._declines[path] = 0
                decision.probing = True
                self.counters.add(Metric.COST_PROBE_LOOKUPS)
                logger.debug("lmcache_npu cut: request %s promotes its declined chunks to measure %s again",
                             request_id, ", ".join(str(p) for p in due))
        return decision.looked_up

    def claimed(self, request_id: str, first_chunk: int) -> Optional[int]:
        """What `claim` answered for this request's hit from `first_chunk` (the cut, since a deadline passed the
        arena's part of it), or None when no decision stands: asking again needs no second `locate`."""
        decision = self._decisions.get(request_id)
        if decision is None or decision.first_chunk != first_chunk:
            return None
        return decision.looked_up

    def decide(self, request_id: str, hit: HitShape, result: LookupResult) -> LookupResult:
        """The lookup's answer cut where loading stops paying: a `LookupResult` of the claimed chunks (pending while
        their promotions are awaited)."""
        if result.hit_chunks == 0:  # a miss (or a cut that claims nothing: kept, and counted at admission)
            kept = self._decisions.get(request_id)
            if kept is None or kept.cut.chunks or kept.first_chunk != hit.first_chunk:
                self._decisions.pop(request_id, None)
            return result
        now = self.clock()
        decision = self._decisions.get(request_id)
        if decision is None or decision.first_chunk != hit.first_chunk:  # new, or vLLM's own cache moved it on
            decision = self._decisions[request_id] = self._first(hit, now, request_id)
        elif decision.deadline is not None and hit.ready < min(decision.cut.chunks, result.hit_chunks):
            if now > decision.deadline:
                self._late(request_id, decision, hit, now)
        chunks = min(decision.cut.chunks, result.hit_chunks)
        if decision.deadline is not None and hit.ready >= chunks and decision.waited is None:
            decision.waited = now - decision.since
        return LookupResult(chunks, min(result.ready_chunks, chunks), result.sources[:chunks])

    def _first(self, hit: HitShape, now: float, request_id: str) -> _Decision:
        if self.policy == "load-all" or not self.model.fitted:
            reason = "load-all" if self.policy == "load-all" else "unfitted"
            cut = claim_all(hit, self.model)
        else:
            hit = replace(hit, ahead_s=self.ahead(request_id))
            reason, cut = "faster", best_cut(hit, self.model)
        decision = _Decision(hit.first_chunk, cut, reason, len(hit.sources), now)
        if cut.chunks > hit.ready:  # promotions to wait for (as long as they take, where the model is not in charge)
            decision.deadline = now + self._allowance(hit, cut) if reason == "faster" else float("inf")
            waits = [Path.promotion(s) for s in hit.sources[hit.ready:cut.chunks]]
            decision.promoted = tuple((p, waits.count(p)) for p in (Path.DISK, Path.REMOTE) if p in waits)
        logger.debug("lmcache_npu cut: %d of %d hit chunks from chunk %d (%s; %d ready, tiers %s); predicted wait "
                     "%.4f s (promotions %.4f s) + compute %.4f s against %.4f s computing all, %.4f s of compute "
                     "ahead; step floor %.4f s", cut.chunks, len(hit.sources), hit.first_chunk, reason, hit.ready,
                     "".join(t.value[0] for t in hit.sources), cut.wait_s, cut.promotion_s, cut.compute_s,
                     cut.recompute_s, cut.ahead_s, self.model.step_floor_s())
        return decision

    def _allowance(self, hit: HitShape, cut: Cut) -> float:
        """How long past the decision its promotions, and the stores in flight of claimed arena chunks (another
        request of the same wave writing a shared prefix), may take before the request computes instead."""
        waiting = hit.sources[hit.ready:cut.chunks]
        paths = {Path.promotion(s) for s in waiting}
        spread = max((self.model.tiers[p].fit.relative_sd for p in paths if p is not None), default=1.0)
        step = max(self.model.step_floor_s(), self.model.compute.recent_step_s)
        allowance = cut.promotion_s * (1.0 + DEADLINE_SIGMAS * spread) + step
        writing = sum(s is Tier.ARENA for s in waiting)  # ready once their writer's step and store copy are done
        if writing:
            allowance += step + float(self.model.transfer_s(Path.STORE, np.array(writing * self.model.object_bytes)))
        return max(allowance, cut.ahead_s)  # while the work ahead runs, waiting longer costs the request nothing

    def _late(self, request_id: str, decision: _Decision, hit: HitShape, now: float) -> None:
        """Past the deadline: the best cut of what the arena holds now (the work ahead is done or nearly)."""
        cut = best_cut(hit, self.model, limit=hit.ready)
        logger.debug("lmcache_npu cut: request %s waited %.4f s for promotions (deadline %.4f s): %d of %d chunks "
                     "claimed, the rest computed", request_id, now - decision.since, decision.deadline - decision.since,
                     cut.chunks, decision.cut.chunks)
        decision.declined_late = decision.cut.chunks - cut.chunks
        decision.cut, decision.deadline = cut, None

    def admitted(self, request_id: str, claimed_tokens: int, chunk_tokens: int) -> None:
        """vLLM allocated the request (with `claimed_tokens` from the plugin): its decision is counted and dropped."""
        decision = self._decisions.pop(request_id, None)
        if decision is None:
            return
        cut = decision.cut
        self.counters.add(_CLAIMED[decision.reason], max(claimed_tokens, 0))
        late = decision.declined_late * chunk_tokens
        self.counters.add(Metric.COST_DECLINED_TOKENS_LATE, late)
        slower = (decision.hit_chunks - cut.chunks - decision.declined_late) * chunk_tokens
        self.counters.add(Metric.COST_DECLINED_TOKENS_SLOWER, max(slower, 0))
        if claimed_tokens > 0:  # a counter never goes back: a claim predicted slower (load-all, unfitted) is a loss
            saved = cut.saved_s
            self.counters.add(Metric.COST_PREDICTED_SAVED_SECONDS if saved >= 0 else Metric.COST_PREDICTED_LOST_SECONDS,
                              abs(saved))
        if decision.waited is not None:
            self.counters.add(Metric.COST_PREDICTED_WAIT_SECONDS, cut.promotion_s)
            self.counters.add(Metric.COST_OBSERVED_WAIT_SECONDS, decision.waited)
            for path, chunks in decision.promoted:  # teaches the paths no worker times (a node cache's)
                self.model.on_promotion_wait(path, chunks, decision.waited)

    def forget(self, request_id: str) -> None:
        self._decisions.pop(request_id, None)

    # ---- reporting ------------------------------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        """The fit's gauges whose value moved (to three significant digits) since the last report; looked at on the
        first call and every REPORT_EVERY-th."""
        self._reports += 1
        if (self._reports - 1) % REPORT_EVERY:
            return {}
        a, b, c = self.model.compute.fit.coefficients
        now = {"cost_step_base_seconds": a, "cost_step_token_seconds": b, "cost_step_attention_seconds": c,
               "cost_step_observations": self.model.compute.fit.observations}
        for path in (Path.LOAD, Path.DISK, Path.REMOTE):
            speed = self.model.tiers[path].speed
            now[f"cost_{path}_latency_seconds"] = speed.latency_s
            now[f"cost_{path}_bytes_per_second"] = speed.bytes_per_s if speed.bytes_per_s != float("inf") else 0.0
        changed = {name: value for name, value in ((n, float(f"{v:.3g}")) for n, v in now.items())
                   if self._gauges.get(name) != value}
        self._gauges.update(changed)
        return changed


def hit_shape(computed: int, tokens: int, first_chunk: int, chunk_tokens: int, result: LookupResult,
              ends: Optional[tuple[bool, ...]] = None) -> HitShape:
    """The cut's view of a lookup; `ends` says after which hit chunks a claim may end (None: any)."""
    return HitShape(computed, tokens, first_chunk, chunk_tokens, tuple(result.sources[:result.hit_chunks]),
                    result.ready_chunks, ends)




def prefills_ahead(request_id: str, unfinished: Mapping[str, tuple[Any, int]]) -> list[tuple[int, int]]:
    """The prompt spans [start, end) vLLM computes before `request_id`'s: the running requests' (they get the step's
    token budget first) and the waiting ones' that arrived before it (first come, first served). `unfinished`:
    request id -> (vLLM's Request, the tokens its admission's claim reaches, which a load brings, not compute)."""
    mine = unfinished.get(request_id)
    arrival = getattr(mine[0], "arrival_time", None) if mine is not None else None
    spans = []
    for other_id, (other, claimed_to) in unfinished.items():
        if other_id == request_id:
            continue
        if arrival is not None and getattr(other, "arrival_time", arrival) > arrival and not adapter.running(other):
            continue
        spans.append((max(other.num_computed_tokens, claimed_to), other.num_prompt_tokens))
    return spans
