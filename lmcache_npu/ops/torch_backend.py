"""Reference backend in plain PyTorch indexing; runs on any device, one gather/scatter per plane."""

from __future__ import annotations

from typing import Optional

import torch

from .transfer_backend import AfterKernel, KernelReport, TransferBackend
from .batch import ChunkBatch
from .plan import Direction, PageLayout, Plane


def row_view(plane: Plane) -> torch.Tensor:
    """(num_blocks, rows_per_block, row_bytes) for ND; NZ rows are gathered across its columns."""
    p = plane.pages
    if plane.layout == PageLayout.ND:
        return p.as_strided((plane.num_blocks, plane.rows_per_block, plane.row_bytes),
                            (plane.block_stride_bytes, plane.row_bytes, 1))
    unit = plane.nz_unit_bytes
    cols = plane.row_bytes // unit
    # NZ block: [cols][rows_per_block][unit]; index [block, row] -> (cols, unit).
    return p.as_strided((plane.num_blocks, plane.rows_per_block, cols, unit),
                        (plane.block_stride_bytes, unit, plane.rows_per_block * unit, 1))


class TorchBackend(TransferBackend):
    """No kernel: its report counts the bytes its gathers and scatters moved, and it works in no (run, plane) items."""

    name = "torch"

    def _launch(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel]) -> KernelReport:
        plan = batch.plan
        bytes_moved = 0
        for plane, offset in zip(plan.moved_planes, plan.object_offsets):
            matrix = torch.from_numpy(batch.slots[plane.group])
            rows = matrix.shape[1]
            live = matrix >= 0
            slots = matrix.clamp(min=0).to(plane.pages.device)
            blocks, within = slots // plane.rows_per_block, slots % plane.rows_per_block
            view = row_view(plane)
            segment = slice(offset, offset + rows * plane.row_bytes)
            if batch.direction == Direction.STORE:
                gathered = view[blocks, within].reshape(len(batch.objects), rows, plane.row_bytes)
                gathered[~live.to(gathered.device)] = 0
                for c, obj in enumerate(batch.objects):
                    obj[segment].view(rows, plane.row_bytes).copy_(gathered[c], non_blocking=True)
                    bytes_moved += gathered[c].numel()
            else:
                for c, obj in enumerate(batch.objects):
                    keep = live[c].to(plane.pages.device)
                    if not bool(keep.any()):
                        continue
                    src = obj[segment].view(rows, plane.row_bytes).to(plane.pages.device)[keep]
                    view[blocks[c][keep], within[c][keep]] = src.reshape((src.shape[0],) + tuple(view.shape[2:]))
                    bytes_moved += src.numel()
        if plan.device.type == "cuda":
            torch.cuda.current_stream(plan.device).synchronize()
        return KernelReport(bytes_moved=bytes_moved, launches=0)
