"""The hypothesis conformance suite on the NPU backend (pages on the NPU, chunk objects on the NPU and in pinned host
memory), every byte against the independent oracle, as tests/cuda runs it for CUDA. Skipped with a reason elsewhere."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ..ops.strategies import Case, cases
from ..ops.test_conformance import run_round_trip
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU, select_device, skip_or_fail

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]
NPU = "npu:0"
PLACEMENT = {
    "host": lambda t: t.pin_memory(),
    "device": lambda t: t.to(NPU),
}


def _warm_up(backend) -> None:
    """One transfer before the first example (finding T3): the kernel binary's lazy load, the first device op and
    the first pinned allocation land here, not in an example's time."""
    import torch

    from lmcache_npu.ops import GroupSpec
    from lmcache_npu.ops.transfer_backend import warm_up

    from ..ops.oracle import Geometry, allocate

    plane = allocate(4, 16, 64, 0, 0, torch.Generator().manual_seed(1))  # 64 B rows: legal on A2/A3 and 310P
    plane.raw = plane.raw.to(NPU)
    warm_up(backend, Geometry([GroupSpec(16)], [plane], 32).plan())


@pytest.fixture(scope="module")
def npu_backend():
    import torch_npu  # noqa: F401  (registers the npu device)

    from lmcache_npu.ops import BackendUnavailable, get_backend

    select_device(0)
    try:
        backend = get_backend("npu")
    except BackendUnavailable as exc:
        skip_or_fail(str(exc))
    _warm_up(backend)
    return backend


def _on_npu(case: Case) -> Case:
    for rp in case.geometry.raw_planes:
        rp.raw = rp.raw.to(NPU)
    return case


@settings(max_examples=250, deadline=None)  # an example's time on a card is not a property (finding T3)
@given(data=st.data(), placement=st.sampled_from(sorted(PLACEMENT)))
def test_npu_matches_oracle(npu_backend, data: st.DataObject, placement: str) -> None:
    soc = "310p" if npu_backend.soc.name == "310p" else "a2"  # A3 follows A2's rules
    case = data.draw(cases(soc=soc))
    run_round_trip(npu_backend, _on_npu(case), PLACEMENT[placement])
