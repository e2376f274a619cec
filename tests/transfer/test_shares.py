"""The share arithmetic of replicated KV (`ShareLayout`): shares are disjoint, cover the replicated tail exactly,
and a pack / gather / place round trip gives back every byte of the full object."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops.plan import OBJECT_ALIGN_BYTES
from lmcache_npu.transfer.shares import ShareLayout

objects = st.tuples(st.integers(0, 2000), st.integers(0, 4000)).map(
    lambda t: (t[0] * OBJECT_ALIGN_BYTES, t[0] * OBJECT_ALIGN_BYTES + t[1]))


@settings(max_examples=200, deadline=None)
@given(objects, st.integers(1, 16))
def test_shares_are_disjoint_and_cover_the_tail(sizes: tuple[int, int], size: int) -> None:
    own, full = sizes
    layouts = [ShareLayout(full, own, r, size) for r in range(size)]
    covered = []
    for r, layout in enumerate(layouts):
        begin, end = layout.share_range(r)
        assert own <= begin <= end <= full
        assert end - begin <= layout.share_bytes
        covered.extend(range(begin, end))
    assert covered == list(range(own, full))  # in rank order, each byte once
    assert len({layout.object_bytes for layout in layouts}) == 1  # one slot size for every rank
    assert layouts[0].share_bytes % OBJECT_ALIGN_BYTES == 0
    assert layouts[0].object_bytes <= own + (full - own) // size + OBJECT_ALIGN_BYTES


@settings(max_examples=100, deadline=None)
@given(objects, st.integers(1, 8), st.randoms(use_true_random=False))
def test_pack_gather_place_round_trip(sizes: tuple[int, int], size: int, rng) -> None:
    own, full_bytes = sizes
    full = torch.tensor([rng.randrange(256) for _ in range(full_bytes)], dtype=torch.uint8)
    layouts = [ShareLayout(full_bytes, own, r, size) for r in range(size)]
    stored = []
    for layout in layouts:
        obj = torch.full((layout.object_bytes,), 0xEE, dtype=torch.uint8)  # stale bytes a pack must overwrite
        layout.pack(full, obj)
        stored.append(obj)
        begin, end = layout.share_range(layout.rank)
        assert torch.equal(obj[own:own + end - begin], full[begin:end])
        assert not obj[own + end - begin:].any()  # the padding is zeros, never a previous chunk's bytes
    gathered = torch.cat([layout.share_of(obj) for layout, obj in zip(layouts, stored)])
    rebuilt = torch.zeros(1, full_bytes, dtype=torch.uint8)
    layouts[-1].assemble([stored[-1]], gathered, rebuilt)
    assert torch.equal(rebuilt[0], full)
    if full_bytes > own:  # negative control: one wrong byte in one share is a wrong byte in the rebuilt object
        gathered[0] ^= 0xFF
        layouts[-1].assemble([stored[-1]], gathered, rebuilt)
        assert not torch.equal(rebuilt[0], full)


def test_nothing_replicated_shares_nothing() -> None:
    layout = ShareLayout(640, 640, 1, 4)
    assert layout.share_bytes == 0 and layout.object_bytes == 640
    assert layout.share_range(3) == (640, 640)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(full_bytes=128, replicated_offset=0, rank=2, size=2), "rank 2 is outside a group of 2"),
    (dict(full_bytes=128, replicated_offset=0, rank=0, size=0), "group size must be >= 1"),
    (dict(full_bytes=128, replicated_offset=192, rank=0, size=2), "must lie in the object"),
    (dict(full_bytes=128, replicated_offset=32, rank=0, size=2), "not a multiple of 64"),
])
def test_bad_layouts_name_the_rule(kwargs: dict, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        ShareLayout(**kwargs)


def test_fingerprint_names_the_split_not_the_rank() -> None:
    base = b"\x01" * 16
    a, b = ShareLayout(1024, 0, 0, 2), ShareLayout(1024, 0, 1, 2)
    assert a.fingerprint(base) == b.fingerprint(base)
    assert a.fingerprint(base) != ShareLayout(1024, 0, 0, 4).fingerprint(base)
    assert a.fingerprint(base) != a.fingerprint(b"\x02" * 16)


@settings(max_examples=50, deadline=None)
@given(objects, st.integers(2, 6), st.integers(2, 5), st.randoms(use_true_random=False))
def test_assemble_takes_rank_major_shares_of_several_chunks(sizes: tuple[int, int], size: int, count: int,
                                                            rng) -> None:
    own, full_bytes = sizes
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    fulls = torch.randint(0, 256, (count, full_bytes), dtype=torch.uint8, generator=gen)
    layouts = [ShareLayout(full_bytes, own, r, size) for r in range(size)]
    stored = [[torch.empty(layout.object_bytes, dtype=torch.uint8) for _ in range(count)] for layout in layouts]
    for layout, objs in zip(layouts, stored):
        for full, obj in zip(fulls, objs):
            layout.pack(full, obj)
    # what the all-gather returns: rank 0's shares of every chunk, then rank 1's, ...
    gathered = torch.cat([layout.share_of(obj) for layout, objs in zip(layouts, stored) for obj in objs])
    for layout, objs in zip(layouts, stored):
        rebuilt = torch.zeros(count, full_bytes, dtype=torch.uint8)
        layout.assemble(objs, gathered, rebuilt)
        assert torch.equal(rebuilt, fulls)
    if full_bytes > own and layouts[0].share_bytes and fulls[0, own:].ne(fulls[1, own:]).any():
        # negative control: chunk-major shares (the wrong order) do not rebuild the objects
        chunk_major = torch.cat([layout.share_of(objs[c]) for c in range(count) for layout, objs in zip(layouts, stored)])
        rebuilt = torch.zeros(count, full_bytes, dtype=torch.uint8)
        layouts[0].assemble(stored[0], chunk_major, rebuilt)
        assert not torch.equal(rebuilt, fulls)


def test_assemble_refuses_short_buffers() -> None:
    layout = ShareLayout(4096, 1024, 0, 2)
    stored = [torch.zeros(layout.object_bytes, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="gathered"):
        layout.assemble(stored, torch.zeros(10, dtype=torch.uint8), torch.zeros(1, 4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="full objects of shape"):
        layout.assemble(stored, torch.zeros(2 * layout.share_bytes, dtype=torch.uint8),
                        torch.zeros(2, 4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="stored object"):
        layout.assemble([stored[0][:10]], torch.zeros(2 * layout.share_bytes, dtype=torch.uint8),
                        torch.zeros(1, 4096, dtype=torch.uint8))
