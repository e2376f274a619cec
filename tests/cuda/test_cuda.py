"""The conformance suite on the CUDA backend (marker cuda); skipped with a reason without a GPU."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import get_backend

from ..ops.oracle import Geometry, allocate
from ..ops.strategies import Case, cases
from ..ops.test_conformance import run_round_trip
from .cuda_marks import CUDA_KERNELS

pytestmark = CUDA_KERNELS

PLACEMENT = {
    "mapped": lambda t: t.pin_memory(),
    "staging": lambda t: t.pin_memory(),
    "device": lambda t: t.cuda(),
}


def to_cuda(case: Case) -> Case:
    for rp in case.geometry.raw_planes:
        rp.raw = rp.raw.cuda()
    return case


# Slicing small enough that the strategy's small objects pipeline over several slices and many pieces.
SLICING = st.fixed_dictionaries({
    "piece_bytes": st.sampled_from([0, 1, 100, 4096, 64 << 10]),
    "store_first_slice_bytes": st.sampled_from([64, 1000, 1 << 20]),
    "store_slice_growth": st.sampled_from([2, 4, 1 << 30]),
    "load_tail_bytes": st.sampled_from([0, 100, 2 << 20]),
    "load_tail_share": st.sampled_from([2, 3, 12]),
    "store_mapped_prefix_share": st.sampled_from([0, 2, 24]),
    "load_mapped_prefix_share": st.sampled_from([0, 2, 24]),
})


@settings(max_examples=250, deadline=None)
@given(case=cases(soc="a2"), path=st.sampled_from(sorted(PLACEMENT)), blocks=st.sampled_from([None, 1, 3, 1000]),
       threads=st.sampled_from([32, 256, 1024]), pipeline=st.booleans(), slicing=SLICING)
def test_cuda_matches_oracle(case: Case, path: str, blocks, threads: int, pipeline: bool, slicing: dict) -> None:
    backend = get_backend("cuda", path="mapped" if path == "device" else path, blocks=blocks, threads=threads,
                          pipeline=pipeline, **slicing)
    run_round_trip(backend, to_cuda(case), PLACEMENT[path])


@settings(max_examples=50, deadline=None)
@given(case=cases(soc="310p"))
def test_cuda_fractal_nz_matches_oracle(case: Case) -> None:
    run_round_trip(get_backend("cuda", path="staging"), to_cuda(case), PLACEMENT["staging"])


def test_transfer_on_side_stream_sees_only_what_the_event_orders() -> None:
    g = torch.Generator().manual_seed(11)
    geometry = Geometry([__import__("lmcache_npu.ops", fromlist=["GroupSpec"]).GroupSpec(128)],
                        [allocate(64, 128, 4096, 0, 0, g)], 256)
    raw = geometry.raw_planes[0]
    raw.raw = torch.zeros_like(raw.raw).cuda()
    plan = geometry.plan()
    slots = [np.arange(256 * 8).reshape(8, 256)]
    objects = torch.zeros((8, plan.object_bytes), dtype=torch.uint8).pin_memory()
    backend = get_backend("cuda", path="mapped")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    written = torch.cuda.Event()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the store would see zeros if it did not wait
        raw.raw.fill_(0x3C)
        written.record(producer)
    with torch.cuda.stream(consumer):
        consumer.wait_event(written)
        backend.store(plan, slots, objects)
    assert bool((objects == 0x3C).all())


def test_exactly_one_launch_per_direction() -> None:
    pytest.importorskip("vllm", reason="the deepseek-v4-flash preset is built from vLLM's spec classes")
    from lmcache_npu.tools.bench.runner import run_bench

    report = run_bench("deepseek-v4-flash", "cuda", chunks=2, check=True, progress=False)
    assert report.check == "ok"
    assert [r.launches for r in report.rows] == [1, 1]
