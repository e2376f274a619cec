"""Discovery on small hand-built configs: plan groups, dedupe scope, aliases, chunk slots, and every named error."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import vllm.v1.kv_cache_interface as kvi  # noqa: E402

from lmcache_npu.layout import LayoutPolicy, discover_layout  # noqa: E402
from lmcache_npu.layout.discovery import kept_window_tokens  # noqa: E402
from lmcache_npu.tools.presets.ascend import ascend_spec_classes  # noqa: E402
from lmcache_npu.layout.slots import chunk_slots  # noqa: E402

BF16 = torch.bfloat16
NB = 6


def full(block: int = 16, heads: int = 2, dim: int = 8):
    return kvi.FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=dim, dtype=BF16)


def window(size: int, block: int = 16, heads: int = 2, dim: int = 8):
    return kvi.SlidingWindowSpec(block_size=block, num_kv_heads=heads, head_size=dim, dtype=BF16, sliding_window=size)


def config(*groups, num_blocks: int = NB):
    return kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[kvi.KVCacheGroupSpec(list(names), spec) for names, spec in groups])


def kv(nb: int = NB, block: int = 16, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(nb, block, heads, dim).to(BF16), torch.randn(nb, block, heads, dim).to(BF16)


def test_groups_sharing_one_allocation_keep_their_own_planes() -> None:
    """Gemma-style: a full and a sliding-window layer share one tensor with disjoint block ids."""
    shared = kv()
    layout = discover_layout(config((["full.0"], full()), (["swa.0"], window(32))),
                             {"full.0": shared, "swa.0": shared}, LayoutPolicy(chunk_tokens=64))
    assert [len(g.planes) for g in layout.groups] == [2, 2]
    assert [g.rows_per_chunk for g in layout.groups] == [64, 32]
    assert layout.plan.object_bytes == 64 * 32 * 2 + 32 * 32 * 2  # rows x (2 heads x 8 x bf16) x (K, V)


def test_views_of_one_memory_inside_a_group_are_one_plane() -> None:
    k, v = kv()
    layout = discover_layout(config((["a", "b"], full())), {"a": (k, v), "b": (k, v)}, LayoutPolicy(chunk_tokens=32))
    assert len(layout.plan.planes) == 2 and layout.groups[0].planes[0].layers == ("a", "b")


def test_kv_sharing_layer_without_a_spec_is_an_alias() -> None:
    k, v = kv()
    layout = discover_layout(config((["a"], full())), {"a": (k, v), "b": (k, v)}, LayoutPolicy(chunk_tokens=32))
    assert layout.aliases == {"b": "a"} and len(layout.plan.planes) == 2


def test_ascend_compressed_group_splits_and_scheduler_mapping() -> None:
    """Upstream DeepSeek-V4: one scheduler group with c4 and c128 MLA becomes two plan groups."""
    c4 = kvi.MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=64, dtype=BF16, compress_ratio=4)
    c128 = kvi.MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=64, dtype=BF16, compress_ratio=128)
    uniform = kvi.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs={"l2.attn": c4, "l3.attn": c128})
    caches = {"l2.attn": torch.randn(NB, 64, 64).to(BF16), "l3.attn": torch.randn(NB, 2, 64).to(BF16)}
    layout = discover_layout(config((["l2.attn", "l3.attn"], uniform)), caches, LayoutPolicy(chunk_tokens=256))
    assert [(g.scheduler_group, g.compress_ratio, g.rows_per_block, g.rows_per_chunk) for g in layout.groups] == [
        (0, 4, 64, 64), (0, 128, 2, 2)]


@pytest.mark.parametrize(
    "build,policy,message",
    [
        (lambda: (config(), {}), LayoutPolicy(), r"the KV-cache config has no groups: an attention-free model"),
        (lambda: (config((["a"], full())), {}), LayoutPolicy(),
         r"layers \['a'\] are in the KV-cache config but register_kv_caches gave no tensor"),
        (lambda: (config((["a"], full())), {"a": kv(), "stray": torch.randn(NB, 16, 4)}), LayoutPolicy(),
         r"layer stray has KV tensors but no KV-cache spec in any group, and does not share"),
        (lambda: (config((["a"], full()), num_blocks=8), {"a": kv()}), LayoutPolicy(),
         r"layer a, tensor 0: 6 blocks, but the KV-cache config has num_blocks 8"),
        (lambda: (config((["a"], full()), num_blocks=4), {"a": kv()}), LayoutPolicy(),
         r"layer a, tensor 0: 6 blocks, but the KV-cache config has num_blocks 4; every paged tensor needs exactly"),
        (lambda: (config((["a"], full())), {"a": tuple(torch.as_strided(t, t.shape, (8 * 16, 16, 8, 1))
                                                        for t in kv())}), LayoutPolicy(),
         r"layer a, tensor 0: block stride 256 B is smaller than a block's rows \(512 B\)"),
        (lambda: (config((["a"], full())), {"a": kv()}), LayoutPolicy(chunk_tokens=200),
         r"chunk_tokens 200 is not a multiple of the hash block size 16"),
        (lambda: (config((["x.attn"], kvi.SlidingWindowMLASpec(block_size=8, num_kv_heads=1, head_size=16,
                                                                dtype=torch.float32, sliding_window=8))),
                  {"x.attn": torch.randn(NB, 8, 16)}), LayoutPolicy(chunk_tokens=64),
         r"an fp32 sliding-window MLA spec \(a compressor state\) on layers that are not compressor state caches"),
        (lambda: (config((["g"], kvi.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(BF16,))),
                         (["a"], full(block=64))), {"g": [torch.randn(NB, 4, 8).to(BF16)], "a": kv(block=64)}),
         LayoutPolicy(chunk_tokens=64), r"mamba_cache_mode 'none' keeps one running state per request"),
        (lambda: (config((["g"], kvi.MambaSpec(block_size=96, shapes=((4, 8),), dtypes=(BF16,),
                                               mamba_cache_mode="align"))),
                  {"g": [torch.randn(NB, 4, 8).to(BF16)]}), LayoutPolicy(chunk_tokens=64, hash_block_size=32),
         r"group 0 \(MambaSpec.*chunk_tokens 64 is not a multiple of the group's token granularity 96 \(one state "
         r"per block\)"),
    ],
    ids=["no-groups", "missing-tensor", "tensor-without-spec", "fewer-blocks", "more-blocks", "block-stride", "hash-block",
         "state-on-kv-layer", "mamba-none", "mamba-granularity"],
)
def test_named_errors(build, policy: LayoutPolicy, message: str) -> None:
    cfg, caches = build()
    with pytest.raises(ValueError, match=message):
        discover_layout(cfg, caches, policy)


def test_ascend_c4_granularity_and_unknown_skip_kind() -> None:
    mla, _ = ascend_spec_classes()
    spec = mla(block_size=16, num_kv_heads=1, head_size=32, dtype=BF16, compress_ratio=4)
    caches = {"l.attn": [torch.randn(NB, 16, 1, 32).to(BF16)]}
    with pytest.raises(ValueError, match=r"chunk_tokens 30 is not a multiple of the group's token granularity 4 "
                                         r"\(one compressed row per ratio tokens\)"):
        discover_layout(config((["l.attn"], spec)), caches, LayoutPolicy(chunk_tokens=30, hash_block_size=2))
    with pytest.raises(ValueError, match=r"skip_spec_kinds: unknown spec kinds \['state'\]; valid kinds are"):
        LayoutPolicy(skip_spec_kinds=("state",))


def test_mamba_listed_in_skip_spec_kinds_is_skipped() -> None:
    caches = {"g": [torch.randn(NB, 4, 8).to(BF16)], "a": kv(block=64)}
    cfg = config((["g"], kvi.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(BF16,))), (["a"], full(block=64)))
    layout = discover_layout(cfg, caches, LayoutPolicy(chunk_tokens=64, skip_spec_kinds=("mamba",)))
    assert layout.groups[0].skipped and "skip_spec_kinds" in layout.groups[0].skip_reason


def test_chunk_slots_by_hand() -> None:
    """Block table [5, 9, 2, 7] of 16-token blocks, 32-token chunks."""
    caches = {"f": kv(nb=10), "w": kv(nb=10)}
    layout = discover_layout(config((["f"], full()), (["w"], window(8)), num_blocks=10), caches,
                             LayoutPolicy(chunk_tokens=32))
    table = [5, 9, 2, 7]
    f, w = layout.groups
    # chunk 1 = tokens 32..63 = logical blocks 2 and 3 -> physical 2 and 7
    assert chunk_slots(f, 32, table, [1]).tolist() == [list(range(32, 48)) + list(range(112, 128))]
    # a window of 8 keeps the whole last block of each chunk (vLLM frees blocks, not rows, and the CPU kernel reads
    # them whole): tokens 16..31 and 48..63
    assert chunk_slots(w, 32, table, [0, 1]).tolist() == [list(range(144, 160)), list(range(112, 128))]
    # block 0 is vLLM's null block (a freed sliding-window block), a missing block is not in the table
    assert chunk_slots(w, 32, [5, 0], [0]).tolist() == [[-1] * 16]
    assert chunk_slots(f, 32, [5], [0]).tolist() == [list(range(80, 96)) + [-1] * 16]


def test_chunk_slots_compressed_and_recurrent() -> None:
    mla, _ = ascend_spec_classes()
    c4 = mla(block_size=16, num_kv_heads=1, head_size=32, dtype=BF16, compress_ratio=4)  # 64 tokens per block
    mamba = kvi.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(BF16,), mamba_cache_mode="align")
    caches = {"c.attn": [torch.randn(NB, 16, 1, 32).to(BF16)], "m": [torch.randn(NB, 4, 8).to(BF16)]}
    layout = discover_layout(config((["c.attn"], c4), (["m"], mamba)), caches,
                             LayoutPolicy(chunk_tokens=128, hash_block_size=16))
    compressed, recurrent = layout.groups
    assert compressed.rows_per_chunk == 32 and recurrent.rows_per_chunk == 1
    # chunk 1 = tokens 128..255 = compressed rows 32..63 = logical blocks 2, 3 -> physical 4, 1
    assert chunk_slots(compressed, 128, [3, 5, 4, 1], [1]).tolist() == [list(range(64, 80)) + list(range(16, 32))]
    # the state after token 255 lives in logical block 3
    assert chunk_slots(recurrent, 128, [3, 5, 4, 1], [0, 1]).tolist() == [[5], [1]]


@pytest.mark.parametrize("window,block,kept", [(32, 128, 128), (128, 16, 128), (129, 128, 128), (130, 128, 256),
                                               (1024, 128, 1024), (1, 16, 16)])
def test_a_window_keeps_the_whole_blocks_it_reaches(window: int, block: int, kept: int) -> None:
    assert kept_window_tokens(window, block) == kept


def test_a_chunk_ending_inside_a_block_stores_whole_chunks_of_a_window() -> None:
    caches = {"f": kv(nb=10), "w": kv(nb=10)}
    aligned = discover_layout(config((["f"], full()), (["w"], window(8)), num_blocks=10), caches,
                              LayoutPolicy(chunk_tokens=32))
    assert aligned.groups[1].stored_tokens == 16
    caches = {"f": kv(nb=10, block=8), "w": kv(nb=10, block=32)}
    inside = discover_layout(config((["f"], full(block=8)), (["w"], window(8, block=32)), num_blocks=10), caches,
                             LayoutPolicy(chunk_tokens=16))  # chunk 1 ends at 32, chunk 0 inside the first block
    assert inside.groups[1].stored_tokens == 16


def test_a_group_vllm_excludes_from_kv_transfer_is_skipped() -> None:
    """vLLM >= 0.32 marks replica groups (HiSparse) `enable_kv_transfer=False`: rebuilt after a load, never moved."""
    from types import SimpleNamespace

    k, v = kv()
    replica_k, replica_v = kv()
    groups = [kvi.KVCacheGroupSpec(["a"], full()),
              SimpleNamespace(layer_names=["replica"], kv_cache_spec=full(), enable_kv_transfer=False)]
    layout = discover_layout(kvi.KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups),
                             {"a": (k, v), "replica": (replica_k, replica_v)}, LayoutPolicy(chunk_tokens=32))
    moved, replica = layout.groups
    assert not moved.skipped and replica.skipped and "enable_kv_transfer=False" in replica.skip_reason
    assert len(layout.plan.moved_planes) == 2  # only a's K and V
