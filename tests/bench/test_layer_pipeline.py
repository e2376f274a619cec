"""The layer_pipeline study's core on the host backend (issue 41): a forward that waits for each layer's slice reads
every loaded byte of that layer, one that skips the waits reads pages the lane has not written yet (the negative
control, with the lane slowed down), and the study's ideal and over-ideal arithmetic is the issue's formula."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lmcache_npu.ops import Direction
from lmcache_npu.ops.torch_backend import row_view
from lmcache_npu.tools.bench.geometry import Geometry, GroupGeometry, PlaneGeometry
from lmcache_npu.tools.bench.studies import layer_pipeline as study
from lmcache_npu.transfer.slices import layer_key, plan_slices

LAYERS = 6


def tiny_geometry() -> Geometry:
    planes = tuple(PlaneGeometry(row_bytes=128, rows_per_block=16, block_stride_bytes=2048, dtype="bf16",
                                 name=f"model.layers.{n}.self_attn.attn:{kv}") for n in range(LAYERS) for kv in "kv")
    return Geometry((GroupGeometry(tokens_per_block=16, planes=planes),), chunk_tokens=32, name="tiny")


class Delayed:
    """The load lane's backend, each launch held back so a forward that does not wait runs ahead of it."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def prepare(self, plan: Any) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: Any, after_kernel: Optional[Any] = None) -> Any:
        time.sleep(self.seconds)
        return self.inner.transfer(batch, after_kernel=after_kernel)


def layer_landed(case: study.Case, layer: str) -> bool:
    """Every row of every plane `layer` consumes holds the stored chunk's bytes."""
    plan = case.layout.plan
    for index, plane in enumerate(plan.moved_planes):
        if layer_key(plane.name) != layer_key(layer):
            continue
        rows, offset = plan.rows_per_chunk[plane.group], plan.object_offsets[index]
        for chunk, obj in enumerate(case.load_objects):
            slots = torch.from_numpy(case.slots[plane.group][chunk])
            pages = row_view(plane)[slots // plane.rows_per_block, slots % plane.rows_per_block]
            if not torch.equal(pages, obj[offset: offset + rows * plane.row_bytes].view(rows, plane.row_bytes)):
                return False
    return True


def run_forward(case: study.Case, wait: bool) -> dict[str, bool]:
    """Scrubbed pages, a sliced load (S=3) on a slowed lane, and the forward: per layer, whether its bytes were in
    the pages when the layer read them."""
    for raw in case.allocations:
        raw.zero_()
    seen: dict[str, bool] = {}
    slices = plan_slices(case.layout, case.announced, 3)
    study.pipelined(case, slices, lambda: None, study.Clock(torch.device("cpu")), wait=wait,
                    reads=lambda index, name: seen.__setitem__(name, layer_landed(case, name)))
    return seen


def test_a_forward_that_waits_reads_every_layers_bytes_and_one_that_does_not_is_caught() -> None:
    with study.open_case(tiny_geometry(), 3, "host") as case:
        assert len(case.announced) == LAYERS
        case.mover.set_backend(Direction.LOAD, Delayed(case.mover.backends[Direction.LOAD], 0.03))
        waited = run_forward(case, wait=True)
        assert waited == {name: True for name in case.announced}
        assert all(layer_landed(case, name) for name in case.announced)
        ahead = run_forward(case, wait=False)  # negative control: the forward does not wait for its slices
        assert not ahead[case.announced[0]] and not all(ahead.values())
        assert all(layer_landed(case, name) for name in case.announced)  # the load itself still lands in full


def test_the_ideal_is_the_longer_of_load_and_compute_plus_the_first_slice() -> None:
    assert study.ideal_seconds(4.0, 2.0, 0.5) == 4.5
    assert study.ideal_seconds(1.0, 3.0, 0.25) == 3.25
    assert study.over_ideal(4.725, 4.5) == pytest.approx(0.05)
    assert study.slowdown([1.1, 1.2, 1.0], [1.0, 0.9, 1.0]) == pytest.approx(0.1)
    assert study.slice_counts(["1", "2", "8", "L"], 6) == [1, 2, 6]


def test_the_sweep_reports_each_ratio_and_slice_count_with_the_issues_arithmetic(tmp_path: Path) -> None:
    settings = study.Settings("host", ratios=(1.0,), counts=("1", "2", "L"), repeats=1, k=16, sizes=(4,))
    rows, stores = study.study_load(tiny_geometry(), 2, settings)
    assert [r.slices for r in rows] == [1, 2, LAYERS]
    for r in rows:
        assert r.ideal == pytest.approx(max(r.t_load, r.t_compute) + r.t_slice0)
        assert r.over_ideal == pytest.approx(r.achieved / r.ideal - 1)
        assert r.serial == pytest.approx(r.t_load + r.t_compute)
        assert r.ideal_copy == pytest.approx(max(r.t_load, r.t_copy) + r.t_slice0)
        assert r.over_copy == pytest.approx(r.achieved / r.ideal_copy - 1)
        assert r.achieved > 0 and r.cold is not None
    assert [s.slices for s in stores] == [1, 2, LAYERS] and all(s.tail >= 0 for s in stores)
    assert len(study.render(rows, stores)) == 2


def test_the_bare_copy_beside_the_forward_moves_every_byte() -> None:
    copy = study.BareCopy(1 << 16, torch.device("cpu"))
    copy.source.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    copy.target.zero_()
    assert not torch.equal(copy.target, copy.source)  # negative control: the check sees bytes that did not move
    copy.start()
    copy.finish()
    assert torch.equal(copy.target, copy.source)
