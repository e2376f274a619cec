"""Builds the scheduler half's chunk manager from the config and the ranks' agreed plan: the node cache's client when
`node_cache` names a service, else the in-process index (which adopts what a previous run left on disk, in
`store/factory.build_index`). The caller gets the manager's verbs and its view and never asks which one it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...config import ConnectorConfig
from ...node.client import NodeCacheClient
from ...node.messages import PoolGeometry
from ...store.factory import build_index
from ...store.index.contract import Admission, ChunkManager, ChunkManagerView
from .metadata import WorkerGeometry


@dataclass(frozen=True)
class BuiltManager:
    """One manager as two faces: the scheduler's verbs, and what it holds (gauges, status, tests)."""

    manager: ChunkManager
    view: ChunkManagerView


def build_manager(config: ConnectorConfig, engine: str, agreed: WorkerGeometry, world: int,
                  remote: Optional[Any] = None, admission: Optional[Admission] = None) -> BuiltManager:
    """The manager for `world` ranks that agreed on `agreed`; `remote` (the scheduler's Mooncake client for existence
    checks) and `admission` (whether a slow-tier copy pays) serve the index in process only: the node's service
    decides both for itself."""
    if config.node_cache is not None:
        client = NodeCacheClient(config.node_cache, engine, PoolGeometry(
            agreed.namespace, agreed.layout_fingerprint, world, agreed.object_bytes, agreed.chunk_tokens),
            weights=agreed.weights, connect_timeout_s=config.node_cache_start_wait_ms / 1000)
        return BuiltManager(client, client)
    index = build_index(config.store, agreed.object_bytes, world, agreed.namespace, agreed.layout_fingerprint,
                        remote_client=remote, num_slots=agreed.num_slots, admission=admission)
    return BuiltManager(index, index)
