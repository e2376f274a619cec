"""Per-layer KV geometry of real models as vllm-ascend 0.23 allocates it (A2/A3, block size 128).

Row bytes follow the cache shapes in vllm-ascend's model runner: dense attention is split K/V
`[nb, bs, kv_heads, head_dim]`; MLA is (nope 512, rope 64); DSA-C8 adds an int8 indexer and an fp16
scale sharing one page; DeepSeek-V4 is grouped by compress ratio with padded pages.
"""

from __future__ import annotations

from .geometry import Geometry, GroupGeometry, PlaneGeometry

BLOCK = 128
BF16, FP16, FP32 = 2, 2, 4


def _dense(name: str, layers: int, kv_heads: int, head_dim: int, window: int | None = None) -> tuple[PlaneGeometry, ...]:
    row = kv_heads * head_dim * BF16
    return tuple(
        PlaneGeometry(row_bytes=row, rows_per_block=BLOCK, block_stride_bytes=BLOCK * row, layers=layers,
                      name=f"{name}{part}", dtype="bf16")
        for part in ("k", "v")
    )


def llama3_8b() -> Geometry:
    return Geometry((GroupGeometry(BLOCK, _dense("", 32, 8, 128)),), name="llama3-8b",
                    notes="32 layers, 8 KV heads x 128, bf16, split K/V")


def llama3_8b_310p() -> Geometry:
    row = 8 * 128 * FP16
    plane = lambda part: PlaneGeometry(  # noqa: E731
        row_bytes=row, rows_per_block=BLOCK, block_stride_bytes=BLOCK * row, layers=32, name=part, dtype="fp16",
        layout="fractal_nz", nz_unit_bytes=16 * FP16)
    return Geometry((GroupGeometry(BLOCK, (plane("k"), plane("v"))),), name="llama3-8b-310p",
                    notes="310P FRACTAL_NZ [nb, H*hd/16, bs, 16] fp16, split K/V")


def deepseek_v3() -> Geometry:
    planes = (
        PlaneGeometry(row_bytes=512 * BF16, rows_per_block=BLOCK, block_stride_bytes=BLOCK * 512 * BF16, layers=61,
                      name="nope", dtype="bf16"),
        PlaneGeometry(row_bytes=64 * BF16, rows_per_block=BLOCK, block_stride_bytes=BLOCK * 64 * BF16, layers=61,
                      name="rope", dtype="bf16"),
    )
    return Geometry((GroupGeometry(BLOCK, planes),), name="deepseek-v3", notes="61 MLA layers: nope 512 + rope 64, bf16")


def deepseek_v32_c8() -> Geometry:
    indexer_page = BLOCK * (128 + 2)  # int8 indexer K then fp16 scale in one page
    planes = (
        PlaneGeometry(row_bytes=512 * BF16, rows_per_block=BLOCK, block_stride_bytes=BLOCK * 1024, layers=61,
                      name="nope", dtype="bf16"),
        PlaneGeometry(row_bytes=64 * BF16, rows_per_block=BLOCK, block_stride_bytes=BLOCK * 128, layers=61,
                      name="rope", dtype="bf16"),
        PlaneGeometry(row_bytes=128, rows_per_block=BLOCK, block_stride_bytes=indexer_page, layers=61,
                      name="indexer_k", dtype="int8", page="indexer"),
        PlaneGeometry(row_bytes=2, rows_per_block=BLOCK, block_stride_bytes=indexer_page, layers=61,
                      name="indexer_scale", dtype="fp16", page="indexer", page_offset_bytes=BLOCK * 128),
    )
    return Geometry((GroupGeometry(BLOCK, planes),), name="deepseek-v3.2-c8",
                    notes="DSA-C8: MLA nope/rope + int8 indexer K + fp16 indexer scale sharing a page")


def deepseek_v4_flash() -> Geometry:
    """vllm-ascend 0.23 grouping: [c4 MLA + indexer, c128 MLA, SWA x5, c4 state x2, c128 state x2] = 11 groups.

    43 layers: 0-1 SWA only, then alternating c4 (21 layers) and c128 (20 layers); every layer has an SWA
    cache (window 128). Pages are padded to the MLA page (131072 B); the indexer page is 16640 B.
    """
    mla_page = BLOCK * 512 * BF16  # 131072
    indexer_page = BLOCK * (128 + 2)  # 16640

    def mla(layers: int) -> PlaneGeometry:
        return PlaneGeometry(row_bytes=512 * BF16, rows_per_block=BLOCK, block_stride_bytes=mla_page, layers=layers,
                             name="mla", dtype="bf16")

    c4 = GroupGeometry(BLOCK * 4, (
        mla(21),
        PlaneGeometry(row_bytes=128, rows_per_block=BLOCK, block_stride_bytes=indexer_page, layers=21,
                      name="indexer_k", dtype="int8", page="indexer"),
        PlaneGeometry(row_bytes=2, rows_per_block=BLOCK, block_stride_bytes=indexer_page, layers=21,
                      name="indexer_scale", dtype="fp16", page="indexer", page_offset_bytes=BLOCK * 128),
    ), compress_ratio=4, name="mla-c4")
    c128 = GroupGeometry(BLOCK * 128, (mla(20),), compress_ratio=128, name="mla-c128")
    swa = [GroupGeometry(BLOCK, (PlaneGeometry(row_bytes=512 * BF16, rows_per_block=BLOCK, block_stride_bytes=mla_page,
                                               layers=n, name="swa", dtype="bf16"),),
                         sliding_window=128, name=f"swa-{i}") for i, n in enumerate((9, 9, 9, 8, 8))]

    def state(i: int, layers: int, block: int, coff: int, ratio: int) -> GroupGeometry:
        row = 2 * coff * 512 * FP32
        return GroupGeometry(block, (PlaneGeometry(row_bytes=row, rows_per_block=block, block_stride_bytes=mla_page,
                                                   layers=layers, name="compressor_state", dtype="fp32"),),
                             sliding_window=coff * ratio, skip=True,
                             skip_reason="compressor state: rebuilt by prefill of the last chunk", name=f"c{ratio}-state-{i}")

    states = [state(0, 11, 8, 2, 4), state(1, 10, 8, 2, 4), state(0, 10, 32, 1, 128), state(1, 10, 32, 1, 128)]
    return Geometry((c4, c128, *swa, *states), name="deepseek-v4-flash",
                    notes="vllm-ascend 0.23 A2 grouping, block 128, 11 groups (4 state groups skipped)")


def gpt_oss_120b() -> Geometry:
    return Geometry(
        (GroupGeometry(BLOCK, _dense("swa_", 18, 8, 64), sliding_window=128, name="swa-128"),
         GroupGeometry(BLOCK, _dense("full_", 18, 8, 64), name="full")),
        name="gpt-oss-120b", notes="36 layers alternating SW 128 / full, 8 KV heads x 64, bf16")


PRESETS = {
    "llama3-8b": llama3_8b,
    "llama3-8b-310p": llama3_8b_310p,
    "deepseek-v3": deepseek_v3,
    "deepseek-v3.2-c8": deepseek_v32_c8,
    "deepseek-v4-flash": deepseek_v4_flash,
    "gpt-oss-120b": gpt_oss_120b,
}


def get_preset(name: str) -> Geometry:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
