"""What the connector's halves tell each other: plain picklable dataclasses, no tensors.

Scheduler → every worker, once per step (`LMCacheNPUConnectorMetadata`): the store index's commands in the order
every rank runs them, and for the requests those commands move, the block ids they touch. Workers → scheduler
(`LMCacheNPUWorkerMetadata`): each rank's command completions, merged by vLLM across ranks with `aggregate`.
At start-up each worker reports its plan once (`WorkerGeometry`, vLLM's handshake metadata): the scheduler builds
its index and reads the plan groups from it, because vLLM hands the scheduler a KV-cache config whose multi-spec
groups are collapsed to one arbitrary layer's spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...layout.discovery import LayoutGroup
from ...store.commands import Command, Completion
from .adapter import KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockWindow:
    """Part of one request's block table: per scheduler group, the ids of logical blocks starting at `first_block`
    (vLLM's null block 0 marks a block it freed or never allocated)."""

    first_block: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LoadPlan:
    """One request's loads of this step: chunks `[first_token // chunk, end_token // chunk)` into its pages."""

    request_id: str
    cmd_ids: tuple[int, ...]  # one Load per chunk, in chunk order
    first_chunk: int
    window: BlockWindow
    first_token: int  # vLLM's own prefix cache computed the tokens before this one: their rows are left alone
    end_token: int  # the hit's end; only the chunk ending here loads end-state rows (a recurrent state)
    error_block_ids: tuple[int, ...] = ()  # what an invalid-block report names if the load fails
    refused: str = ""  # the index could not issue the loads (the reason): the worker reports a failed load


@dataclass(frozen=True)
class StorePlan:
    """One request's stores of this step, run after the forward that computed their last tokens."""

    request_id: str
    cmd_ids: tuple[int, ...]
    chunk_indices: tuple[int, ...]
    window: BlockWindow
    without_end_state: tuple[int, ...] = ()  # cmd ids stored with their end-state rows left out (zeros)


@dataclass
class LMCacheNPUConnectorMetadata(KVConnectorMetadata):
    commands: list[Command] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StorePlan] = field(default_factory=list)
    delayed_free: list[str] = field(default_factory=list)  # report finished_sending once their stores settled
    preempted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.commands or self.loads or self.stores or self.delayed_free or self.preempted)


@dataclass
class LMCacheNPUWorkerMetadata(KVConnectorWorkerMetadata):
    completions: list[Completion] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LMCacheNPUWorkerMetadata":
        if not isinstance(other, LMCacheNPUWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into LMCacheNPUWorkerMetadata")
        return LMCacheNPUWorkerMetadata(self.completions + other.completions)


@dataclass(frozen=True)
class WorkerGeometry(KVConnectorHandshakeMetadata):
    """One rank's plan, reported once after `register_kv_caches`; the scheduler builds its index from these."""

    rank: int
    world: int
    enabled: bool
    reason: str = ""  # why the rank moves nothing (every group skipped)
    namespace: str = ""
    layout_fingerprint: bytes = b""
    chunk_tokens: int = 0
    object_bytes: int = 0
    num_slots: int = 0
    groups: tuple[LayoutGroup, ...] = ()  # the plan groups, planes left out: how a chunk's rows map to blocks
    backend: str = ""
    device: str = ""


def plan_group_geometry(groups: tuple[LayoutGroup, ...]) -> tuple[LayoutGroup, ...]:
    """Plan groups as the handshake carries them: everything but the planes."""
    return tuple(dataclasses.replace(g, planes=()) for g in groups)
