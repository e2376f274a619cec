"""A preset exported as a --geometry file materialises to the same plan: every plane's shape, group and object
offset, the object size, so a machine without vLLM benchmarks the same chunks."""

from __future__ import annotations

import json

import pytest
import torch

from lmcache_npu.tools.bench.geometry import geometry_from_dict, geometry_of_plan, materialize

pytest.importorskip("vllm", reason="presets are built from vLLM's spec classes")


@pytest.mark.parametrize("preset", ["llama3-8b", "deepseek-v4-flash", "llama3-8b-310p", "qwen3-next-80b"])
def test_an_exported_preset_materialises_to_the_same_plan(preset: str) -> None:
    from lmcache_npu.tools.bench.presets import materialize_preset

    m, _, _ = materialize_preset(preset, 1, torch.device("cpu"))
    geometry = geometry_from_dict(json.loads(json.dumps(geometry_of_plan(m.plan, preset).to_dict())), preset)
    again = materialize(geometry, 2, torch.device("cpu")).plan

    def shape(plan):  # everything but addresses and block counts
        fields = ["row_bytes", "rows_per_block", "block_stride_bytes", "object_offset_bytes", "group_index",
                  "layout", "nz_unit_bytes"]
        return [tuple(int(row[f]) for f in fields) for row in plan.plane_table]

    assert again.object_bytes == m.plan.object_bytes
    assert shape(again) == shape(m.plan)
    assert [(g.tokens_per_block, g.compress_ratio, g.sliding_window, g.skip) for g in again.groups] == \
        [(g.tokens_per_block, g.compress_ratio, g.sliding_window, g.skip) for g in m.plan.groups]
    doubled = 2 * again.chunk_tokens
    assert shape(again) != shape(materialize(geometry_of_plan(again, "x"), 2, torch.device("cpu"), chunk_tokens=doubled)
                                 .plan), "the comparison notices a different chunk size"
