"""Admission to the slow tiers from the cost model (issue 40 item 4): a chunk is written to disk or put to Mooncake
only when the hits it can expect save more compute than the tier spends writing it.

    saving per hit = computing the chunk's tokens at its position - (reading it from the tier + loading it)
    admitted when (1 + reuses) x saving per hit > writing it to the tier

`reuses` are the later requests that asked for the chunk (the reuse gate's count): a chunk asked again is likely
asked again. Compute is marginal (per token and per context token: a step's fixed cost is shared by its requests);
a transfer is the chunk's share of a typical batch of its path. Until the compute side is fitted, and while a tier's
read path is only seeded, every chunk is admitted: a tier nobody read from cannot be judged, and declining it from a
seed would keep it unmeasured. For the same reason one declined write in `PROBE_EVERY` per tier is admitted anyway:
a tier that turned slow keeps a few chunks for the cut's probes to read (a disk that became faster is seen again).
The arena is never gated: its first-turn stores are what make the next turn hit.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from ..commands import Tier
from .compute import attention
from .model import CostModel
from .samples import Path

_WRITE_PATH = {Tier.DISK: Path.DISK_WRITE, Tier.REMOTE: Path.REMOTE_WRITE}
# of the writes (and the cut's lookups) a tier's speed declines, one in this many goes ahead, so the tier is still
# measured: at most that share of its declined bytes is spent on knowing its speed
PROBE_EVERY = 32


class SlowTierAdmission:
    """`pays(tier, chunk_index, reuses)` for the index; `chunk_index` None (a chunk promoted from another tier, whose
    position no store told) is judged at position 0, where computing it is cheapest."""

    def __init__(self, model: CostModel, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"slow-tier admission needs chunk_tokens >= 1, got {chunk_tokens}")
        self.model = model
        self.chunk_tokens = chunk_tokens
        self._declines: Counter[Tier] = Counter()  # declined writes per tier since its last probe

    def saving_s(self, tier: Tier, chunk_index: Optional[int]) -> float:
        """Seconds one hit on the chunk in `tier` saves against computing it (negative: reading is slower)."""
        _, per_token, per_context = self.model.compute.fit.coefficients
        start = (chunk_index or 0) * self.chunk_tokens
        compute = per_token * self.chunk_tokens + per_context * attention(start, self.chunk_tokens)
        return compute - self.model.object_bytes * (self._per_byte(Path.promotion(tier)) + self._per_byte(Path.LOAD))

    def write_s(self, tier: Tier) -> float:
        return self.model.object_bytes * self._per_byte(_WRITE_PATH[tier])

    def pays(self, tier: Tier, chunk_index: Optional[int], reuses: int) -> bool:
        read = Path.promotion(tier)
        if read is None or not self.model.fitted or not self.model.tiers[read].measured:
            return True
        if (1 + max(reuses, 0)) * self.saving_s(tier, chunk_index) > self.write_s(tier):
            return True
        self._declines[tier] += 1
        if self._declines[tier] >= PROBE_EVERY:  # a probe: the tier keeps chunks whose reads measure it again
            self._declines[tier] = 0
            return True
        return False

    def _per_byte(self, path: Optional[Path]) -> float:
        assert path is not None
        return self.model.tiers[path].seconds_per_byte(self.model.object_bytes)
