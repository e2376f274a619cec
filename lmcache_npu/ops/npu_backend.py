"""The AscendC kernel on an Ascend NPU (lmcache_npu._npu); torch_npu is imported only here, lazily.

Chunk objects may live on the NPU (the kernel writes them directly) or in pinned host memory: the
kernel gathers into a device staging buffer and async copies move it over PCIe/HCCS with the DMA
engine, so no AI-core time is spent waiting on the host link. Objects adjacent in host memory (the
arena's consecutive slots) share one copy: one per direction when a batch's slots are consecutive.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import numpy as np
import torch

from .device_staging import PlaneTables, StagingBuffer, copy_stretches, host_stretches, pack_pinned
from .transfer_backend import (
    AfterKernel,
    BackendUnavailable,
    TransferBackend,
    TransferStats,
    verify_kernel_report,
    warm_up,
)
from .batch import ChunkBatch
from .emu_backend import SOCS, SocSpec, check_soc_rules
from .plan import CORE_STATUS_DTYPE, Direction, TransferPlan

logger = logging.getLogger(__name__)


def _soc_from_name(name: str, ub_bytes: int, vector_cores: int) -> SocSpec:
    family = "310p" if "310p" in name.lower() else ("a3" if "910_93" in name.lower() else "a2")
    base = SOCS[family]
    return SocSpec(family, ub_bytes, vector_cores, base.has_datacopy_pad, base.has_bf16)


class NpuHostRegistrar:
    """Registers host arena segments with the NPU through aclrtHostRegister / aclrtHostUnregister (our native
    module, built only with CANN), one call per segment: no pinned allocator, so no power-of-two rounding."""

    name = "aclrtHostRegister"

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        try:
            from lmcache_npu import _npu  # type: ignore[attr-defined]
        except ImportError as exc:
            raise BackendUnavailable("registering the host arena with the NPU needs lmcache_npu._npu (reinstall with "
                                     "CANN present)") from exc
        self._npu: Any = _npu

    def bind_thread(self) -> None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        torch.npu.set_device(self.device_index)  # type: ignore[attr-defined]  # ACL calls act on the thread's device

    def register(self, address: int, nbytes: int) -> int:
        return int(self._npu.host_register(address, nbytes))

    def unregister(self, address: int) -> None:
        self._npu.host_unregister(address)


class NpuBackend(TransferBackend):
    name = "npu"

    def __init__(self, cores: int | None = None) -> None:
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError as exc:
            raise BackendUnavailable(
                "the npu backend needs torch_npu (and CANN); it is not importable here: " + str(exc)
            ) from exc
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise BackendUnavailable("torch_npu is installed but no Ascend NPU is visible")
        try:
            from lmcache_npu import _npu  # type: ignore[attr-defined]
        except ImportError as exc:
            raise BackendUnavailable(
                "lmcache_npu._npu is not built: reinstall with CANN present (ASCEND_HOME_PATH set, SOC_VERSION "
                "or npu-smi available)"
            ) from exc
        from lmcache_npu import _emu

        self._npu: Any = _npu
        info = _npu.platform()
        self.soc = _soc_from_name(info["soc"], int(info["ub_bytes"]), int(info["vector_cores"]))
        self.cores = int(cores) if cores is not None else self.soc.vector_cores
        self.tiling = _emu.ub_tiling(self.soc.ub_bytes)  # the one tiling function (transfer_plan.h)
        self._plane_tables = PlaneTables()
        self._staging = StagingBuffer()
        logger.info("npu backend on %s: %d vector cores, %d B UB, tile %d B", info["soc"], self.cores,
                    self.soc.ub_bytes, self.tiling["tile_bytes"])

    def prepare(self, plan: TransferPlan) -> None:
        self._plane_tables.upload(plan)
        warm_up(self, plan)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        plan = batch.plan
        device = plan.device
        if device.type != "npu":
            raise ValueError(f"the npu backend moves NPU pages; the plan's planes are on {device}")
        check_soc_rules(plan, self.soc)
        on_device = all(o.device == device for o in batch.objects)
        if not on_device and any(o.device.type != "cpu" for o in batch.objects):
            raise ValueError("chunk objects must all be on the plan's NPU or all in host memory")
        stream = torch.npu.current_stream(device)  # type: ignore[attr-defined]
        start = time.perf_counter()
        staging: Optional[torch.Tensor] = None
        stretches: list[tuple[int, int, int]] = []
        if on_device:
            object_addrs = batch.object_addresses()
        else:
            staging = self._staging.get(plan, batch.num_chunks * plan.object_bytes, batch.direction)
            object_addrs = staging.data_ptr() + np.arange(batch.num_chunks, dtype=np.uint64) * np.uint64(
                plan.object_bytes)
            stretches = host_stretches(batch.objects, [(c, 0, plan.object_bytes) for c in range(batch.num_chunks)],
                                       plan.object_bytes)
            if batch.direction == Direction.LOAD:
                copy_stretches(staging, batch.objects, stretches, plan.object_bytes, to_device=True)
        host, offsets = pack_pinned([batch.group_table, batch.runs, object_addrs])  # one H2D copy
        tables = host.to(device, non_blocking=True)
        status = torch.zeros(self.cores * CORE_STATUS_DTYPE.itemsize, dtype=torch.uint8, device=device)
        base = tables.data_ptr()
        self._npu.launch(
            stream=stream.npu_stream, block_dim=self.cores, planes=self._plane_tables.get(plan).data_ptr(),
            groups=base + offsets[0], runs=base + offsets[1], objects=base + offsets[2],
            status=status.data_ptr(), total_items=batch.total_items, num_planes=len(plan.plane_table),
            num_groups=len(batch.group_table), num_runs=batch.runs.size, num_chunks=batch.num_chunks,
            direction=int(batch.direction), tile_bytes=self.tiling["tile_bytes"],
            zero_tile_bytes=self.tiling["zero_tile_bytes"],
        )
        if after_kernel is not None:
            after_kernel(None)  # the stream's present position is right after the kernel: the pages are free there
        if staging is not None and batch.direction == Direction.STORE:
            copy_stretches(staging, batch.objects, stretches, plan.object_bytes, to_device=False)
        stream.synchronize()
        seconds = time.perf_counter() - start
        report = status.cpu().numpy().view(CORE_STATUS_DTYPE)
        verify_kernel_report(batch, int(report["items_done"].sum()), int(report["items_rejected"].sum()),
                             int(report["bytes_moved"].sum()))
        return TransferStats(backend=self.name, direction=batch.direction, chunks=batch.num_chunks,
                             payload_bytes=batch.payload_bytes, launches=1, seconds=seconds,
                             dma_ops=int(report["dma_ops"].sum()) - self.cores)
