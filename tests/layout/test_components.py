"""Every register_kv_caches payload form becomes byte components that address exactly the right bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.layout import collect_components, layer_components
from lmcache_npu.layout.components import KVPacking, drop_covering_views
from lmcache_npu.ops import GroupSpec, PageLayout, Plane, TransferPlan, get_backend

NB, BS = 6, 16


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def row_bytes_of(component, block: int, row: int) -> bytes:
    rb = component.row_bytes
    return component.pages[block, row * rb:(row + 1) * rb].numpy().tobytes()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_cuda_flash_interleaved_kv() -> None:
    cache = randn(NB, 2, BS, 4, 32)
    k, v = layer_components("l0", cache, BS)
    assert (k.rows_per_block, k.row_bytes, k.block_stride_bytes) == (BS, 4 * 32 * 2, 2 * BS * 4 * 32 * 2)
    assert row_bytes_of(k, 3, 5) == as_bytes(cache[3, 0, 5]) and row_bytes_of(v, 3, 5) == as_bytes(cache[3, 1, 5])


def test_head_major_strides_become_one_component_per_head() -> None:
    physical = randn(NB, 2, 4, BS, 32)  # HND flash: [nb, 2, H, bs, d] in memory, [nb, 2, bs, H, d] as vLLM views it
    cache = physical.permute(0, 1, 3, 2, 4)
    comps = layer_components("l0", cache, BS)
    assert [c.role for c in comps] == [f"{kv}.h{h}" for kv in "kv" for h in range(4)]
    assert all((c.rows_per_block, c.row_bytes) == (BS, 32 * 2) for c in comps)
    v_head2 = comps[4 + 2]
    assert row_bytes_of(v_head2, 3, 5) == as_bytes(cache[3, 1, 5, 2]) == as_bytes(physical[3, 1, 2, 5])


def test_cpu_attention_rows_are_k_then_v_per_block_and_head() -> None:
    heads, head_size = 3, 16
    cache = randn(NB, heads, BS, 2 * head_size)
    # the CPU backend's own reading: [nb, H, 2*bs, D], K the first bs rows, V the next bs
    key_cache, value_cache = cache.view(NB, heads, 2 * BS, head_size).chunk(2, dim=2)
    comps = layer_components("l0", cache, BS, packing=KVPacking.CPU_ATTENTION)
    assert [c.role for c in comps] == [f"{kv}{h}" for h in range(heads) for kv in "kv"]
    for h in range(heads):
        k, v = comps[2 * h], comps[2 * h + 1]
        assert (k.row_bytes, k.block_stride_bytes) == (head_size * 2, heads * 2 * BS * head_size * 2)
        for block, row in ((0, 0), (4, 15), (5, 7)):
            assert row_bytes_of(k, block, row) == as_bytes(key_cache[block, h, row])
            assert row_bytes_of(v, block, row) == as_bytes(value_cache[block, h, row])
    assert row_bytes_of(comps[0], 2, 1) != as_bytes(cache[2, 0, 1, :head_size])  # row 1 is not cache[.., 1, :D]
    with pytest.raises(ValueError, match=r"layer l0: the CPU attention backend's cache is \[num_blocks, kv_heads, "
                                         r"16, 2 \* head_size\]"):
        layer_components("l0", randn(NB, BS, 4, 32), BS, packing=KVPacking.CPU_ATTENTION)


def test_head_major_views_have_a_component_per_head() -> None:
    mla = randn(NB, 1, BS, 72)  # vLLM >= 0.29 CPU MLA: [B, 1, N, C]
    (c,) = layer_components("mla", mla, BS, packing=KVPacking.HEAD_MAJOR)
    assert c.row_bytes == 144 and row_bytes_of(c, 4, 3) == as_bytes(mla[4, 0, 3])
    two = randn(NB, 2, BS, 8)
    comps = layer_components("x", two, BS, packing=KVPacking.HEAD_MAJOR)
    assert [c.role for c in comps] == ["h0", "h1"] and row_bytes_of(comps[1], 5, 9) == as_bytes(two[5, 1, 9])


def test_cuda_kv_first_layout_and_mla() -> None:
    cache = randn(2, NB, BS, 2, 64)
    k, v = layer_components("l0", cache, BS)
    assert row_bytes_of(v, 4, 15) == as_bytes(cache[1, 4, 15])
    mla = randn(NB, BS, 576, dtype=torch.uint8)  # fp8 stored as bytes
    (c,) = layer_components("mla", mla, BS)
    assert c.row_bytes == 576 and row_bytes_of(c, 5, 1) == as_bytes(mla[5, 1])


def test_ascend_split_kv_mla_and_dsa_c8_with_shared_page() -> None:
    k, v = randn(NB, BS, 8, 128), randn(NB, BS, 8, 128)
    comps = layer_components("dense", (k, v), BS)
    assert [c.index for c in comps] == [0, 1] and row_bytes_of(comps[1], 2, 3) == as_bytes(v[2, 3])
    # DSA-C8: int8 indexer K then fp16 scale inside one padded page of a shared int8 allocation
    page = BS * (128 + 2) + 64
    raw = randn(NB * page, dtype=torch.int8)
    indexer = torch.as_strided(raw, (NB, BS, 1, 128), (page, 128, 128, 1))
    scale = torch.as_strided(raw.view(torch.float16), (NB, BS, 1, 1), (page // 2, 1, 1, 1), BS * 128 // 2)
    nope, rope = randn(NB, BS, 1, 512), randn(NB, BS, 1, 64)
    comps = layer_components("dsa", (nope, rope, indexer, scale), BS)
    assert [c.row_bytes for c in comps] == [1024, 128, 128, 2]
    assert comps[2].block_stride_bytes == page and comps[3].block_stride_bytes == page
    assert row_bytes_of(comps[3], 4, 7) == as_bytes(scale[4, 7])
    assert row_bytes_of(comps[2], 5, 15) == as_bytes(indexer[5, 15])


def test_deepseek_v4_views_are_deduplicated_by_memory() -> None:
    page = 2 * BS * 1024  # padded page of the shared raw tensor
    raw = randn(NB * page, dtype=torch.int8)
    swa = torch.as_strided(raw.view(torch.bfloat16), (NB, BS, 1, 512), (page // 2, 512, 512, 1))
    other = torch.as_strided(raw.view(torch.bfloat16), (NB, BS, 1, 512), (page // 2, 512, 512, 1), BS * 512)
    comps = collect_components({"layers.0.swa": [swa], "layers.1.swa": [swa], "layers.2.swa": [other]},
                               {"layers.0.swa": BS, "layers.1.swa": BS, "layers.2.swa": BS})
    assert len(comps) == 2
    assert comps[0].layers == ["layers.0.swa", "layers.1.swa"] and comps[1].layers == ["layers.2.swa"]
    assert comps[0].block_stride_bytes == page
    assert row_bytes_of(comps[1], 3, 2) == as_bytes(other[3, 2])


def test_mamba_states_are_one_row_per_block() -> None:
    conv, ssm = randn(NB, 3, 1024), randn(NB, 16, 64, 32, dtype=torch.float32)
    comps = layer_components("gdn", [conv, ssm], 1)
    assert [(c.rows_per_block, c.row_bytes) for c in comps] == [(1, 3 * 1024 * 2), (1, 16 * 64 * 32 * 4)]
    assert row_bytes_of(comps[1], 4, 0) == as_bytes(ssm[4])


def test_kernel_block_split_is_merged_into_logical_blocks() -> None:
    cache = randn(NB * 2, BS // 2, 4, 32)  # kernel blocks of 8 rows, two per logical block of 16
    (c,) = layer_components("l0", (cache,), BS)
    assert (c.num_blocks, c.rows_per_block) == (NB, BS)
    assert row_bytes_of(c, 2, 11) == as_bytes(cache[5, 3])  # logical block 2, row 11 = kernel block 5, row 3


def test_310p_fractal_nz() -> None:
    heads_dim = 4 * 64
    k = randn(NB, heads_dim // 16, BS, 16, dtype=torch.float16)
    (c,) = layer_components("k", (k,), BS, fractal_nz=True)
    assert (c.layout, c.nz_unit_bytes, c.row_bytes) == (PageLayout.FRACTAL_NZ, 32, heads_dim * 2)
    # row 9 of block 3 is column-major across the NZ units
    expected = b"".join(as_bytes(k[3, j, 9]) for j in range(heads_dim // 16))
    plan = TransferPlan([GroupSpec(BS)], [Plane(c.pages, 0, BS, c.row_bytes, c.layout, c.nz_unit_bytes,
                                                torch.float16)], chunk_tokens=BS)
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    get_backend("emu", soc="310p").store(plan, [np.arange(3 * BS, 4 * BS).reshape(1, BS)], objects)
    assert objects[0, 9 * c.row_bytes:10 * c.row_bytes].numpy().tobytes() == expected


@pytest.mark.parametrize(
    "value,rows,message",
    [
        (randn(NB, 32, BS).transpose(1, 2), BS, "rows inside a block must be contiguous"),
        (randn(NB, 4, 32, BS).permute(0, 3, 1, 2), BS, "rows inside a block must be contiguous"),
        (randn(NB, 12, 4, 32), BS, "12 rows per block does not match the group's 16"),
        ("not a tensor", BS, "expected a Tensor or a tuple/list of Tensors"),
    ],
)
def test_bad_payloads_name_the_layer_and_rule(value, rows: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layer_components("layers.7.attn", value, rows)


def test_layers_without_a_spec_are_refused() -> None:
    with pytest.raises(ValueError, match=r"layers \['extra'\] have KV tensors but no KV-cache spec"):
        collect_components({"extra": randn(NB, BS, 64)}, {})


def test_components_round_trip_through_the_kernel() -> None:
    """Split K/V + MLA + DSA shared page, stored by the emulated A2 kernel: object rows equal tensor rows."""
    page = BS * (128 + 2)
    raw = randn(NB * page, dtype=torch.int8)
    indexer = torch.as_strided(raw, (NB, BS, 1, 128), (page, 128, 128, 1))
    scale = torch.as_strided(raw.view(torch.float16), (NB, BS, 1, 1), (page // 2, 1, 1, 1), BS * 128 // 2)
    comps = layer_components("dsa", (randn(NB, BS, 1, 512), randn(NB, BS, 1, 64), indexer, scale), BS)
    plan = TransferPlan([GroupSpec(BS)], [Plane(c.pages, 0, c.rows_per_block, c.row_bytes, dtype=c.dtype)
                                          for c in comps], chunk_tokens=BS)
    slots = np.arange(2 * BS, 3 * BS).reshape(1, BS)
    objects = torch.zeros(1, plan.object_bytes, dtype=torch.uint8)
    get_backend("emu").store(plan, [slots], objects)
    for c, offset in zip(plan.moved_planes, plan.object_offsets):
        segment = objects[0, offset: offset + BS * c.row_bytes].numpy().tobytes()
        assert segment == c.pages[2].numpy().tobytes()
    assert objects[0, plan.object_offsets[3]: plan.object_offsets[3] + 2].numpy().tobytes() == as_bytes(scale[2, 0])


def _indexer_views(nb: int, rows: int, key_dim: int, scale_bytes: int, pad: int
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vllm-ascend's A5 indexer page: fp8 keys, fp32 scales after them, and a full fp8 view over both from 0."""
    page = rows * (key_dim + scale_bytes) + pad
    raw = torch.randint(-128, 128, (nb * page,), dtype=torch.int8, generator=torch.Generator().manual_seed(page))
    fp8, fp32 = torch.float8_e4m3fn, torch.float32
    key = torch.as_strided(raw.view(fp8), (nb, rows, 1, key_dim), (page, key_dim, key_dim, 1))
    scale = torch.as_strided(raw.view(fp32), (nb, rows, 1, scale_bytes // 4), (page // 4, scale_bytes // 4, 1, 1),
                             rows * key_dim // 4)
    full = torch.as_strided(raw.view(fp8), (nb, rows, 1, key_dim + scale_bytes),
                            (page, key_dim + scale_bytes, key_dim + scale_bytes, 1))
    return raw, [key, scale, full]


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(2, 5), rows=st.sampled_from([4, 8, 16, 128]), key_dim=st.sampled_from([32, 64, 128]),
       scale_words=st.integers(1, 2), pad=st.sampled_from([0, 64, 512]))
def test_a_view_over_other_views_is_stored_once(nb: int, rows: int, key_dim: int, scale_words: int, pad: int) -> None:
    """The full view is dropped, keys and scales stay; a round trip through them restores every byte the full view
    reads. Negative control: keeping the full view makes the plan refuse the overlap."""
    raw, views = _indexer_views(nb, rows, key_dim, 4 * scale_words, pad)
    comps = collect_components({"layers.0.indexer.k_cache": views}, {"layers.0.indexer.k_cache": rows})
    assert [c.index for c in comps] == [0, 1, 2]
    kept, covering = drop_covering_views(comps)
    assert [c.index for c in kept] == [0, 1]
    assert [(v.index, v.covered_by, v.row_bytes) for v in covering] == [
        (2, (("layers.0.indexer.k_cache", 0), ("layers.0.indexer.k_cache", 1)), key_dim + 4 * scale_words)]

    def plan_of(cs):
        return TransferPlan([GroupSpec(rows)], [Plane(c.pages, 0, rows, c.row_bytes, dtype=c.dtype) for c in cs],
                            rows)

    with pytest.raises(ValueError, match="overlap"):
        plan_of(comps)
    plan = plan_of(kept)
    slots = [np.arange(rows, 2 * rows, dtype=np.int64).reshape(1, rows)]  # block 1, whole
    objects = torch.zeros((1, plan.object_bytes), dtype=torch.uint8)
    backend = get_backend("torch")
    backend.store(plan, slots, objects)
    want = as_bytes(views[2][1])
    raw.zero_()
    backend.load(plan, slots, objects)
    assert as_bytes(views[2][1]) == want
    assert any(want[rows * key_dim:]), "negative control: the scale bytes are not all zero"
    assert not as_bytes(views[2][0]).strip(b"\0"), "a load wrote a block outside the slots"


def test_views_that_leave_a_gap_or_overlap_do_not_cover() -> None:
    """A wider view is dropped only where the others tile it exactly: with a gap (half the scales) or with two views
    over the same bytes (a tail view over the last key row and the scales) every view stays, for the plan to refuse."""
    raw, (key, scale, full) = _indexer_views(3, 8, 64, 8, 0)
    half_scale = torch.as_strided(raw.view(torch.float32), (3, 8, 1, 1), (576 // 4, 1, 1, 1), 8 * 64 // 4)
    kept, covering = drop_covering_views(collect_components({"l": [key, half_scale, full]}, {"l": 8}))
    assert (len(kept), covering) == (3, [])
    tail = torch.as_strided(raw.view(torch.float8_e4m3fn), (3, 8, 1, 16), (8 * 72, 16, 16, 1), 7 * 64)
    kept, covering = drop_covering_views(collect_components({"l": [key, scale, tail, full]}, {"l": 8}))
    assert (len(kept), covering) == (4, [])
    kept, covering = drop_covering_views(collect_components({"l": [key, scale, full]}, {"l": 8}))
    assert [v.index for v in covering] == [2], "control: the exact tiling is found"
