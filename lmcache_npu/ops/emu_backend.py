"""The AscendC kernel sources run on x86 under the strict emulator (lmcache_npu._emu)."""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from .transfer_backend import AfterKernel, BackendUnavailable, KernelReport, TransferBackend
from .batch import ChunkBatch
from .plan import CORE_STATUS_DTYPE, Direction, PageLayout
from .soc import SOCS, check_soc_rules

logger = logging.getLogger(__name__)


class EmuBackend(TransferBackend):
    """Runs the real kernel sources on emulated cores; every hardware rule is checked."""

    name = "emu"

    def __init__(
        self,
        soc: str = "a2",
        cores: Optional[int] = None,
        ub_bytes: Optional[int] = None,
        order: str = "sequential",
        seed: int = 0,
    ) -> None:
        try:
            from lmcache_npu import _emu
        except ImportError as exc:  # pragma: no cover - the build always produces it
            raise BackendUnavailable(f"lmcache_npu._emu is not built ({exc}); reinstall with `make setup`") from exc
        if soc not in SOCS:
            raise ValueError(f"unknown SoC {soc!r}; expected one of {', '.join(SOCS)}")
        self._emu = _emu
        self.soc = SOCS[soc]
        self.cores = int(cores) if cores is not None else self.soc.vector_cores
        self.ub_bytes = int(ub_bytes) if ub_bytes is not None else self.soc.ub_bytes
        if not 1 <= self.cores <= 65535:
            raise ValueError(f"cores must be in [1, 65535], got {self.cores}")
        if self.ub_bytes > self.soc.ub_bytes:
            raise ValueError(f"ub_bytes {self.ub_bytes} exceeds the {soc} UB of {self.soc.ub_bytes} B")
        self.tiling = _emu.ub_tiling(self.ub_bytes)
        self.order = order
        self.seed = seed

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        plan = batch.plan
        if plan.device.type != "cpu" or any(o.device.type != "cpu" for o in batch.objects):
            raise ValueError("the emu backend runs on host memory: planes and chunk objects must be CPU tensors")
        check_soc_rules(plan, self.soc)
        for plane in plan.moved_planes:
            if plane.layout == PageLayout.FRACTAL_NZ and plane.nz_unit_bytes > self.tiling["tile_bytes"]:
                raise ValueError(f"plane {plane.label}: NZ unit {plane.nz_unit_bytes} B exceeds the UB tile")
        tables = batch.native_tables()
        status = np.zeros(self.cores, dtype=CORE_STATUS_DTYPE)
        load = batch.direction == Direction.LOAD
        regions = [(p.base_addr, p.extent_bytes, load, f"pages:{p.label}") for p in plan.moved_planes]
        regions += [(o.data_ptr(), plan.object_bytes, not load, f"object:{i}") for i, o in enumerate(batch.objects)]
        regions += [(a.ctypes.data, max(a.nbytes, 1), False, f"{name[:-1]} table") for name, a in tables.items()]
        regions.append((status.ctypes.data, status.nbytes, True, "core status"))
        self._emu.launch(
            **batch.native_arguments(tables),
            target=self.soc.name,
            block_dim=self.cores,
            ub_bytes=self.ub_bytes,
            order=self.order,
            seed=self.seed,
            status=status.ctypes.data,
            tile_bytes=self.tiling["tile_bytes"],
            zero_tile_bytes=self.tiling["zero_tile_bytes"],
            regions=regions,
        )
        return KernelReport(
            bytes_moved=int(status["bytes_moved"].sum()),
            launches=1,
            items_done=int(status["items_done"].sum()),
            items_rejected=int(status["items_rejected"].sum()),
            dma_ops=int(status["dma_ops"].sum()) - self.cores,  # less one status write per core
        )
