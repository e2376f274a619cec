"""The store's state as the scheduler half reports it with its counters: the tiers' use and capacity and the store's
identity, only where they changed since the last report (an idle engine reports nothing)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ...config import ConnectorConfig
from ...store.commands import Tier
from .stats import STORE_INFO


class StoreGauges:
    """What was last reported of the store's state; `changed` hands out only the differences."""

    def __init__(self) -> None:
        self._reported: dict[str, Any] = {}  # the tier gauges and store info as last reported
        self._reported_use: Optional[Mapping[str, tuple[int, int]]] = None  # the occupancy as last reported

    def reset(self) -> None:
        """A new index: report its state afresh."""
        self._reported_use = None

    def changed(self, use: Mapping[str, tuple[int, int]], config: ConnectorConfig, eviction_policy: str,
                namespace: str, chunk_bytes: int, chunk_tokens: int) -> dict[str, Any]:
        """The gauges that differ from the last report, for the index's occupancy `use` (tier -> used, capacity)."""
        if use == self._reported_use:  # the rest is fixed once the index exists: nothing to compare
            return {}
        self._reported_use = use
        store = config.store
        tiers = ",".join(t for t, on in (("cpu", True), ("disk", store.disk_path is not None),
                                         ("mooncake", store.mooncake is not None)) if on)
        state: dict[str, Any] = {
            "cpu_used_chunks": use[Tier.ARENA][0], "cpu_capacity_chunks": use[Tier.ARENA][1],
            "disk_used_chunks": use[Tier.DISK][0], "disk_capacity_chunks": use[Tier.DISK][1],
            "chunk_bytes": chunk_bytes, "chunk_tokens": chunk_tokens,
            STORE_INFO: (namespace, eviction_policy, tiers),
        }
        changed = {name: value for name, value in state.items() if self._reported.get(name) != value}
        self._reported.update(changed)
        return changed
