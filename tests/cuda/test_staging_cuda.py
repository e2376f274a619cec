"""What the CUDA backend must not trust or leak: host gap bytes a load brought into staging never reach another
object's gaps, and a work item whose run and plane belong to different groups is rejected, not moved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache_npu.ops import get_backend
from lmcache_npu.ops import device_staging
from lmcache_npu.ops.cuda import work_order as planner

from ..ops.staging_cases import CHUNKS, HOST_GAP, gap_bytes_of_a_store_after_a_load, two_group_geometry, two_group_slots
from .cuda_marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_store_after_a_load_writes_no_host_gap_bytes(pipeline: bool) -> None:
    backend = get_backend("cuda", path="staging", pipeline=pipeline, store_first_slice_bytes=64,
                          load_tail_bytes=0, load_tail_share=2)  # small slices: the pipelined variant has several
    gap_bytes = gap_bytes_of_a_store_after_a_load(backend, CUDA)
    assert not (gap_bytes == HOST_GAP).any(), "a store copied another object's gap bytes out of staging"


def test_negative_control_staging_that_is_not_rezeroed_leaks_gap_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_staging.StagingBuffer, "take_pending", lambda self: None)
    backend = get_backend("cuda", path="staging", pipeline=False)
    assert (gap_bytes_of_a_store_after_a_load(backend, CUDA) == HOST_GAP).any()


def _mispair(order: planner.WorkOrder) -> planner.WorkOrder:
    """Pairs every plane of group 1 with a run of group 0: rows the kernel must refuse to move."""
    groups = order.group_table
    items = order.items.copy()
    second = (items[:, 1] >= groups[1]["plane_begin"]) & (
        items[:, 1] < groups[1]["plane_begin"] + groups[1]["plane_count"])
    items[second, 0] = items[second, 0] - groups[1]["run_begin"] + groups[0]["run_begin"]
    return dataclasses.replace(order, items=items)


@pytest.mark.parametrize("path", ["staging", "mapped"])
def test_a_mis_paired_work_item_is_rejected_not_moved(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    plan = two_group_geometry(CUDA).plan()
    backend = get_backend("cuda", path=path, pipeline=False)
    objects = torch.zeros((CHUNKS, plan.object_bytes), dtype=torch.uint8).pin_memory()
    backend.store(plan, two_group_slots(), objects)  # the control: the honest order moves every item
    original = planner.work_order  # the backend and prefix_order both call it through the planner module
    monkeypatch.setattr(planner, "work_order", lambda *a, **k: _mispair(original(*a, **k)))
    with pytest.raises(RuntimeError, match="rejected"):
        backend.store(plan, two_group_slots(), objects)
