"""What the connector's halves tell each other: plain picklable dataclasses, no tensors.

Scheduler → every worker, once per step (`LMCacheNPUConnectorMetadata`): the store index's tier commands in the
order every rank runs them, each request's device moves (a Load or Store with the block ids it touches), and the
earlier stores whose pages this step writes (the page fence waits for those only). Workers → scheduler
(`LMCacheNPUWorkerMetadata`): each rank's command completions, and for the cost model the step numbers it ran (the
echo of `LMCacheNPUConnectorMetadata.step`) and its timed transfer batches, merged by vLLM across ranks with
`aggregate`; they travel beside the plans below, in either kind of deployment.
At start-up each worker reports its plan (`WorkerGeometry`): the scheduler builds its index and reads the plan
groups from it, because vLLM hands the scheduler a KV-cache config whose multi-spec groups are collapsed to one
arbitrary layer's spec. The plan travels as vLLM's handshake metadata when this connector is the engine's only one,
and always in the workers' metadata until the scheduler says it has it: a MultiConnector hands one child's handshake
to every child, so beside a P/D connector (NIXL) only the worker metadata, which it keeps per child, reaches us.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from ...layout.discovery import LayoutGroup
from ...node.messages import WEIGHTS_UNNAMED
from ...store.commands import Command, Completion, DeviceMove
from ...store.cost import TransferSample
from ...transfer.plans import LoadPlan, StorePlan
from .adapter import KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata

logger = logging.getLogger(__name__)

@dataclass
class LMCacheNPUConnectorMetadata(KVConnectorMetadata):
    commands: list[Command] = field(default_factory=list)  # the tier commands (spills, promotions, puts, drops)
    loads: list[LoadPlan] = field(default_factory=list)  # the step's device moves, per request: loads
    stores: list[StorePlan] = field(default_factory=list)  # and stores
    delayed_free: list[str] = field(default_factory=list)  # report finished_sending once their stores settled
    # store cmd ids of earlier steps that read a block this step writes: the page fence waits for their batches only;
    # None: the scheduler could not tell (a request it does not track), so the fence waits for every queued store
    fenced_stores: Optional[list[int]] = None
    # vLLM computes nothing this step (every runnable request waits for its KV): the workers may wait for a load to
    # finish instead of letting the engine spin through empty steps
    idle: bool = False
    # the scheduler has every rank's plan (from the handshake or the workers' metadata): they stop sending it
    geometry_known: bool = False
    # the node cache's epoch these commands are of (None without a node cache; "" while the scheduler has none): a
    # worker maps that epoch's segments in the background and fails its commands until it has them; a mapping of a
    # service that is gone is unmapped once its commands settled
    node_epoch: Optional[str] = None
    # the node cache's token of this engine's lease: a worker's connection joins that lease before it runs them
    node_lease: Optional[str] = None
    # commands the plans may name that the node cache was lost before sending: every rank answers them as failed
    refused: list[Command] = field(default_factory=list)
    # this step's number where it computes something: the workers echo it, and the scheduler times the step to its
    # output (the cost model's compute side)
    step: Optional[int] = None

    def load_moves(self) -> list[DeviceMove]:
        """Every load of the step, request by request, chunks in order."""
        return [move for plan in self.loads for move in plan.moves]

    def store_moves(self) -> list[DeviceMove]:
        """Every store of the step, request by request."""
        return [move for plan in self.stores for move in plan.moves]


SlotRanges = tuple[tuple[int, int], ...]  # [first, end) arena slot ranges


def usable_on_every_rank(by_rank: Mapping[int, SlotRanges], num_slots: int) -> SlotRanges:
    """The slots of `num_slots` inside a live range of every rank that reported (one that has not counts as fully
    live: its handshake said nothing)."""
    usable = np.ones(num_slots, dtype=bool)
    for ranges in by_rank.values():
        live = np.zeros(num_slots, dtype=bool)
        for begin, end in ranges:
            live[begin:min(end, num_slots)] = True
        usable &= live
    edges = np.flatnonzero(np.diff(np.concatenate(([0], usable.view(np.int8), [0]))))
    return tuple((int(b), int(e)) for b, e in zip(edges[::2], edges[1::2]))


@dataclass
class LMCacheNPUWorkerMetadata(KVConnectorWorkerMetadata):
    completions: list[Completion] = field(default_factory=list)
    # rank -> the slot ranges of its live arena segments, sent when they change (segments register in the background)
    usable_slots: dict[int, SlotRanges] = field(default_factory=dict)
    # rank -> the node cache epoch it has mapped whole ("" none), sent when it changes
    node_epochs: dict[int, str] = field(default_factory=dict)
    # rank -> its plan, sent with every step until the scheduler's metadata says it has every rank's
    geometries: dict[int, "WorkerGeometry"] = field(default_factory=dict)
    # every rank's timed transfer batches since its last report: the scheduler's cost model learns the tiers from them
    timings: list[TransferSample] = field(default_factory=list)
    # the steps (`LMCacheNPUConnectorMetadata.step`) the ranks ran since their last report (one entry per rank)
    steps: list[int] = field(default_factory=list)
    # forwards that may have read a sliced load before it landed (a layer ran without its hook), summed over ranks
    unwaited_sliced: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LMCacheNPUWorkerMetadata":
        if not isinstance(other, LMCacheNPUWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into LMCacheNPUWorkerMetadata")
        return LMCacheNPUWorkerMetadata(completions=self.completions + other.completions,
                                        usable_slots={**self.usable_slots, **other.usable_slots},
                                        node_epochs={**self.node_epochs, **other.node_epochs},
                                        geometries={**self.geometries, **other.geometries},
                                        timings=self.timings + other.timings, steps=self.steps + other.steps,
                                        unwaited_sliced=self.unwaited_sliced + other.unwaited_sliced)


@dataclass(frozen=True)
class WorkerGeometry(KVConnectorHandshakeMetadata):
    """One rank's plan, reported once after `register_kv_caches`; the scheduler builds its index from these.
    This handshake (or the same plan carried in worker metadata) is the scheduler's only source of `chunk_tokens`:
    it never reads the config's, and the rule that a chunk is a multiple of the hash block was checked where the
    worker laid the chunk out (`discover_layout`)."""

    rank: int
    world: int
    enabled: bool
    reason: str = ""  # why the rank moves nothing (every group skipped)
    namespace: str = ""
    layout_fingerprint: bytes = b""
    chunk_tokens: int = 0
    object_bytes: int = 0
    num_slots: int = 0
    usable_slots: Optional[SlotRanges] = None  # live arena segments' slot ranges at the handshake; None: all
    groups: tuple[LayoutGroup, ...] = ()  # the plan groups, planes left out: how a chunk's rows map to blocks
    backend: str = ""
    device: str = ""
    identity: tuple[tuple[str, str], ...] = ()  # what the rank's model fingerprint was made of (`EngineIdentity`)
    node_epoch: Optional[str] = None  # the node cache epoch the rank had mapped at the handshake ("" none)
    weights: str = WEIGHTS_UNNAMED  # how that identity names the weights (`EngineIdentity.weights_naming`)
    composed: bool = False  # the rank's connector is one child of a MultiConnector (beside a P/D connector, maybe)
    sliced_loads: bool = False  # the rank's mover launches a load slice by slice (not with tp_share's exchange)

    @staticmethod
    def agree(geometries: Sequence["WorkerGeometry"], world: int) -> Optional["WorkerGeometry"]:
        """The plan every rank of an engine of `world` ranks holds: the lowest rank's, with as many slots as every
        rank's arena has. None (the ranks' reasons logged) when some rank moves nothing; a ValueError when a rank is
        missing, loads other weights or lays chunks out differently."""
        ranks = sorted(g.rank for g in geometries)
        if ranks != list(range(world)):
            raise ValueError(f"lmcache_npu expected handshakes from ranks 0..{world - 1}, got {ranks}")
        if not all(g.enabled for g in geometries):
            reasons = {g.reason for g in geometries if not g.enabled}
            logger.warning("lmcache_npu is idle: %s", "; ".join(sorted(reasons)))
            return None
        first = min(geometries, key=lambda g: g.rank)
        for g in geometries:
            if g.namespace != first.namespace and g.layout_fingerprint == first.layout_fingerprint:
                mine, theirs = dict(first.identity), dict(g.identity)
                differ = sorted(k for k in mine.keys() | theirs.keys()
                                if not k.endswith("seconds") and mine.get(k) != theirs.get(k))
                raise ValueError(f"rank {g.rank} runs another model identity than rank {first.rank} (differing: "
                                 f"{', '.join(differ) or 'the fingerprint'}): every rank of one engine must load the "
                                 "same weights and config")
            if (g.namespace, g.layout_fingerprint, g.chunk_tokens, g.object_bytes, g.groups) != (
                    first.namespace, first.layout_fingerprint, first.chunk_tokens, first.object_bytes, first.groups):
                raise ValueError(f"rank {g.rank} lays chunks out differently from rank {first.rank} "
                                 f"({g.object_bytes} B vs {first.object_bytes} B per {g.chunk_tokens}-token chunk): "
                                 "every rank of one engine must hold the same shard geometry")
        return dataclasses.replace(first, num_slots=min(g.num_slots for g in geometries))


def plan_group_geometry(groups: tuple[LayoutGroup, ...]) -> tuple[LayoutGroup, ...]:
    """Plan groups as the handshake carries them: everything but the planes."""
    return tuple(dataclasses.replace(g, planes=()) for g in groups)
