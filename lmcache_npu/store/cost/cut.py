"""The cut point: of a request's hit `[computed, end of chunk h)`, which prefix `[0, k)` to load so that its first
token comes soonest, the rest `[k, n)` computed by vLLM.

For a cut after j hit chunks the request's first token is predicted at
    T(0) = A + prefill(computed, n)                                (vLLM computes everything, as without the plugin)
    T(j) = max(A, promotions(j) + max(load(j), step)) + prefill(start_j, n)
where A is the compute queued ahead of the request (the unfinished prefills vLLM schedules before it: first come,
first served), promotions(j) is the slowest tier's time to bring the claimed chunks it holds into the arena (tiers
run side by side; each queues behind the bytes already in flight on it), load(j) moves the j chunks to the device,
and `step` is the step the request sits out: a load is asynchronous, so the request computes one step later than it
would have (at least the engine's step period when other requests run). A load hides behind the work ahead: the
engine computes the others meanwhile, and the request keeps its place in the queue. The cut is the j of least
    T(j) + s x prefill(start_j, n)
where s is the number of requests batched with this one: every token it computes lengthens their steps too (their
first tokens and their decodes), while its sitting out a step for a load delays only itself. On an idle engine
s = 0 and the cut is the j of least T(j). A tie goes to the longer claim (less compute for the step everyone shares). Computing gets dearer along the prefix (attention)
while loading does not, so a slow tier can still pay for long prompts and lose for short ones, and a cut inside the
hit arises where a slow tier's chunks follow arena chunks.

Only `costs` knows the model; this module is the arithmetic, vectorised over j (a 128K-token prompt has 1,000
candidate cuts per lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from ..commands import Tier
from .samples import Path


class Costs(Protocol):
    """What the cut asks of the model (vectorised: one call per lookup)."""

    object_bytes: int  # one chunk object of one rank (ranks move theirs side by side)

    def prefill_s(self, start: np.ndarray, end: int) -> np.ndarray:
        """Seconds to compute tokens [start, end) of a request, per start."""
        ...

    def transfer_s(self, path: Path, nbytes: np.ndarray) -> np.ndarray:
        """Seconds for a batch of `nbytes` on `path`, queued behind what is in flight there."""
        ...

    def step_floor_s(self) -> float:
        """The least a load delays its request: one step of the engine."""
        ...

    def sharers(self) -> float:
        """Requests batched with this one, whose steps its compute lengthens (0 on an idle engine)."""
        ...


@dataclass(frozen=True)
class HitShape:
    """What a lookup found, as the cut needs it."""

    computed: int  # tokens vLLM's own cache holds: never claimed again
    tokens: int  # the request's tokens
    first_chunk: int  # the chunk holding token `computed`
    chunk_tokens: int
    sources: tuple[Tier, ...]  # per hit chunk from `first_chunk`, the tier it was found in
    ready: int  # hit chunks loadable from the arena now (a prefix of them)
    # per hit chunk, whether a claim may end after it (None: after any); a chunk stored without its recurrent end
    # state may sit inside a claim, never end one (lookup.py)
    ends: Optional[tuple[bool, ...]] = None
    ahead_s: float = 0.0  # predicted compute vLLM schedules before this request (a load hides behind it)

    def start(self, chunks: int) -> int:
        """The first token vLLM computes when `chunks` hit chunks are claimed."""
        return self.computed if chunks == 0 else (self.first_chunk + chunks) * self.chunk_tokens


@dataclass(frozen=True)
class Cut:
    """A decision and the predictions it was made on."""

    chunks: int  # hit chunks claimed, from the first
    wait_s: float  # before the request computes: promotions, the load, the step it sits out (0: nothing claimed)
    compute_s: float  # computing the rest
    recompute_s: float  # computing everything from `computed` (the request without the plugin)
    promotion_s: float  # the promotions' part of the wait (0: every claimed chunk was in the arena)
    ahead_s: float = 0.0  # the compute queued ahead of the request, which a wait overlaps

    @property
    def ttft_s(self) -> float:
        return max(self.ahead_s, self.wait_s) + self.compute_s

    @property
    def saved_s(self) -> float:
        """Predicted seconds to the first token the claim saves against computing everything (< 0: it costs)."""
        return self.ahead_s + self.recompute_s - self.ttft_s


def ttft_by_cut(hit: HitShape, costs: Costs, limit: Optional[int] = None) -> tuple[np.ndarray, np.ndarray,
                                                                                    np.ndarray, np.ndarray]:
    """(T, wait, compute, promotion) for every cut j in [0, limit] (limit: at most the hit)."""
    count = len(hit.sources) if limit is None else min(limit, len(hit.sources))
    j = np.arange(count + 1)
    starts = np.where(j == 0, hit.computed, (hit.first_chunk + j) * hit.chunk_tokens)
    compute = costs.prefill_s(starts, hit.tokens)
    chunk_bytes = float(costs.object_bytes)
    promotion = np.zeros(count + 1)
    waiting = hit.sources[hit.ready:count]  # chunks that are not in the arena yet
    for tier in (Tier.DISK, Tier.REMOTE):
        if tier not in waiting:
            continue
        moving = np.zeros(count + 1)  # chunks of this tier among the first j still to be promoted
        moving[hit.ready + 1:] = np.cumsum([s is tier for s in waiting])
        path = Path.promotion(tier)
        assert path is not None
        promotion = np.maximum(promotion, np.where(moving > 0, costs.transfer_s(path, moving * chunk_bytes), 0.0))
    load = costs.transfer_s(Path.LOAD, j * chunk_bytes)
    wait = np.where(j == 0, 0.0, promotion + np.maximum(load, costs.step_floor_s()))
    return np.maximum(hit.ahead_s, wait) + compute, wait, compute, promotion


def best_cut(hit: HitShape, costs: Costs, limit: Optional[int] = None) -> Cut:
    """The cut of least predicted time to the first token (the longest of equals) among those a claim may end at."""
    total, wait, compute, promotion = ttft_by_cut(hit, costs, limit)
    total = total + costs.sharers() * compute  # what computing costs the requests batched with this one
    if hit.ends is not None:
        total = np.where(np.concatenate(([True], hit.ends[:len(total) - 1])), total, np.inf)
    chunks = int(len(total) - 1 - np.argmin(total[::-1]))
    return Cut(chunks, float(wait[chunks]), float(compute[chunks]), float(compute[0]), float(promotion[chunks]),
               hit.ahead_s)


def claim_all(hit: HitShape, costs: Costs) -> Cut:
    """Every hit chunk, as the plugin did before the model (and does with `load_policy: load-all`), with its
    predictions."""
    total, wait, compute, promotion = ttft_by_cut(hit, costs)
    last = len(total) - 1
    return Cut(last, float(wait[last]), float(compute[last]), float(compute[0]), float(promotion[last]),
               hit.ahead_s)

