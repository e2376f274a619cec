"""The page check must see a wrong load: a load that delivers the neighbouring position's rows, or leaves one plane
out, fails the scenario that passes with a correct load (test_layout_presets_served.py)."""

from __future__ import annotations

from typing import Optional

import pytest

from lmcache_npu.ops import ChunkBatch, Direction, TransferStats
from lmcache_npu.ops.transfer_backend import AfterKernel
from lmcache_npu.transfer import mover as mover_module

from ..late_rows import loads_one_token_late
from .conftest import preset_engine, prompt
from .wrappers import Wrapped, wrap

LAYOUTS = [("gpt-oss-120b", "cuda"), ("deepseek-v4-flash", "ascend")]


def _reuse(engine) -> None:
    text = prompt(2 * 256 + 40, seed=41)
    engine.add(text, max_tokens=2, request_id="a")
    engine.run()
    engine.add(text + [3, 4, 5], max_tokens=2, request_id="b")
    engine.run()


class SkipsPlane(Wrapped):
    """A load that writes every plane but one: that plane's target rows keep their old bytes."""

    def __init__(self, inner, plane: int) -> None:
        super().__init__(inner)
        self.plane = plane

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        from lmcache_npu.ops.torch_backend import row_view

        plane = batch.plan.moved_planes[self.plane]
        slots = batch.slots[plane.group].reshape(-1)
        slots = slots[slots >= 0]
        view = row_view(plane)
        blocks, within = slots // plane.rows_per_block, slots % plane.rows_per_block
        before = view[blocks, within].clone()
        stats = super().transfer(batch, after_kernel)
        view[blocks, within] = before
        return stats


@pytest.mark.parametrize("preset,family", LAYOUTS)
def test_a_load_of_the_neighbouring_rows_is_caught(make_engine, monkeypatch, preset, family):
    monkeypatch.setattr(mover_module.KVMover, "_cut_runs", loads_one_token_late(mover_module.KVMover._cut_runs))
    engine = preset_engine(make_engine, preset, family)
    with pytest.raises(AssertionError, match="differ from the model's bytes"):
        _reuse(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS)
def test_a_load_that_leaves_one_plane_out_is_caught(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family)
    last = len(engine.workers[0].worker_half.layout.plan.moved_planes) - 1
    wrap(engine, lambda b: SkipsPlane(b, last), Direction.LOAD)
    name = engine.workers[0].worker_half.layout.plan.moved_planes[last].name
    with pytest.raises(AssertionError, match=f"plane {name} rows"):
        _reuse(engine)


@pytest.mark.parametrize("preset,family", LAYOUTS)
def test_the_same_scenario_passes_with_correct_loads(make_engine, preset, family):
    engine = preset_engine(make_engine, preset, family)
    _reuse(engine)
    assert engine.loaded_tokens["b"] == 512
