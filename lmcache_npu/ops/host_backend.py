"""KV pages in host memory moved with memcpy (lmcache_npu._host): the fast backend of vLLM's CPU platform.

It runs the same contract and the same tables as the device kernels (csrc/common/transfer_plan.h), without the
emulator's shadow tracking, so it moves bytes at memory speed; the emu backend remains the proof of the AscendC
kernels.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from .batch import ChunkBatch
from .transfer_backend import AfterKernel, BackendUnavailable, KernelReport, TransferBackend

logger = logging.getLogger(__name__)


class HostBackend(TransferBackend):
    """Moves every (run, plane) work item with memcpy/memset; `threads` > 1 splits the items across std::threads."""

    name = "host"

    def __init__(self, threads: int = 1) -> None:
        try:
            from lmcache_npu import _host
        except ImportError as exc:
            raise BackendUnavailable(f"lmcache_npu._host is not built ({exc}); reinstall with `make setup`") from exc
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
            raise ValueError(f"threads must be an integer, got {threads!r}")
        if not 1 <= int(threads) <= _host.MAX_THREADS:
            raise ValueError(f"threads must be in [1, {_host.MAX_THREADS}], got {threads}")
        self._host = _host
        self.threads = int(threads)

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        plan = batch.plan
        if plan.device.type != "cpu" or any(o.device.type != "cpu" for o in batch.objects):
            raise ValueError("the host backend runs on host memory: planes and chunk objects must be CPU tensors")
        tables = batch.native_tables()
        report = self._host.transfer(
            **batch.native_arguments(tables),
            object_bytes=plan.object_bytes,
            threads=self.threads,
        )
        return KernelReport(bytes_moved=report["bytes_moved"], launches=1, items_done=report["items_done"],
                            items_rejected=report["items_rejected"], dma_ops=report["dma_ops"])
