"""The hypothesis conformance suite on the NPU backend (pages on the NPU, chunk objects on the NPU and in pinned host
memory), every byte against the independent oracle, as tests/cuda runs it for CUDA. Skipped with a reason elsewhere."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ..ops.strategies import Case, cases
from ..ops.test_conformance import run_round_trip
from .marks import NEEDS_NPU_MODULE, NEEDS_TORCH_NPU

pytestmark = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]
NPU = "npu:0"
PLACEMENT = {
    "host": lambda t: t.pin_memory(),
    "device": lambda t: t.to(NPU),
}


@pytest.fixture(scope="module")
def npu_backend():
    import torch_npu  # noqa: F401  (registers the npu device)

    from lmcache_npu.ops import BackendUnavailable, get_backend

    try:
        return get_backend("npu")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


def _on_npu(case: Case) -> Case:
    for rp in case.geometry.raw_planes:
        rp.raw = rp.raw.to(NPU)
    return case


@settings(max_examples=250)
@given(data=st.data(), placement=st.sampled_from(sorted(PLACEMENT)))
def test_npu_matches_oracle(npu_backend, data: st.DataObject, placement: str) -> None:
    soc = "310p" if npu_backend.soc.name == "310p" else "a2"  # A3 follows A2's rules
    case = data.draw(cases(soc=soc))
    run_round_trip(npu_backend, _on_npu(case), PLACEMENT[placement])
