"""The sliced_timeline study on a real GPU: the profiled run shows every slice's kernel on the load lane's stream,
after its copies, and the forward's matmuls on another stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_npu.tools.bench.studies.sliced_timeline import timeline

from .cuda_marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS

GEOMETRY = Path(__file__).parents[2] / "lmcache_npu/tools/bench/geometries/llama3-8b.json"


@pytest.mark.parametrize("slices", [2, 4])
def test_the_timeline_shows_each_slice_landing_on_the_load_lane(slices: int) -> None:
    result = timeline(GEOMETRY, 1.0, slices, 64.0, 2, 20.0)
    kernels = [s for s in result["load_spans"] if "KvTransferKernel" in s["name"]]
    copies = [s for s in result["load_spans"] if "Memcpy HtoD" in s["name"]]
    assert len(kernels) == slices, "one kernel per slice on the load lane's stream"
    assert copies and copies[0]["start_us"] < kernels[0]["start_us"], "a slice's copies come before its kernel"
    assert len(result["ttft_ms"]) == 2 and all(t > 0 for t in result["ttft_ms"])
    forward = next(s for s in result["streams"] if s["stream"] == result["forward_stream"])
    assert forward["spans"] >= 32, "the forward's matmuls ran on their own stream"
