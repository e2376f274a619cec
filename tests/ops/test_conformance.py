"""Every backend against the independent oracle: bytes, not shapes (DESIGN §4)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.ops import TransferBackend, get_backend

from .oracle import oracle_load, oracle_object_layout, oracle_store, payload_mask
from .strategies import Case, cases

SENTINEL = 0x5A


def run_round_trip(backend: TransferBackend, case: Case,
                   place_objects: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """Store into sentinel-filled objects, compare every byte; load into fresh pages, compare every byte."""
    geometry, slots = case.geometry, case.slots
    plan = geometry.plan()
    _, _, object_bytes = oracle_object_layout(geometry)
    assert plan.object_bytes == object_bytes
    rng = np.random.default_rng(case.seed + 1)
    objects = place_objects(torch.full((case.num_chunks, object_bytes + 64), SENTINEL, dtype=torch.uint8))
    pages_before = [rp.raw.clone() for rp in geometry.raw_planes]
    expected_objects = oracle_store(geometry, slots, objects.cpu().numpy())

    backend.store(plan, slots, objects)

    got = objects.cpu().numpy()
    payload = payload_mask(geometry)
    assert np.array_equal(got[:, :object_bytes][:, payload], expected_objects[:, :object_bytes][:, payload]), \
        "store: object payload bytes differ from the oracle"
    assert (got[:, object_bytes:] == SENTINEL).all(), "store wrote past the end of a chunk object"
    for rp, before in zip(geometry.raw_planes, pages_before):
        assert torch.equal(rp.raw, before), "store wrote to a page"

    for rp in geometry.raw_planes:  # fresh destination pages
        rp.raw.copy_(torch.from_numpy(rng.integers(0, 256, rp.raw.numel(), dtype=np.uint8)))
    expected_pages = oracle_load(geometry, slots, objects.cpu().numpy())
    objects_before = objects.clone()

    backend.load(plan, slots, objects)

    assert torch.equal(objects, objects_before), "load wrote to a chunk object"
    for i, (rp, expected) in enumerate(zip(geometry.raw_planes, expected_pages)):
        assert np.array_equal(rp.raw.cpu().numpy(), expected), f"load: plane {i} bytes differ from the oracle"


@given(case=cases(soc="a2"))
def test_torch_backend_matches_oracle(case: Case) -> None:
    run_round_trip(get_backend("torch"), case)


@given(
    case=cases(soc="a2"),
    cores=st.sampled_from([1, 2, 3, 7, 48]),
    ub=st.sampled_from([256, 1024, 4096, 32768, 196608]),
    order=st.sampled_from(["sequential", "reverse", "shuffled"]),
    soc=st.sampled_from(["a2", "a3"]),
)
def test_emu_a2_matches_oracle(case: Case, cores: int, ub: int, order: str, soc: str) -> None:
    run_round_trip(get_backend("emu", soc=soc, cores=cores, ub_bytes=ub, order=order, seed=case.seed), case)


@given(
    case=cases(soc="310p"),
    cores=st.sampled_from([1, 2, 8]),
    ub=st.sampled_from([256, 2048, 262144]),
    order=st.sampled_from(["sequential", "shuffled"]),
)
def test_emu_310p_matches_oracle(case: Case, cores: int, ub: int, order: str) -> None:
    run_round_trip(get_backend("emu", soc="310p", cores=cores, ub_bytes=ub, order=order, seed=case.seed), case)


@given(case=cases(soc="a2"), threads=st.sampled_from([1, 2, 3, 8]))
def test_host_matches_oracle(case: Case, threads: int) -> None:
    run_round_trip(get_backend("host", threads=threads), case)


@given(case=cases(soc="310p"), threads=st.sampled_from([1, 3]))
def test_host_matches_oracle_on_310p_geometries(case: Case, threads: int) -> None:
    """310P cases carry FRACTAL_NZ pages most often; host memory has no 32 B rule, the geometry is what matters."""
    run_round_trip(get_backend("host", threads=threads), case)


BACKENDS: dict[str, Callable[[], TransferBackend]] = {
    "torch": lambda: get_backend("torch"),
    "host": lambda: get_backend("host"),
    "host-4-threads": lambda: get_backend("host", threads=4),
    "emu-a2": lambda: get_backend("emu", soc="a2", cores=5),
    "emu-310p": lambda: get_backend("emu", soc="310p", cores=3),
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_round_trip_restores_rows_bit_exactly(name: str) -> None:
    from lmcache_npu.ops import GroupSpec

    from .oracle import Geometry, allocate

    g = torch.Generator().manual_seed(7)
    geometry = Geometry(
        [GroupSpec(128), GroupSpec(512, compress_ratio=4), GroupSpec(128, sliding_window=128)],
        [allocate(8, 128, 1152, 0, 0, g),
         allocate(4, 128, 64, 256, 1, g),
         allocate(8, 128, 512, 0, 2, g, dtype=torch.float16)],
        256,
    )
    plan = geometry.plan()
    slots = [np.arange(256).reshape(1, 256) + 128, np.arange(64).reshape(1, 64) + 64, np.arange(128).reshape(1, 128) + 384]
    original = [rp.raw.clone() for rp in geometry.raw_planes]
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    backend = BACKENDS[name]()
    backend.store(plan, slots, objects)
    for rp in geometry.raw_planes:
        rp.raw.zero_()
    backend.load(plan, slots, objects)
    for rp, orig, matrix in zip(geometry.raw_planes, original, slots):
        for slot in matrix.reshape(-1):
            (start, length), = rp.row_offsets(int(slot))
            assert torch.equal(rp.raw[start:start + length], orig[start:start + length])
