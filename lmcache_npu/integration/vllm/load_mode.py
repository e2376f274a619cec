"""How a claimed hit loads (issue 41 item 5): asynchronously, or sliced into the forward.

`async` (the plugin before issue 41): the request waits in WAITING_FOR_REMOTE_KVS until its load is reported
(`finished_recving`) and computes a step later; the load hides behind nothing but the steps vLLM runs meanwhile.
`sliced`: the request is scheduled at once (`load_kv_async=False`); its load is cut into `load_slices` slices in the
order the forward consumes them (`transfer/slices.py`) and each layer waits only for its slice, on the device. Per
request the scheduler predicts, from the cost model the cut point learns (`store/cost`), the first token both ways:

    async:  max(load, step) + compute            (the step it sits out while others run; 0 on an idle engine)
    sliced: S equal slices, slice k landing at (k + 1) load / S; window k of the forward computes once its slice
            landed and the window before it is done, `COPY_SLOWDOWN` slower while the load's bytes still move
            (without it: max(load + compute / S, load / S + compute))

and what a sliced load costs the requests batched with it: their forward is longer by `sliced - compute` (the load
not hidden by the request's own compute; a lower bound, their compute hides more). Sliced is chosen when it saves the
request more than that stall times the requests sharing its step, more than `SLICED_MARGIN` of its async time, and
more than the slices' own cost (`SLICE_COST_S` each: planning, a launch, an event, the hooks' waits): where slicing
cannot pay (tiny prefixes, decode-heavy steps) it stays async.

A sliced load that fails can only be told to vLLM as invalid blocks, which vLLM maps through one KV-cache group (its
`_handle_invalid_blocks` refuses several, both eras), so `auto` slices only single-group models (Llama, Qwen, MLA).
`load_mode: sliced` forces it on hybrid models too, and a sliced load that fails there stops the engine rather than
serve KV that may be wrong (the worker's LoadFailedError). Until the compute side is fitted the model cannot tell,
and `auto` loads asynchronously, as under `load_policy: load-all`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ...store.cost import CostModel, Path
from ...store.metrics import Metric
from ...store.tier import TierCounters

logger = logging.getLogger(__name__)

# a request computing fewer tokens loads asynchronously: its step may be a uniform decode batch, which replays a FULL
# CUDA graph that calls no hook (vLLM's default FULL_AND_PIECEWISE) or that vllm-ascend's MLA treats as a decode
SLICED_MIN_NEW_TOKENS = 8
# forwards that read a sliced load before it landed (the guard's count) after which the engine stops slicing: this
# runtime does not call wait_for_layer_load where the layer map says it does
UNWAITED_LIMIT = 2
# a sliced load must save at least this share of the request's async time to the first token
SLICED_MARGIN = 0.01
# and more than this per slice: what a slice adds whatever it moves (building its batch, a launch, an event recorded
# and waited for); an upper figure of the H200 study's per-slice lane time once launches no longer wait for each other
SLICE_COST_S = 0.5e-3
# a forward beside a host-to-device copy runs this much slower while the copy's bytes move, whatever the copy stream's
# priority: 17-22 % on the H200 (docs/performance.md, layer_pipeline round 5), its upper figure; Ascend not measured
COPY_SLOWDOWN = 0.2


class LoadMode(str, Enum):
    ASYNC = "async"
    SLICED = "sliced"


@dataclass(frozen=True)
class ModeCosts:
    """Predicted seconds to a request's first token each way, and what slicing stalls each request sharing its step."""

    async_s: float
    sliced_s: float
    stall_s: float
    sharers: float
    slice_count: int

    @property
    def gain_s(self) -> float:
        """What slicing saves against loading asynchronously, the stall it puts on the others paid (< 0: it costs)."""
        return self.async_s - self.sliced_s - self.sharers * self.stall_s

    @property
    def slices(self) -> bool:
        return self.gain_s > max(SLICED_MARGIN * self.async_s, SLICE_COST_S * self.slice_count)


