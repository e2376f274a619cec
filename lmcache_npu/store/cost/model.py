"""The cost model: the compute side (`compute.py`), a speed per tier and direction (`tiers.py`) and what is in
flight, behind the one interface the cut point asks (`cut.Costs`).

It lives with the index on the scheduler's side and learns from what the scheduler half already sees: each step's
schedule (the compute side) and the workers' transfer samples, which ride in their per-step metadata (the tiers).
Where the workers time nothing (a node cache runs promotions in its service), the promotion waits the scheduler
sees teach the promotion paths instead.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from ..commands import Command, Load, Promote
from .compute import ComputeModel, StepShape
from .fit import FitState
from .samples import Path, TransferSample
from .tiers import InFlight, TierModel, observe_samples, seeds_for

# the prediction paths the stats report calibration for: the compute side's steps and the read paths of the tiers
CALIBRATED = ("step", Path.LOAD.value, Path.DISK.value, Path.REMOTE.value)


class CostModel:
    """`budget`: vLLM's tokens per step; `object_bytes`: one rank's chunk object; `device`: where the KV cache is
    ("cpu", "cuda:0", "npu:1"), which picks the arena's seed."""

    def __init__(self, budget: int, object_bytes: int = 0, device: str = "cpu") -> None:
        self.compute = ComputeModel(budget)
        self.object_bytes = int(object_bytes)
        self.device = device
        self.tiers = {path: TierModel(path, speed) for path, speed in seeds_for(device).items()}
        self.in_flight = InFlight()

    def set_geometry(self, object_bytes: int, device: str) -> None:
        """The workers' handshake: the chunk's bytes and the device family (seeds of paths not yet measured)."""
        self.object_bytes = int(object_bytes)
        if device != self.device:
            self.device = device
            for path, speed in seeds_for(device).items():
                if not self.tiers[path].measured:
                    self.tiers[path] = TierModel(path, speed)

    # ---- what is observed ---------------------------------------------------------------------------------------

    def on_schedule(self, shape: StepShape, now: float) -> Optional[int]:
        return self.compute.on_schedule(shape, now)

    def on_done(self, steps: Iterable[int], now: float) -> list[tuple[float, float]]:
        return self.compute.on_done(steps, now)

    def on_samples(self, samples: Iterable[TransferSample]) -> list[tuple[Path, float, float]]:
        return observe_samples(self.tiers, samples)

    def on_promotion_wait(self, path: Path, chunks: int, seconds: float) -> None:
        """A wait the scheduler saw for `chunks` promoted on `path`; teaches the path only where no worker times it."""
        model = self.tiers[path]
        if not model.measured and chunks > 0:
            model.observe(chunks * self.object_bytes, 0.0, seconds)

    def on_commands(self, commands: Iterable[Command]) -> None:
        """Commands handed to the workers: their bytes are in flight until every rank answered."""
        for command in commands:
            path = Path.LOAD if isinstance(command, Load) else (
                Path.promotion(command.source) if isinstance(command, Promote) else None)
            if path is not None:
                self.in_flight.issued(command.cmd_id, path, self.object_bytes)

    # ---- cut.Costs ------------------------------------------------------------------------------------------------

    def prefill_s(self, start: np.ndarray, end: int) -> np.ndarray:
        return self.compute.prefill_s(start, end)

    def transfer_s(self, path: Path, nbytes: np.ndarray) -> np.ndarray:
        latency, per_byte = self.tiers[path].fit.coefficients
        return latency + (nbytes + self.in_flight.bytes(path)) * per_byte

    def step_floor_s(self) -> float:
        return self.compute.step_floor_s()

    def backlog_s(self, spans: Iterable[tuple[int, int]]) -> float:
        """Seconds to compute the requests' spans [start, end) (the work queued ahead of a request)."""
        return self.compute.backlog_s(spans)

    def sharers(self) -> float:
        return self.compute.sharers()

    @property
    def fitted(self) -> bool:
        return self.compute.fitted

    def states(self) -> dict[str, FitState]:
        """Every fit, by name ("step" and the paths), for gauges and logs."""
        return {"step": self.compute.state(), **{str(path): tier.state() for path, tier in self.tiers.items()}}
