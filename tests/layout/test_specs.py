"""Spec reading in both attribute eras, per spec class; unknown classes are refused."""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import vllm.v1.kv_cache_interface as kvi  # noqa: E402

from lmcache_npu.tools.presets.ascend import ascend_spec_classes  # noqa: E402
from lmcache_npu.layout.specs import SpecKind, read_layer_spec  # noqa: E402

BF16 = torch.bfloat16


def test_upstream_compressed_mla_counts_tokens_per_block() -> None:
    """vLLM 0.23 on CUDA: a c4 block of 256 tokens stores 64 rows."""
    spec = kvi.MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=BF16, compress_ratio=4)
    s = read_layer_spec("model.layers.2.attn", spec)
    assert (s.kind, s.tokens_per_block, s.rows_per_block, s.compress_ratio) == (SpecKind.MLA, 256, 64, 4)


def test_ascend_compressed_mla_counts_rows_per_block() -> None:
    """vllm-ascend 0.23: a c4 block of 128 rows covers 512 tokens; c128 covers 16384."""
    mla, _ = ascend_spec_classes()
    for ratio, tokens in ((4, 512), (128, 16384)):
        spec = mla(block_size=128, num_kv_heads=1, head_size=512, dtype=BF16, compress_ratio=ratio)
        s = read_layer_spec("model.layers.3.self_attn", spec)
        assert (s.spec_class, s.tokens_per_block, s.rows_per_block, s.compress_ratio) == (
            "AscendMLAAttentionSpec", tokens, 128, ratio)


def test_sliding_window_chunked_local_and_mamba() -> None:
    sw = read_layer_spec("l", kvi.SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=BF16,
                                                    sliding_window=128))
    assert (sw.kind, sw.sliding_window, sw.rows_per_block) == (SpecKind.SLIDING_WINDOW, 128, 16)
    # A full-attention spec that records a window (HMA off) still keeps every token.
    full = read_layer_spec("l", kvi.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=BF16,
                                                      sliding_window=128))
    assert (full.kind, full.sliding_window) == (SpecKind.FULL_ATTENTION, None)
    local = read_layer_spec("l", kvi.ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=64,
                                                               dtype=BF16, attention_chunk_size=8192))
    assert (local.kind, local.sliding_window) == (SpecKind.CHUNKED_LOCAL, 8192)
    mamba = read_layer_spec("l", kvi.MambaSpec(block_size=544, shapes=((3, 64),), dtypes=(BF16,),
                                               mamba_cache_mode="align"))
    assert (mamba.kind, mamba.tokens_per_block, mamba.rows_per_block, mamba.mamba_cache_mode) == (
        SpecKind.MAMBA, 544, 1, "align")


def test_compressor_state_is_recognised_from_the_spec() -> None:
    spec = kvi.SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=2048, dtype=torch.float32,
                                    sliding_window=8)
    assert read_layer_spec("model.layers.2.attn.compressor.state_cache", spec).kind == SpecKind.COMPRESSOR_STATE
    swa = kvi.SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=BF16, sliding_window=128)
    assert read_layer_spec("model.layers.2.attn.swa_cache", swa).kind == SpecKind.SLIDING_WINDOW_MLA


# vLLM >= 0.29 dropped `compress_ratio` for `tokens_per_state` and added `prefix_cacheable`; these stand-ins carry
# exactly the attributes of that era under the class names it uses.
@dataclass(frozen=True)
class MLAAttentionSpec:  # noqa: D101 - named like vLLM's class on purpose
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    tokens_per_state: object = 1

    @property
    def prefix_cacheable(self) -> bool:
        return True


@dataclass(frozen=True)
class SlidingWindowMLASpec:  # noqa: D101
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int
    bounded_replay: bool = False
    tokens_per_state: object = 1

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay


def test_new_era_tokens_per_state_and_prefix_cacheable() -> None:
    s = read_layer_spec("l", MLAAttentionSpec(256, 1, 512, BF16, tokens_per_state=Fraction(128)))
    assert (s.compress_ratio, s.rows_per_block, s.tokens_per_block) == (128, 2, 256)
    replay = read_layer_spec("l", SlidingWindowMLASpec(64, 1, 512, BF16, 128, bounded_replay=True))
    assert not replay.prefix_cacheable
    with pytest.raises(ValueError, match=r"layer w: tokens_per_state 1/2 stores several states per token"):
        read_layer_spec("w", MLAAttentionSpec(16, 1, 64, BF16, tokens_per_state=Fraction(1, 2)))


def test_unknown_spec_class_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class PagedRingSpec(kvi.FullAttentionSpec):
        ring: int = 4

    with pytest.raises(ValueError, match=r"layer x: unknown KV-cache spec class PagedRingSpec \(it derives from "
                                         r"FullAttentionSpec.*known classes are"):
        read_layer_spec("x", PagedRingSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=BF16))


def test_compressed_block_must_hold_whole_rows() -> None:
    spec = kvi.MLAAttentionSpec(block_size=250, num_kv_heads=1, head_size=512, dtype=BF16, compress_ratio=4)
    with pytest.raises(ValueError, match="layer m: block_size 250 tokens is not a multiple of compress ratio 4"):
        read_layer_spec("m", spec)
