"""Hard cases the general strategy cannot reach cheaply: runs longer than the DMA count limit (4095), plane offsets
past 4 GiB (a sparse allocation: only touched pages cost memory), and several planes interleaved in one allocation
at page offsets (DeepSeek-V4 / DSA). Each compares every byte with the oracle and has a negative control."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import GroupSpec, get_backend

from .oracle import Geometry, RawPlane, oracle_load, oracle_store

BACKENDS = {
    "torch": lambda: get_backend("torch"),
    "host": lambda: get_backend("host"),
    "host-3-threads": lambda: get_backend("host", threads=3),
    "emu-a2": lambda: get_backend("emu", soc="a2", cores=3, ub_bytes=196608),
    "emu-a2-small-ub": lambda: get_backend("emu", soc="a2", cores=2, ub_bytes=4096),
    "emu-310p": lambda: get_backend("emu", soc="310p", cores=2, ub_bytes=262144),
}


def _rows(rp: RawPlane, slots: np.ndarray) -> list[tuple[int, int]]:
    return [piece for slot in slots.reshape(-1) if slot >= 0 for piece in rp.row_offsets(int(slot))]


def _round_trip(backend_name: str, geometry: Geometry, slots: list[np.ndarray], chunks: int,
                corrupt: str = "") -> None:
    """Store, compare objects with the oracle; zero the rows, load, compare the rows (and a guard band around every
    row) with what was stored. Only the rows and their bands are read: a sparse allocation stays sparse."""
    backend = BACKENDS[backend_name]()
    plan = geometry.plan()
    objects = torch.full((chunks, plan.object_bytes), 0x5A, dtype=torch.uint8)
    backend.store(plan, slots, objects)
    expected = oracle_store(geometry, slots, np.full((chunks, plan.object_bytes), 0x5A, dtype=np.uint8))
    assert np.array_equal(objects.numpy(), expected), "store: objects differ from the oracle"
    rows = {id(rp): _rows(rp, slots[rp.group]) for rp in geometry.raw_planes}
    before = {}
    for rp in geometry.raw_planes:
        for start, length in rows[id(rp)]:
            before[(id(rp.raw), start)] = rp.raw[start:start + length].clone()
            rp.raw[start:start + length] = 0
    raws = {id(rp.raw): rp.raw for rp in geometry.raw_planes}
    bands = {key: _bands([r for rp in geometry.raw_planes if id(rp.raw) == key for r in rows[id(rp)]], raws[key])
             for key in raws}
    guards = {(key, lo): raws[key][lo:hi].clone() for key, spans in bands.items() for lo, hi in spans}
    backend.load(plan, slots, objects)
    if corrupt == "row":
        rp = geometry.raw_planes[-1]
        start, _ = rows[id(rp)][-1]
        rp.raw[start] ^= 0xFF
    elif corrupt == "band":
        key, lo = next(iter(guards))
        raws[key][lo] ^= 0xFF
    for rp in geometry.raw_planes:
        for start, length in rows[id(rp)]:
            assert torch.equal(rp.raw[start:start + length], before[(id(rp.raw), start)]), \
                f"load: the row at byte {start} differs"
    for (key, lo), band in guards.items():
        assert torch.equal(raws[key][lo:lo + band.numel()], band), f"load wrote outside the rows at byte {lo}"


def _bands(pieces: list[tuple[int, int]], raw: torch.Tensor, width: int = 64) -> list[tuple[int, int]]:
    """Up to `width` bytes on each side of every maximal stretch of row bytes: a load must leave them alone."""
    merged: list[list[int]] = []
    for start, length in sorted(pieces):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length)
        else:
            merged.append([start, start + length])
    spans = []
    for i, (lo, hi) in enumerate(merged):
        left = max(0, lo - width, merged[i - 1][1] if i else 0)
        right = min(raw.numel(), hi + width, merged[i + 1][0] if i + 1 < len(merged) else raw.numel())
        spans += [(left, lo), (hi, right)]
    return [(lo, hi) for lo, hi in spans if hi > lo]

@settings(max_examples=12)
@given(row_bytes=st.sampled_from([1, 2, 3, 32, 132]), backend=st.sampled_from(sorted(BACKENDS)),
       start=st.sampled_from([0, 1, 4095]))
def test_runs_longer_than_the_dma_count_limit(row_bytes: int, backend: str, start: int) -> None:
    if backend == "emu-310p" and row_bytes % 32:
        row_bytes = 32  # 310P has no DataCopyPad: whole 32 B rows only
    rows_per_block, chunk_tokens = 8192, 4096 + 512
    generator = torch.Generator().manual_seed(row_bytes + start)
    raw = torch.randint(0, 256, (2 * rows_per_block * row_bytes + 256,), dtype=torch.uint8, generator=generator)
    rp = RawPlane(raw, 128, 2, rows_per_block, row_bytes, rows_per_block * row_bytes, 0)
    geometry = Geometry([GroupSpec(rows_per_block)], [rp], chunk_tokens)
    slots = [np.arange(chunk_tokens).reshape(1, chunk_tokens) + start]  # one run of 4608 rows in one block
    _round_trip(backend, geometry, slots, 1)


def _sparse_geometry(row_bytes: int) -> tuple[Geometry, list[np.ndarray]]:
    """Block 2 of a plane with a 2.25 GiB block stride starts past 4.5 GiB: 64-bit offsets everywhere."""
    rows_per_block, stride, num_blocks = 64, (9 << 30) // 4, 3
    raw = torch.empty(128 + (num_blocks - 1) * stride + rows_per_block * row_bytes + 128, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(row_bytes)
    for b in range(num_blocks):  # only the blocks are touched: the rest stays unmapped
        lo = 128 + b * stride - 64
        raw[lo: lo + rows_per_block * row_bytes + 128] = torch.randint(
            0, 256, (rows_per_block * row_bytes + 128,), dtype=torch.uint8, generator=generator)
    rp = RawPlane(raw, 128, num_blocks, rows_per_block, row_bytes, stride, 0)
    slots = np.concatenate([np.arange(64) + 128, np.arange(64) + 64]).reshape(2, 64)  # block 2, then block 1
    return Geometry([GroupSpec(rows_per_block)], [rp], 64), [slots]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_plane_offsets_past_4_gib(backend: str) -> None:
    geometry, slots = _sparse_geometry(32 if backend == "emu-310p" else 132)
    _round_trip(backend, geometry, slots, 2)


def test_negative_control_a_wrong_byte_past_4_gib_is_seen() -> None:
    geometry, slots = _sparse_geometry(132)
    with pytest.raises(AssertionError, match="differs"):
        _round_trip("emu-a2", geometry, slots, 2, corrupt="row")
    with pytest.raises(AssertionError, match="outside the rows"):
        _round_trip("emu-a2", *_sparse_geometry(132), 2, corrupt="band")


def _interleaved_geometry(seed: int, row_bytes: tuple[int, int], page_pad: int) -> tuple[Geometry, list[np.ndarray]]:
    """Two planes in one allocation: block b holds plane A's rows, `page_pad` bytes, then plane B's rows."""
    rows_per_block, num_blocks = 16, 6
    a_bytes, b_bytes = rows_per_block * row_bytes[0], rows_per_block * row_bytes[1]
    stride = a_bytes + page_pad + b_bytes
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (128 + num_blocks * stride + 128,), dtype=torch.uint8, generator=generator)
    planes = [RawPlane(raw, 128, num_blocks, rows_per_block, row_bytes[0], stride, 0),
              RawPlane(raw, 128 + a_bytes + page_pad, num_blocks, rows_per_block, row_bytes[1], stride, 0)]
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_blocks)[:4]
    slots = (table.reshape(-1, 1) * rows_per_block + np.arange(rows_per_block)).reshape(2, 32)
    slots[rng.random(slots.shape) < 0.2] = -1
    return Geometry([GroupSpec(rows_per_block)], planes, 32), [slots]


@settings(max_examples=20)
@given(seed=st.integers(0, 2**16), row_bytes=st.sampled_from([(576, 64), (132, 4), (1, 3), (512, 32), (64, 2)]),
       page_pad=st.sampled_from([0, 13, 64]), backend=st.sampled_from(sorted(BACKENDS)))
def test_planes_interleaved_in_one_allocation(seed: int, row_bytes: tuple[int, int], page_pad: int,
                                              backend: str) -> None:
    if backend == "emu-310p":
        row_bytes = (512, 32)
    geometry, slots = _interleaved_geometry(seed, row_bytes, page_pad)
    _round_trip(backend, geometry, slots, 2)


def test_negative_control_a_wrong_byte_in_a_shared_allocation_is_seen() -> None:
    geometry, slots = _interleaved_geometry(3, (576, 64), 13)
    with pytest.raises(AssertionError, match="differs"):
        _round_trip("emu-a2", geometry, slots, 2, corrupt="row")


def test_the_oracle_agrees_on_a_shared_allocation() -> None:
    """The per-plane oracle load, merged over the planes' own rows, is what the backends produced above."""
    geometry, slots = _interleaved_geometry(5, (132, 4), 13)
    plan = geometry.plan()
    objects = np.random.default_rng(5).integers(0, 256, (2, plan.object_bytes), dtype=np.uint8)
    per_plane = oracle_load(geometry, slots, objects)
    backend = BACKENDS["emu-a2"]()
    backend.load(plan, slots, torch.from_numpy(objects.copy()))
    got = geometry.raw_planes[0].raw.numpy()
    for rp, want in zip(geometry.raw_planes, per_plane):
        for start, length in _rows(rp, slots[0]):
            assert np.array_equal(got[start:start + length], want[start:start + length])
