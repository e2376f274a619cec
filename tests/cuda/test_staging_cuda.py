"""What the CUDA backend must not trust or leak: host gap bytes a load brought into staging never reach another
object's gaps, and a work item whose run and plane belong to different groups is rejected, not moved."""

from __future__ import annotations


import pytest
import torch

from lmcache_npu.ops import get_backend
from lmcache_npu.ops import backend as backend_module
from lmcache_npu.ops import cuda_backend

from ..ops.staging_cases import CHUNKS, HOST_GAP, gap_bytes_of_a_store_after_a_load, two_group_geometry, two_group_slots
from .marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_store_after_a_load_writes_no_host_gap_bytes(pipeline: bool) -> None:
    gap_bytes = gap_bytes_of_a_store_after_a_load(get_backend("cuda", path="staging", pipeline=pipeline), CUDA)
    assert not (gap_bytes == HOST_GAP).any(), "a store copied another object's gap bytes out of staging"


def test_negative_control_staging_that_is_not_rezeroed_leaks_gap_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module.StagingBuffer, "zero_pending", lambda self: None)
    backend = get_backend("cuda", path="staging", pipeline=False)
    assert (gap_bytes_of_a_store_after_a_load(backend, CUDA) == HOST_GAP).any()


def _mispair(order: cuda_backend.WorkOrder, batch) -> cuda_backend.WorkOrder:  # type: ignore[no-untyped-def]
    """Pairs every plane of group 1 with a run of group 0: rows the kernel must refuse to move."""
    groups = batch.group_table
    items = order.items.copy()
    second = (items[:, 1] >= groups[1]["plane_begin"]) & (
        items[:, 1] < groups[1]["plane_begin"] + groups[1]["plane_count"])
    items[second, 0] = items[second, 0] - groups[1]["run_begin"] + groups[0]["run_begin"]
    return cuda_backend.WorkOrder(items, order.slice_items, order.pieces)


@pytest.mark.parametrize("path", ["staging", "mapped"])
def test_a_mis_paired_work_item_is_rejected_not_moved(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    plan = two_group_geometry(CUDA).plan()
    backend = get_backend("cuda", path=path, pipeline=False)
    objects = torch.zeros((CHUNKS, plan.object_bytes), dtype=torch.uint8).pin_memory()
    backend.store(plan, two_group_slots(), objects)  # the control: the honest order moves every item
    original = cuda_backend.work_order
    monkeypatch.setattr(cuda_backend, "work_order", lambda batch, *a: _mispair(original(batch, *a), batch))
    with pytest.raises(RuntimeError, match="rejected"):
        backend.store(plan, two_group_slots(), objects)
