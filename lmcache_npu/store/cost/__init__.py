"""The cost model the scheduler decides with (issue 40): how long computing tokens takes, how long each tier takes to
bring chunks back, and from those the cut point of each request's hit. Scheduler side of the store: no vLLM, no
worker-side module; the workers contribute only `TransferTimer` samples."""

from __future__ import annotations

from .admission import SlowTierAdmission
from .compute import MIN_STEPS, ComputeModel, StepShape, attention
from .cut import Cut, HitShape, best_cut, claim_all, ttft_by_cut
from .fit import FitState, LinearFit
from .model import CALIBRATED, CostModel
from .samples import Path, TransferSample
from .tiers import SEEDS, SLOW_SEEDS, InFlight, Speed, TierModel, seeds_for
from .timer import TransferTimer

__all__ = ["CALIBRATED", "MIN_STEPS", "SEEDS", "SLOW_SEEDS", "ComputeModel", "CostModel", "Cut", "FitState",
           "HitShape", "InFlight", "LinearFit", "Path", "SlowTierAdmission", "Speed", "StepShape", "TierModel", "TransferSample",
           "TransferTimer", "attention", "best_cut", "claim_all", "seeds_for", "ttft_by_cut"]
