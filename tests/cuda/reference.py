"""The torch backend's chunks of a drawn case as the reference a CUDA transfer is checked against, and the case's
pages moved to the GPU for the CUDA plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import assume

from lmcache_npu.ops import get_backend

from ..ops.strategies import Case


@dataclass
class CudaReference:
    cpu_plan: Any
    cuda_plan: Any
    expected: torch.Tensor  # (chunks, object bytes): what the torch backend stored from the CPU pages
    cpu_pages: list[torch.Tensor]  # the case's pages on the host (the GPU copies replaced them in the geometry)
    torch_backend: Any


def cuda_reference(case: Case) -> CudaReference:
    """Stores the case with the torch backend from its CPU pages, then moves its pages to the GPU; a case whose plan
    moves nothing (skipped groups only: no chunk object) is assumed away."""
    geometry = case.geometry
    cpu_plan = geometry.plan()
    assume(cpu_plan.object_bytes > 0)
    expected = torch.zeros((case.num_chunks, cpu_plan.object_bytes), dtype=torch.uint8)
    torch_backend = get_backend("torch")
    torch_backend.store(cpu_plan, case.slots, expected)
    cpu_pages = [rp.raw for rp in geometry.raw_planes]
    for rp in geometry.raw_planes:
        rp.raw = rp.raw.cuda()
    return CudaReference(cpu_plan, geometry.plan(), expected, cpu_pages, torch_backend)