def sliced_seconds(load_s: float, compute_s: float, slices: int, slowdown: float = COPY_SLOWDOWN) -> float:
    """The sliced timeline of the module docstring: the end of the last window."""
    end, window = 0.0, compute_s / slices
    for k in range(slices):
        begin = max(end, (k + 1) * load_s / slices)
        beside = min(window * (1.0 + slowdown), max(load_s - begin, 0.0))  # the window's time beside the copy
        end = begin + beside + window - beside / (1.0 + slowdown)  # what is left computes at full speed
    return end


def mode_costs(load_s: float, compute_s: float, step_s: float, sharers: float, slices: int) -> ModeCosts:
    """The module docstring's two predictions for a load of `load_s` and a compute of the rest of `compute_s`, over
    `slices` equal windows (`slices.window_ends`); the stall counts the copy's slowdown of the batch too."""
    sliced = sliced_seconds(load_s, compute_s, slices)
    return ModeCosts(async_s=max(load_s, step_s) + compute_s, sliced_s=sliced, stall_s=max(sliced - compute_s, 0.0),
                     sharers=sharers, slice_count=slices)


class LoadModes:
    """The scheduler half's choice per admitted hit (`choose`), from `load_mode`, the model and what the workers can."""

    def __init__(self, setting: str, slices: int, policy: str, scheduler_groups: int) -> None:
        self.setting = setting
        self.slices = slices
        self.learned = policy == "cost-model"  # load-all claims as before issue 40 and 41: asynchronously
        self.single_group = scheduler_groups == 1  # a failed sliced load can be told to vLLM (the docstring)
        self.workers_slice = False  # every rank's mover can launch a load slice by slice (set from the plans)
        self.unwaited = 0.0  # forwards whose sliced loads the workers' guard failed: at UNWAITED_LIMIT slicing stops
        if setting == "sliced" and not self.single_group:
            logger.warning("lmcache_npu: load_mode sliced on a model of %d KV-cache groups: vLLM takes failed "
                           "synchronous loads as block ids of one group only, so a sliced load that fails stops the "
                           "engine (load_mode auto would load these hits asynchronously)", scheduler_groups)

    def set_workers(self, can_slice: bool, why_not: str = "") -> None:
        self.workers_slice = can_slice
        if not can_slice and self.setting != "async":
            logger.info("lmcache_npu: hits load asynchronously: %s", why_not or "the workers cannot slice a load")

    def on_unwaited(self, forwards: float) -> None:
        """The workers' guard failed the sliced loads of `forwards` forwards (their tokens were recomputed)."""
        if not forwards:
            return
        self.unwaited += forwards
        if self.unwaited >= UNWAITED_LIMIT and self.workers_slice:
            self.workers_slice = False
            logger.warning("lmcache_npu: %g forwards read sliced loads before they landed (a layer ran without "
                           "calling wait_for_layer_load: a FULL CUDA graph, or an attention path without the hook); "
                           "vLLM recomputed them, and hits load asynchronously from now on", self.unwaited)

    def choose(self, model: CostModel, chunks: int, start: int, tokens: int) -> LoadMode:
        """How `chunks` claimed arena chunks load for a request whose rest `[start, tokens)` vLLM computes."""
        if (self.setting == "async" or not self.workers_slice or chunks <= 0
                or tokens - start < SLICED_MIN_NEW_TOKENS):
            return LoadMode.ASYNC
        if self.setting == "sliced":
            return LoadMode.SLICED
        if not (self.learned and self.single_group and model.fitted):
            return LoadMode.ASYNC
        return LoadMode.SLICED if self.costs(model, chunks, start, tokens).slices else LoadMode.ASYNC

    @staticmethod
    def admitted(counters: TierCounters, sliced: bool, tokens: int) -> None:
        """A hit admitted with `tokens` claimed: counted by mode where it is sliced."""
        if sliced:
            counters.add(Metric.SLICED_LOADS)
            counters.add(Metric.SLICED_LOAD_TOKENS, tokens)

    def costs(self, model: CostModel, chunks: int, start: int, tokens: int) -> ModeCosts:
        load = float(model.transfer_s(Path.LOAD, np.array([chunks * model.object_bytes], dtype=np.float64))[0])
        compute = float(model.prefill_s(np.array([start]), tokens)[0])
        return mode_costs(load, compute, model.step_floor_s(), model.sharers(), self.slices)
