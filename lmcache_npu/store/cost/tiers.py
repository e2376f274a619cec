"""The tier side of the cost model: per path (tier and direction) a fixed latency and a bandwidth, and the bytes
in flight that a new transfer queues behind.

A batch of `bytes` submitted while `queued` bytes of the same path are in flight takes `L + (queued + bytes) / BW`
seconds: the fit is a `LinearFit` in (1, queued + bytes), so L and 1/BW are its coefficients, learned from the
workers' `TransferSample`s and seeded from the figures below until they arrive. The seeds err slow for the tiers
that can lose to computing (disk, Mooncake) and are the measured speed for the arena, whose loads always paid here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

from .fit import FitState, LinearFit
from .samples import Path, TransferSample

_SCALES = (1.0, float(64 << 20))  # a transfer, 64 MiB
_PRIOR_WEIGHT = 1.0  # the seed counts as one batch until measured ones outweigh it
_HALF_LIFE = 100.0  # batches


@dataclass(frozen=True)
class Speed:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


# Where nothing was measured yet. Arena <-> device by device family: `lmcache-npu bench` moved 15.5 GB/s (load) with
# the host backend on a CPU engine and 52-55 GB/s on an H200 (docs/performance.md); Ascend's figure is the CPU one
# until measured. Disk: an NVMe read with its envelope check, at a fifth of a drive's 3-7 GB/s (drives are shared by
# a node's devices). Mooncake: `store-bench` got 2.6-4.5 GB/s on loopback (docs/performance.md, issue 31); a NIC
# shared by a node gives a device 0.4-1.5 GB/s (research notes §B.3), so 0.5 GB/s and 5 ms.
SEEDS: dict[str, dict[Path, Speed]] = {
    "cpu": {Path.LOAD: Speed(0.5e-3, 15e9), Path.STORE: Speed(0.5e-3, 15e9)},
    "cuda": {Path.LOAD: Speed(0.2e-3, 50e9), Path.STORE: Speed(0.2e-3, 50e9)},
    "npu": {Path.LOAD: Speed(0.5e-3, 15e9), Path.STORE: Speed(0.5e-3, 15e9)},
}
SLOW_SEEDS: dict[Path, Speed] = {
    Path.DISK: Speed(2e-3, 1e9), Path.DISK_WRITE: Speed(2e-3, 1e9),
    Path.REMOTE: Speed(5e-3, 0.5e9), Path.REMOTE_WRITE: Speed(5e-3, 0.5e9),
}


def seeds_for(device: str) -> dict[Path, Speed]:
    """The seed of every path for a device such as "cpu", "cuda:0" or "npu:3"."""
    family = device.split(":", 1)[0]
    return {**SEEDS.get(family, SEEDS["cpu"]), **SLOW_SEEDS}


class TierModel:
    """One path's speed."""

    def __init__(self, path: Path, seed: Speed) -> None:
        self.path = path
        self.seed = seed
        self.fit = LinearFit(seed=(seed.latency_s, 1.0 / seed.bytes_per_s), scales=_SCALES,
                             prior_weight=_PRIOR_WEIGHT, half_life=_HALF_LIFE)
        self.measured = False  # a worker timed this path (waits seen by the scheduler then no longer teach it)
        self.batch_bytes = 0.0  # an EWMA of the batches observed: where the fit's prediction is best founded

    def seconds(self, nbytes: float, queued: float = 0.0) -> float:
        return self.fit.predict((1.0, queued + nbytes))

    def observe(self, nbytes: float, queued: float, seconds: float) -> float:
        """One batch; returns what was predicted for it."""
        self.batch_bytes = nbytes if self.batch_bytes == 0 else 0.9 * self.batch_bytes + 0.1 * nbytes
        return self.fit.observe((1.0, queued + nbytes), seconds)

    def seconds_per_byte(self, nbytes: float) -> float:
        """A byte's share of a typical batch's time (of `nbytes` until a batch was observed): robust to how the fit
        splits latency from bandwidth, which batches of one size leave to the seed."""
        batch = self.batch_bytes or nbytes
        return self.seconds(batch) / batch

    @property
    def speed(self) -> Speed:
        latency, per_byte = self.fit.coefficients
        return Speed(latency, 1.0 / per_byte if per_byte > 0 else float("inf"))

    def state(self) -> FitState:
        return self.fit.state()


class InFlight:
    """The bytes per path the scheduler issued and not every rank answered: what a new transfer queues behind."""

    def __init__(self) -> None:
        self._cmds: dict[int, tuple[Path, int]] = {}
        self._bytes: Counter[Path] = Counter()

    def issued(self, cmd_id: int, path: Path, nbytes: int) -> None:
        self._cmds[cmd_id] = (path, nbytes)
        self._bytes[path] += nbytes

    def settled(self, cmd_ids: Iterable[int]) -> None:
        for cmd_id in cmd_ids:
            entry = self._cmds.pop(cmd_id, None)
            if entry is not None:
                self._bytes[entry[0]] -= entry[1]

    def bytes(self, path: Path) -> int:
        return self._bytes[path]

    def __contains__(self, cmd_id: int) -> bool:
        return cmd_id in self._cmds


def observe_samples(models: dict[Path, TierModel],
                    samples: Iterable[TransferSample]) -> list[tuple[Path, float, float]]:
    """Each good sample teaches its path; returns (path, predicted, observed seconds) per sample taken."""
    seen = []
    for sample in samples:
        model: Optional[TierModel] = models.get(sample.path)
        if model is None or not sample.ok or sample.chunks <= 0:
            continue
        model.measured = True
        seen.append((sample.path, model.observe(sample.bytes, sample.queued_bytes, sample.seconds), sample.seconds))
    return seen
