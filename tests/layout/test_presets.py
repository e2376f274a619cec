"""Every preset, every device family: bytes per chunk by hand, and a bit-exact round trip through emu and torch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from lmcache_npu.layout.discovery import DEFAULT_CHUNK_TOKENS
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from lmcache_npu.tools.bench.presets import block_tables, blocks_for  # noqa: E402
from lmcache_npu.tools.presets import preset_layout  # noqa: E402
from lmcache_npu.tools.presets.catalog import MODELS  # noqa: E402
from lmcache_npu.layout.slots import layout_slots  # noqa: E402
from lmcache_npu.ops import get_backend  # noqa: E402

from .payload_oracle import expected_object_segments, rows_of  # noqa: E402

KIB = 1024
# Bytes per 256-token chunk stored, written out from the model configs (rows x row bytes per plane, 64 B aligned segments).
STORED = {
    ("llama3-8b", "ascend"): 32 * 2 * 256 * 2048,  # K and V, 8 KV heads x 128 x bf16
    ("llama3-8b", "cuda"): 32 * 2 * 256 * 2048,
    ("qwen3-32b", "ascend"): 64 * 2 * 256 * 2048,
    ("qwen3-32b", "cuda"): 64 * 2 * 256 * 2048,
    ("deepseek-v3", "ascend"): 61 * 256 * (1024 + 128),  # nope 512 + rope 64, bf16, two tensors
    ("deepseek-v3", "cuda"): 61 * 256 * 1152,  # one [nb, bs, 576] bf16 tensor
    # LI-C8: nope, rope, int8 indexer keys 128 B, fp16 scale 2 B (256 x 2 = 512 B, already 64 B aligned)
    ("deepseek-v3.2-c8", "ascend"): 61 * 256 * (1024 + 128 + 128 + 2),
    ("deepseek-v3.2-c8", "cuda"): 61 * 256 * (656 + 132),  # FlashMLA-sparse fp8 row + fp8 indexer key/scale
    # c4: 64 rows x (MLA 1024 + indexer 128 + scale 2 -> 128 aligned); c128: 2 rows x 1024; SWA: 128-row tail;
    # c4 compressor states (attention 2x2x512 fp32, indexer 2x2x128 fp32): the 4 boundary rows only
    ("deepseek-v4-flash", "ascend"): 21 * (64 * 1024 + 64 * 128 + 128) + 20 * 2 * 1024 + 43 * 128 * 1024
    + 21 * 4 * (8192 + 2048),
    ("deepseek-v4-flash", "cuda"): 21 * (64 * 1024 + 64 * 132) + 20 * 2 * 1024 + 43 * 128 * 1024
    + 21 * 4 * (8192 + 2048),
    # Ascend 950: c4 64 rows x (fp8 MLA 640 + fp8 indexer 128 + fp32 scale 4 -> 256 B, 64 B aligned); the indexer's
    # "full" view (132 B rows over the same bytes) adds nothing; c128 2 x 640; SWA 43 + 1 MTP layer, 128-row tails
    ("deepseek-v4-flash-a5", "ascend"): 21 * (64 * 640 + 64 * 128 + 256) + 20 * 2 * 640 + 44 * 128 * 640
    + 21 * 4 * (8192 + 2048),
    ("gemma3-27b", "ascend"): 62 * 2 * 256 * 4096,  # window 1024 > chunk: whole chunks
    ("gemma3-27b", "cuda"): 62 * 2 * 256 * 4096,
    ("gpt-oss-120b", "ascend"): 18 * 2 * 128 * 1024 + 18 * 2 * 256 * 1024,  # SW 128 tail + full
    ("gpt-oss-120b", "cuda"): 18 * 2 * 128 * 1024 + 18 * 2 * 256 * 1024,
    # one chunk = one state block: Ascend block 1024, CUDA 544; GDN conv (3 x 8192 bf16) + ssm (32x128x128 bf16)
    ("qwen3-next-80b", "ascend"): 12 * 2 * 1024 * 1024 + 36 * (49152 + 1048576),
    ("qwen3-next-80b", "cuda"): 12 * 2 * 544 * 1024 + 36 * (49152 + 1048576),
    ("llama3-8b-310p", "ascend"): 32 * 2 * 256 * 2048,
    # vLLM's CPU attention: the same bytes, as one K and one V plane per KV head (256 rows x 256 B each)
    ("llama3-8b", "cpu"): 32 * 8 * 2 * 256 * 256,
    ("qwen3-32b", "cpu"): 64 * 8 * 2 * 256 * 256,
    ("deepseek-v3", "cpu"): 61 * 256 * 1152,  # CPU MLA [nb, 16, 576] bf16
    ("gemma3-27b", "cpu"): 62 * 16 * 2 * 256 * 256,
    ("gpt-oss-120b", "cpu"): 18 * 8 * 2 * 128 * 128 + 18 * 8 * 2 * 256 * 128,
    ("qwen3-next-80b", "cpu"): 12 * 2 * 2 * 544 * 512 + 36 * (49152 + 1048576),
}
DSV4_STATE_NAIVE = 21 * 256 * (8192 + 2048) + 20 * 256 * 4096  # c4 attn + indexer state, c128 state: full chunks
NAIVE = {
    ("deepseek-v4-flash", "ascend"): 21 * 64 * (1024 + 128 + 2) + 20 * 2 * 1024 + 43 * 256 * 1024 + DSV4_STATE_NAIVE,
    ("deepseek-v4-flash", "cuda"): 21 * 64 * (1024 + 132) + 20 * 2 * 1024 + 43 * 256 * 1024 + DSV4_STATE_NAIVE,
    ("deepseek-v4-flash-a5", "ascend"): 21 * 64 * (640 + 128 + 4) + 20 * 2 * 640 + 44 * 256 * 640
    + DSV4_STATE_NAIVE,
    ("gpt-oss-120b", "ascend"): 36 * 2 * 256 * 1024,
    ("gpt-oss-120b", "cuda"): 36 * 2 * 256 * 1024,
    ("gpt-oss-120b", "cpu"): 36 * 2 * 256 * 1024,
}
CASES = sorted(STORED)


@pytest.mark.parametrize("name,family", CASES)
def test_bytes_per_chunk(name: str, family: str) -> None:
    layout, _ = preset_layout(name, family, num_blocks=2)
    if layout.groups[0].chunk_tokens == DEFAULT_CHUNK_TOKENS:  # the model does not fix the chunk: the tables are per 256 tokens
        layout, _ = preset_layout(name, family, chunk_tokens=256, num_blocks=2)
    assert layout.bytes_per_chunk == STORED[name, family]
    assert layout.naive_bytes_per_chunk == NAIVE.get((name, family), STORED[name, family])


def test_every_preset_is_covered() -> None:
    assert {n for n, _ in CASES} == set(MODELS)
    assert {(n, f) for n, m in MODELS.items() for f in m.families} == set(CASES)


def test_deepseek_v4_flash_ascend_groups() -> None:
    """vllm-ascend 0.23: [c4 MLA + indexer, c128 MLA, SWA x2 (22 + 21 layers), c4 state, c128 state]."""
    layout, preset = preset_layout("deepseek-v4-flash", "ascend", chunk_tokens=256, num_blocks=2)
    assert len(preset.kv_cache_config.kv_cache_groups) == 6
    data = layout.to_json()
    summary = [(g["scheduler_group"], g["kind"], g["layers"], g["tokens_per_block"], g["compress_ratio"],
                g["sliding_window"], g["stored"], g["rows_per_chunk"]) for g in data["groups"]]
    assert summary == [
        (0, "mla", 42, 512, 4, None, "all", 64),  # 21 MLA + 21 indexer layers, 128 rows x 4 tokens per block
        (1, "mla", 20, 16384, 128, None, "all", 2),
        (2, "sliding_window_mla", 22, 128, 1, 128, "tail", 128),  # only the 128-token tail of each chunk
        (3, "sliding_window_mla", 21, 128, 1, 128, "tail", 128),
        (4, "compressor_state", 42, 8, 1, 8, "boundary", 4),  # window 8 not stored, its last 4 rows are
        (5, "compressor_state", 20, 32, 1, 128, "skipped", 0),
    ]
    assert "reads the kv/score state of the 4 tokens before it" in data["groups"][4]["note"]
    assert "exact" in data["groups"][5]["skip_reason"] and "128-aligned" in data["groups"][5]["skip_reason"]
    assert data["caveats"] == []
    assert data["groups"][0]["planes"] == [
        {"role": "k", "count": 21, "dtype": "int8", "row_bytes": 128, "rows_per_chunk": 64},
        {"role": "scale", "count": 21, "dtype": "fp16", "row_bytes": 2, "rows_per_chunk": 64},
        {"role": "self_attn", "count": 21, "dtype": "bf16", "row_bytes": 1024, "rows_per_chunk": 64},
    ]


def test_deepseek_v4_flash_a5_groups_dtypes_and_pages() -> None:
    """vllm-ascend 0.23 on Ascend 950: block table [128, 128, 8, 16], padded pages [16896, 81920], fp8 caches, one MTP
    layer (SWA only) in the sliding-window groups, and the indexer's full view stored once."""
    layout, preset = preset_layout("deepseek-v4-flash-a5", "ascend", chunk_tokens=256, num_blocks=2)
    config = preset.kv_cache_config
    assert [g.kv_cache_spec.block_size for g in config.kv_cache_groups] == [128, 128, 128, 128, 8, 16]
    assert sorted({t.size // config.num_blocks for t in config.kv_cache_tensors}) == [16896, 81920]
    summary = [(g.scheduler_group, g.kind.value, len(g.layers), g.tokens_per_block, g.stored,
                0 if g.skipped else g.rows_per_chunk) for g in layout.groups]
    assert summary == [
        (0, "mla", 42, 512, "all", 64),
        (1, "mla", 20, 16384, "all", 2),
        (2, "sliding_window_mla", 22, 128, "tail", 128),  # 43 layers + the MTP layer, split 22 + 22
        (3, "sliding_window_mla", 22, 128, "tail", 128),
        (4, "compressor_state", 42, 8, "boundary", 4),
        (5, "compressor_state", 20, 16, "skipped", 0),
    ]
    assert any(n.startswith("mtp.0.") for g in layout.groups for n in g.layers)
    assert layout.to_json()["groups"][0]["planes"] == [
        {"role": "k", "count": 21, "dtype": "fp8_e4m3", "row_bytes": 128, "rows_per_chunk": 64},
        {"role": "scale", "count": 21, "dtype": "fp32", "row_bytes": 4, "rows_per_chunk": 64},
        {"role": "self_attn", "count": 21, "dtype": "fp8_e4m3", "row_bytes": 640, "rows_per_chunk": 64},
    ]
    for g in layout.groups[1:4]:
        assert {(p.dtype, p.row_bytes) for p in g.planes} == {("fp8_e4m3", 640)}
    indexers = [n for n in preset.kv_caches if n.endswith("indexer.k_cache")]
    assert len(indexers) == 21 and len(layout.covering_views) == 21
    views = {(v.index, tuple(i for _, i in v.covered_by), v.row_bytes) for v in layout.covering_views}
    assert views == {(2, (0, 1), 132)}
    assert "payloads 0, 1: stored once" in layout.groups[0].note
    key, scale, full = preset.kv_caches[indexers[0]]
    assert (key.dtype, scale.dtype, full.dtype) == (torch.float8_e4m3fn, torch.float32, torch.float8_e4m3fn)
    assert full.data_ptr() == key.data_ptr() and full.stride(0) == key.stride(0) == 16896  # fp8: bytes
    assert scale.data_ptr() == key.data_ptr() + 128 * 128


def test_a5_full_view_sees_every_loaded_byte() -> None:
    """Store the c4 indexer rows, scrub the pages, load: the full view (never a plane) reads the stored keys and
    scales back; a load that skipped the scale plane would leave the full view's scale bytes scrubbed."""
    layout, preset = preset_layout("deepseek-v4-flash-a5", "ascend", num_blocks=4, seed=5)
    group = layout.groups[0]
    slots = [np.full((1, layout.plan.rows_per_chunk[g.index]), -1, dtype=np.int64) for g in layout.groups]
    slots[0][0] = np.arange(group.rows_per_chunk) + group.rows_per_block  # block 1, rows 0..63
    plan = layout.plan
    backend = get_backend("torch")
    objects = torch.zeros((1, plan.object_bytes), dtype=torch.uint8)
    backend.store(plan, slots, objects)
    name = next(n for n in preset.kv_caches if n.endswith("indexer.k_cache"))
    key, scale, full = preset.kv_caches[name]
    want = full[1].contiguous().view(torch.uint8).clone()
    for raw in preset.allocations:
        raw.zero_()
    backend.load(plan, slots, objects)
    got = full[1].contiguous().view(torch.uint8)
    rows = group.rows_per_chunk
    flat_want, flat_got = want.reshape(-1), got.reshape(-1)
    assert torch.equal(flat_got[:rows * 128], flat_want[:rows * 128])  # the keys of the chunk's rows
    scale_start = 128 * 128
    assert torch.equal(flat_got[scale_start:scale_start + rows * 4], flat_want[scale_start:scale_start + rows * 4])
    assert flat_want[scale_start:scale_start + rows * 4].any(), "negative control: the scales are not all zero"
    assert not flat_got[rows * 128:scale_start].any(), "rows outside the chunk were written"


def test_deepseek_v4_skipping_compressor_state_is_smaller_and_says_it_is_approximate() -> None:
    layout, _ = preset_layout("deepseek-v4-flash", "ascend", chunk_tokens=256, num_blocks=2, skip_spec_kinds=("compressor_state",))
    c4_state, c128_state = layout.groups[4], layout.groups[5]
    assert (c4_state.skipped, c4_state.exact_restore) == (True, False)
    assert "restore is approximate" in c4_state.skip_reason and c128_state.exact_restore
    assert layout.bytes_per_chunk == STORED["deepseek-v4-flash", "ascend"] - 21 * 4 * (8192 + 2048)
    assert layout.caveats == (f"group 4: {c4_state.skip_reason}",)


def _snapshot(raws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [r.clone() for r in raws]


def _round_trip(name: str, family: str, backend_name: str) -> None:
    chunks = 2
    probe, _ = preset_layout(name, family, num_blocks=2)
    needed = blocks_for(probe, _.kv_cache_config, chunks)
    # one extra block per group for the skipped groups' own memory, which no transfer may touch
    num_blocks = 1 + sum(needed) + len(needed)
    layout, preset = preset_layout(name, family, num_blocks=num_blocks, seed=7)
    tables = block_tables([n + 1 for n in needed], num_blocks, torch.Generator().manual_seed(3))
    slots = layout_slots(layout, [t[:-1] for t in tables], np.arange(chunks))
    plan, caches = layout.plan, preset.kv_caches
    soc = "310p" if preset.model.fractal_nz else "a2"
    backend = get_backend(backend_name, **({"soc": soc} if backend_name == "emu" else {}))

    before = _snapshot(preset.allocations)
    backends = preset.attention_backends
    expected = expected_object_segments(layout, caches, slots, backends)
    objects = torch.zeros((chunks, plan.object_bytes), dtype=torch.uint8)
    backend.store(plan, slots, objects)
    assert all(torch.equal(a, b) for a, b in zip(preset.allocations, before)), "a store wrote the pages"
    for plane, offset in zip(plan.moved_planes, plan.object_offsets):
        seg = expected[plane.name]
        got = objects[:, offset: offset + seg.shape[1] * seg.shape[2]].reshape(seg.shape)
        assert torch.equal(got, seg), f"object segment of {plane.name} differs from the registered tensor's rows"

    # Load into different bytes: exactly the moved rows change, and they become the stored rows.
    scrubbed = [torch.randint(-128, 128, r.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(9))
                for r in preset.allocations]
    for raw, fresh in zip(preset.allocations, scrubbed):
        raw.copy_(fresh)
    moved_diff = 0
    for g in layout.groups:
        if not g.skipped:
            flat = slots[g.index].reshape(-1)
            for plane in g.planes:
                now = rows_of(caches[plane.layers[0]], plane, g, flat // g.rows_per_block, flat % g.rows_per_block,
                          backends.get(plane.layers[0]))
                moved_diff += int((now != expected[plane.name].reshape(now.shape)).sum())
    skipped_before = {}
    for g in layout.groups:
        if g.skipped:  # every row of the skipped group's own block
            own = tables[g.scheduler_group][-1]
            blocks = np.full(g.rows_per_block, own)
            for plane in g.planes:
                skipped_before[plane.name] = rows_of(caches[plane.layers[0]], plane, g, blocks,
                                                     np.arange(g.rows_per_block), backends.get(plane.layers[0]))
    backend.load(plan, slots, objects)
    for g in layout.groups:
        if g.skipped:
            own = tables[g.scheduler_group][-1]
            for plane in g.planes:
                after = rows_of(caches[plane.layers[0]], plane, g, np.full(g.rows_per_block, own),
                                np.arange(g.rows_per_block), backends.get(plane.layers[0]))
                assert torch.equal(after, skipped_before[plane.name]), f"skipped plane {plane.name} was written"
            continue
        flat = slots[g.index].reshape(-1)
        for plane in g.planes:
            back = rows_of(caches[plane.layers[0]], plane, g, flat // g.rows_per_block, flat % g.rows_per_block,
                           backends.get(plane.layers[0]))
            assert torch.equal(back, expected[plane.name].reshape(back.shape)), f"{plane.name} not restored"
    changed = sum(int((raw != fresh).sum()) for raw, fresh in zip(preset.allocations, scrubbed))
    assert changed == moved_diff, "a load wrote bytes outside the moved rows"


@pytest.mark.parametrize("name,family", CASES)
def test_round_trip_emu(name: str, family: str) -> None:
    _round_trip(name, family, "emu")


@pytest.mark.parametrize("name,family", CASES)
def test_round_trip_torch(name: str, family: str) -> None:
    _round_trip(name, family, "torch")
