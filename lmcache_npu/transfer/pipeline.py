"""One rank's worker side, built in one place (vLLM's `OffloadingSpec.get_handlers(kv_caches)`): the transfer lanes
over the registered KV caches, the share exchange where this rank stores a share of replicated planes, then the store
executor with its host arena, its disk and Mooncake tiers and their route handlers (`build_executor`, which the node
cache's pools call too). The connector's worker half and the benches that time its path build it here, so they
build the same thing in the same order."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..layout.discovery import KVLayout
from ..ops import TransferBackend
from ..store.arena import HostArena
from ..store.config import StoreConfig
from ..store.disk.tier import DiskTier
from ..store.envelope import sealed_bytes
from ..store.executor import StoreExecutor
from ..store.factory import store_sealer
from ..store.keys import namespace_of, storage_names_of
from ..store.mooncake import MooncakeTier
from ..store.routes.build import make_executor
from ..store.routes.device import DeviceMover
from ..store.tier import TierCounters
from .mover import KVMover
from .share_mover import ShareExchange, SharedMover
from .shares import ShareLayout
from .streams import StreamKit

logger = logging.getLogger(__name__)


@dataclass
class WorkerPipeline:
    """The lanes and the executor of one rank; the arena and the tiers are the executor's."""

    mover: KVMover
    executor: StoreExecutor
    layout_fingerprint: bytes  # what the stored objects are keyed by: the plan's, or its shares' under tp_share
    namespace: Optional[str]  # the model's and that fingerprint's (None where no model identity was given)

    @property
    def arena(self) -> HostArena:
        return self.executor.arena

    @property
    def object_bytes(self) -> int:
        """What this rank stores per chunk: the whole object, or its share of it."""
        return self.executor.arena.object_bytes

    @property
    def disk(self) -> Optional[DiskTier]:
        return self.executor.disk

    @property
    def remote(self) -> Optional[MooncakeTier]:
        return self.executor.remote

    def close(self) -> None:
        """The lanes first (no transfer reports after), then the executor, which closes its tiers."""
        self.mover.close()
        self.executor.close()


def build_executor(config: StoreConfig, rank: int, object_bytes: int, layout_fingerprint: bytes,
                   mover: Optional[DeviceMover], namespace: Optional[str] = None,
                   arena: Optional[HostArena] = None, remote: Optional[Any] = None) -> StoreExecutor:
    """One rank's arena, tiers and executor; closing the executor closes the tiers. The disk tier counts only
    this rank's files of `namespace` (every file of this rank when None) against `disk_bytes`. `arena` and `remote`
    (a `MooncakeTier`) are used as given instead of being made from the config (the node cache shares them)."""
    sealer = store_sealer(config)  # first: a bad secret refuses start-up before any memory is allocated
    if arena is None:
        arena = HostArena.for_capacity(config.cpu_bytes, object_bytes, pinned=config.pinned,
                                       numa_node=config.numa_node, segment_bytes=config.arena_segment_bytes,
                                       hugepages=config.hugepages, npu_host_memory=config.npu_host_memory)
    disk = None
    if config.disk_path is not None:
        disk = DiskTier(config.disk_path, layout_fingerprint, capacity_bytes=config.disk_bytes,
                        max_pending_bytes=config.disk_max_pending_bytes, writer_threads=config.disk_writer_threads,
                        owns=storage_names_of(namespace, rank),
                        lock_name=None if namespace is None else f"{namespace}-r{rank}",
                        yields=config.yield_to_compute)
    if remote is None and config.mooncake is not None:
        mooncake = config.mooncake_config()
        if not mooncake.zero_copy and mooncake.bounce_bytes < sealed_bytes(object_bytes):
            # one sealed chunk must fit, or every transfer would fall back to the client's slower copy calls
            logger.warning("mooncake.bounce_bytes %d is smaller than one sealed chunk (%d B); using %d B",
                           mooncake.bounce_bytes, sealed_bytes(object_bytes), arena.slot_bytes)
            mooncake = dataclasses.replace(mooncake, bounce_bytes=arena.slot_bytes)
        remote = MooncakeTier(mooncake)
    return make_executor(rank, arena, mover, disk=disk, remote=remote, io_threads=config.io_threads, sealer=sealer,
                         yields=config.yield_to_compute)


def build_worker_pipeline(layout: KVLayout, store: StoreConfig, rank: int, make_backend: Callable[[], TransferBackend],
                          counters: TierCounters, *, load_retries: int = 0, model_identity: Optional[bytes] = None,
                          shared: Optional[tuple[ShareLayout, Callable[[], ShareExchange]]] = None,
                          arena_for: Optional[Callable[[Optional[str], bytes, int], HostArena]] = None
                          ) -> WorkerPipeline:
    """The lanes (a backend from `make_backend` per direction, so a device without one fails before the arena
    exists); with `shared` (this rank's share of the replicated planes, and how to make the exchange) the exchange and
    the mover that stores and loads shares; then the executor sized by `store` for what this rank stores per chunk,
    or over the arena `arena_for(namespace, layout fingerprint, object bytes)` gives (the node cache's, mapped)."""
    plan = layout.plan
    mover = KVMover(layout, make_backend, lambda: StreamKit.for_device(plan.device), rank, load_retries, counters,
                    cpus=store.transfer_cpus)
    device_mover: Any = mover
    fingerprint, object_bytes = plan.fingerprint, plan.object_bytes
    if shared is not None:
        shares, make_exchange = shared
        fingerprint, object_bytes = shares.fingerprint(fingerprint), shares.object_bytes
        exchange = make_exchange()
        device_mover = SharedMover(mover, shares, exchange, counters, pin=plan.device.type != "cpu", rank=rank)
        logger.info("lmcache_npu rank %d: tp_share on, %d of %d B per chunk stored here (%d own, share %d B of "
                    "%d replicated), shares exchanged in %s memory", rank, object_bytes, plan.object_bytes,
                    shares.own_bytes, shares.share_bytes, shares.replicated_bytes,
                    "device" if exchange.on_device else "host")
    namespace = None if model_identity is None else namespace_of(model_identity, fingerprint)
    try:
        arena = arena_for(namespace, fingerprint, object_bytes) if arena_for is not None else None
        executor = build_executor(store, rank, object_bytes, fingerprint, device_mover, namespace, arena=arena)
    except BaseException:
        mover.close()  # the lanes' threads must not outlive a start-up that failed (a refused secret, no memory)
        raise
    return WorkerPipeline(mover, executor, fingerprint, namespace)
