"""`LMCacheNPUConnector`: the class vLLM loads from `--kv-transfer-config`, a thin shell over the scheduler half
and the worker half (DESIGN §8). Importing it loads neither torch_npu nor a native module nor CUDA: it is
imported in the API server and the scheduler process too.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch

from ...config import load_config
from . import adapter
from .adapter import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from .metadata import LMCacheNPUConnectorMetadata, WorkerGeometry
from .scheduler import SchedulerHalf
from .stats import LMCacheNPUPromMetrics, LMCacheNPUStats
from .worker import WorkerHalf, engine_store_config

logger = logging.getLogger(__name__)


class LMCacheNPUConnector(KVConnectorBase_V1, SupportsHMA):
    """KV-cache offload to host DRAM, local disk and Mooncake, for every KV-cache group of hybrid models."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = engine_store_config(load_config(self._kv_transfer_config.kv_connector_extra_config), vllm_config)
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(config, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerHalf(config, vllm_config, kv_cache_config)

    @property
    def scheduler_half(self) -> SchedulerHalf:
        assert self._scheduler is not None, "a scheduler-side call on the worker connector"
        return self._scheduler

    @property
    def worker_half(self) -> WorkerHalf:
        assert self._worker is not None, "a worker-side call on the scheduler connector"
        return self._worker

    def _metadata(self) -> LMCacheNPUConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheNPUConnectorMetadata), f"unexpected connector metadata {type(meta).__name__}"
        return meta

    # ---- worker side ------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_half.register_kv_caches(kv_caches, composed=adapter.composed(self))

    def get_handshake_metadata(self) -> Optional[WorkerGeometry]:
        """The rank's plan, when this is the engine's only connector. A MultiConnector hands the first child's
        handshake to every child, so beside another connector (NIXL has one) the plan goes in the worker metadata."""
        geometry = self.worker_half.geometry
        return None if geometry is None or geometry.composed else geometry

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.worker_half.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_half.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Teaches the hook map which layers the runtime announces (hook_map.py), a set lookup per layer; in a step
        with sliced loads the model's stream also waits for this layer's slice (sliced_loads.py)."""
        self.worker_half.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores run once per step for all layers (`wait_for_save`), as one kernel launch."""

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        sending, recving, _ = self.worker_half.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.30: the same, with the requests whose load failed (they recompute)."""
        sending, recving, failed = self.worker_half.get_finished()
        return adapter.transfer_results(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.take_load_error_blocks()

    def build_connector_worker_meta(self) -> Any:
        return self.worker_half.build_worker_meta()

    def get_kv_connector_stats(self) -> Optional[LMCacheNPUStats]:
        """What either half counted since the last call; None when nothing (most steps), which vLLM skips instead of
        shipping, merging and logging an empty object (a worker on an older vLLM still reports: adapter says why)."""
        if self._worker is not None:
            stats = self._worker.stats()
            return None if stats.is_empty() and adapter.WORKER_STATS_MAY_BE_NONE else stats
        stats = self.scheduler_half.stats()
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ---------------------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Our workers' plans; inside a MultiConnector, maybe another child's handshake (ours then come with the
        workers' metadata)."""
        plans = [m for m in metadata.values() if isinstance(m, WorkerGeometry)]
        if plans:
            self.scheduler_half.set_worker_geometry(plans)
        else:
            logger.info("lmcache_npu: the workers' handshake is another connector's (%s); their plans come with their "
                        "first step's metadata", ", ".join(sorted({type(m).__name__ for m in metadata.values()})))

    def on_new_request(self, request: Any) -> None:
        self.scheduler_half.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """vLLM >= 0.32: the groups a load writes (their new blocks need no zeroing); a skipped group is not."""
        return self.scheduler_half.loaded_group_ids()

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM >= 0.28: a best-effort cache (a lost store is a later miss), so a request preempted while its store
        is in flight keeps its output; the page fence and delayed frees already keep its pages intact."""
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheNPUConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.scheduler_half.request_finished(request, [block_ids])

    def take_events(self) -> Iterable[Any]:
        """vLLM's scheduler publishes these with its own KV events every step: the chunks that entered or left the
        arena, the disk or Mooncake (empty unless `--kv-events-config` enables KV-cache events)."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.scheduler_half.request_finished(request, block_ids)

    # ---- class-level hooks ------------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> LMCacheNPUStats:
        return LMCacheNPUStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LMCacheNPUPromMetrics:
        return LMCacheNPUPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
