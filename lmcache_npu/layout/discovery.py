"""From vLLM's KVCacheConfig and the register_kv_caches dict to a TransferPlan that explains itself (DESIGN §6).

A scheduler group (one block table) may hold layers of several geometries (DeepSeek-V4 on CUDA puts c4 and
c128 MLA in one UniformTypeKVCacheSpecs group): those become several plan groups that share the scheduler
group's block table. Plan groups keep scheduler order, then first appearance inside a scheduler group.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ..checks import hash_blocks_per_chunk
from ..ops import GroupSpec, PageLayout, Plane, TransferPlan
from .components import (
    Component,
    CoveringView,
    KVPacking,
    KVValue,
    collect_components,
    drop_covering_views,
    packing_of,
)
from .specs import NEVER_REUSED, LayerSpec, SpecKind, is_compressor_state_layer, layer_specs_of_group

logger = logging.getLogger(__name__)

# 128: one CPU/Ascend block, the unit vLLM's block-keyed connectors reuse; measured better than 256 against the
# peer (issue 22, docs/performance.md "The peer")
DEFAULT_CHUNK_TOKENS = 128
# Nothing by default: state windows are never stored whole, but the boundary rows an exact restore reads are.
DEFAULT_SKIP_SPEC_KINDS: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayoutPolicy:
    """What discovery may decide for the user: chunk size, hash granularity, which spec kinds to skip."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # by hand (presets, benches, tests); the connector passes its own
    skip_spec_kinds: tuple[str, ...] = DEFAULT_SKIP_SPEC_KINDS
    hash_block_size: Optional[int] = None  # None: the GCD of the group block sizes, as vLLM derives it
    fractal_nz: bool = False  # 310P: K/V pages are FRACTAL_NZ
    tp_size: int = 1  # tensor-parallel ranks of the engine; > 1 lets planes be marked replicated
    total_kv_heads: Optional[int] = None  # the model's KV heads before TP splits them (None: unknown, none shared)

    def __post_init__(self) -> None:
        valid = sorted(k.value for k in SpecKind)
        unknown = sorted(set(self.skip_spec_kinds) - set(valid))
        if unknown:
            raise ValueError(f"skip_spec_kinds: unknown spec kinds {unknown}; valid kinds are {valid}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.hash_block_size is not None and self.hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {self.hash_block_size}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.total_kv_heads is not None and self.total_kv_heads < 1:
            raise ValueError(f"total_kv_heads must be >= 1 or None, got {self.total_kv_heads}")


@dataclass(frozen=True)
class PlaneInfo:
    """One plane as a person reads it."""

    name: str
    layers: tuple[str, ...]
    payload_index: int  # position in the layer's registered value (K=0/V=1 of a flash tensor, tuple index)
    dtype: str
    row_bytes: int
    block_stride_bytes: int
    layout: str


@dataclass(frozen=True)
class LayoutGroup:
    """One plan group: layers of one scheduler group with one geometry."""

    index: int
    scheduler_group: int
    spec: str
    kind: SpecKind
    layers: tuple[str, ...]
    block_size: int
    geometry: GroupSpec  # what the plan moves of this group (its tokens per block, ratio, stored window, skip)
    rows_per_block: int
    sliding_window: Optional[int]  # the spec's window (the stored one is `geometry.sliding_window`)
    stored_tokens: int  # the tail of each chunk whose rows are stored (chunk_tokens unless windowed)
    rows_per_chunk: int
    recurrent: bool
    note: str
    planes: tuple[PlaneInfo, ...]
    exact_restore: bool = True
    chunk_tokens: int = 0
    replicated: bool = False  # the ranks of each share group hold the same bytes of this group (`share_ranks`)

    @property
    def tokens_per_block(self) -> int:
        return self.geometry.tokens_per_block

    @property
    def compress_ratio(self) -> int:
        return self.geometry.compress_ratio

    @property
    def skipped(self) -> bool:
        return self.geometry.skip

    @property
    def skip_reason(self) -> str:
        return self.geometry.skip_reason

    @property
    def keeps_blocks(self) -> bool:
        """vLLM keeps this group's blocks until the request ends (full attention, MLA); the other kinds free blocks
        that fall out of their window, or overwrite a recurrent state block, as the request advances."""
        return self.kind in (SpecKind.FULL_ATTENTION, SpecKind.MLA)

    @property
    def windowed(self) -> bool:
        """Blocks are freed once they fall out of `sliding_window` tokens behind the next token."""
        return self.kind in (SpecKind.SLIDING_WINDOW, SpecKind.SLIDING_WINDOW_MLA, SpecKind.COMPRESSOR_STATE)

    @property
    def stored(self) -> str:
        """What a chunk keeps of this group: all, tail, boundary, chunk-end state, or skipped."""
        if self.skipped:
            return "skipped"
        if self.kind == SpecKind.COMPRESSOR_STATE:
            return "boundary"
        if self.recurrent:
            return "chunk-end state"
        return "tail" if self.stored_tokens < self.chunk_tokens else "all"

    def to_json(self) -> dict[str, Any]:
        counts: dict[tuple[str, str, int], int] = {}
        for p in self.planes:
            key = (p.name.rsplit(":", 1)[-1], p.dtype, p.row_bytes)
            counts[key] = counts.get(key, 0) + 1
        return {
            "index": self.index,
            "scheduler_group": self.scheduler_group,
            "spec": self.spec,
            "kind": self.kind.value,
            "layers": len(self.layers),
            "tokens_per_block": self.tokens_per_block,
            "compress_ratio": self.compress_ratio,
            "sliding_window": self.sliding_window,
            "skipped": self.skipped,
            "skip_reason": self.skip_reason,
            "recurrent": self.recurrent,
            "stored": self.stored,
            "exact_restore": self.exact_restore,
            "replicated": self.replicated,
            "rows_per_chunk": 0 if self.skipped else self.rows_per_chunk,
            "note": self.note,
            "planes": [{"role": role, "count": n, "dtype": dtype, "row_bytes": row_bytes,
                        "rows_per_chunk": 0 if self.skipped else self.rows_per_chunk}
                       for (role, dtype, row_bytes), n in counts.items()],
        }


@dataclass(frozen=True)
class KVLayout:
    """The plan plus everything a person (or the connector) needs to know about how it was derived."""

    plan: TransferPlan
    groups: tuple[LayoutGroup, ...]
    hash_block_size: int
    aliases: Mapping[str, str] = field(default_factory=dict)  # layer -> the layer whose KV it reads
    caveats: tuple[str, ...] = ()
    covering_views: tuple[CoveringView, ...] = ()  # views stored once, as the rows of the views they cover
    # consecutive TP ranks that hold identical bytes of the replicated groups and store them once (1: none)
    share_ranks: int = 1

    @property
    def bytes_per_chunk(self) -> int:
        return self.plan.object_bytes

    @property
    def naive_bytes_per_chunk(self) -> int:
        return self.plan.object_bytes_naive()

    def to_json(self) -> dict[str, Any]:
        return {
            "chunk_tokens": self.plan.chunk_tokens,
            "hash_block_size": self.hash_block_size,
            "groups": [g.to_json() for g in self.groups],
            "bytes_per_chunk": self.bytes_per_chunk,
            "naive_bytes_per_chunk": self.naive_bytes_per_chunk,
            "caveats": list(self.caveats),
            "share_ranks": self.share_ranks,
        }


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8",
                torch.uint8: "uint8", torch.float8_e4m3fn: "fp8_e4m3"}


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    if dtype is None:
        return "-"
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _component_role(kind: SpecKind, components: Sequence[Component], index: int) -> str:
    """A readable name for a payload position (cosmetic: the plan never depends on it)."""
    if components[index].role:
        return components[index].role
    count = len(components)
    if kind == SpecKind.MAMBA:
        return f"state{index}"
    if count == 1:
        return components[0].layers[0].rsplit(".", 1)[-1]  # attn, swa_cache, k_cache, state_cache
    if kind in (SpecKind.FULL_ATTENTION, SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL) and count == 2:
        return ("k", "v")[index]
    first, second = components[0].dtype, components[1].dtype if count > 1 else None
    if count == 2 and first.itemsize == 1 and second is not None and second.is_floating_point and second.itemsize > 1:
        return ("k", "scale")[index]  # DeepSeek-V4 indexer: int8 (A5: fp8) keys and their fp16 (fp32) scales
    if 2 <= count <= 4:
        return ("nope", "rope", "indexer_k", "indexer_scale")[index]
    return f"t{index}"


def _owner_ratio(state_layer: str, specs: Mapping[str, LayerSpec]) -> int:
    """The compress ratio of the attention/indexer cache the compressor state feeds (longest shared name prefix)."""
    parts = state_layer.split(".")
    best, best_len = None, -1
    for name, s in specs.items():
        if s.kind != SpecKind.MLA or s.compress_ratio < 2:
            continue
        other = name.split(".")
        shared = 0
        while shared < min(len(parts), len(other)) and parts[shared] == other[shared]:
            shared += 1
        if shared > best_len:
            best, best_len = s, shared
    if best is None or best_len < 1:
        raise ValueError(f"layer {state_layer}: a compressor state cache with no compressed MLA layer beside it")
    return best.compress_ratio


@dataclass
class _Draft:
    scheduler_group: int
    specs: list[LayerSpec]
    skipped: bool = False
    skip_reason: str = ""
    stored_window: Optional[int] = None
    note: str = ""
    exact_restore: bool = True  # False: a skipped group the next step reads across the chunk boundary


def _geometry_key(s: LayerSpec) -> tuple:
    return (s.spec_class, s.kind, s.tokens_per_block, s.rows_per_block, s.compress_ratio, s.sliding_window,
            s.rows_are_tokens, s.prefix_cacheable, s.mamba_cache_mode, s.transferable)


def kept_window_tokens(sliding_window: int, tokens_per_block: int) -> int:
    """The tokens before a block-aligned position that vLLM keeps for a sliding window: the whole blocks the window
    reaches (it frees blocks, not rows), and some backends read every row of them (vLLM's CPU attention does)."""
    return max(1, -(-(sliding_window - 1) // tokens_per_block)) * tokens_per_block


_KEPT_WHOLE_BLOCKS = (SpecKind.SLIDING_WINDOW, SpecKind.SLIDING_WINDOW_MLA)


def _decide(draft: _Draft, policy: LayoutPolicy, all_specs: Mapping[str, LayerSpec]) -> None:
    """Skip flag, stored window and note of one plan group."""
    s = draft.specs[0]
    names = [x.layer for x in draft.specs]
    draft.stored_window = s.sliding_window
    if s.sliding_window is not None and s.kind in _KEPT_WHOLE_BLOCKS:
        draft.stored_window = kept_window_tokens(s.sliding_window, s.tokens_per_block)
    if not s.transferable:
        draft.skipped, draft.skip_reason = True, ("vLLM excludes this group from KV transfer (enable_kv_transfer=False: "
                                                  "a replica it rebuilds from another group after a load)")
        return
    if not s.prefix_cacheable:
        draft.skipped, draft.skip_reason = True, "vLLM marks this spec not prefix-cacheable"
        return
    if s.kind in NEVER_REUSED:
        draft.skipped, draft.skip_reason = True, NEVER_REUSED[s.kind]
        return
    if s.kind == SpecKind.COMPRESSOR_STATE:
        mismatched = [n for n in names if not is_compressor_state_layer(n)]
        if mismatched:
            raise ValueError(
                f"layers {mismatched[:3]}: an fp32 sliding-window MLA spec (a compressor state) on layers that are "
                "not compressor state caches; refusing to guess whether prefix reuse needs them"
            )
        ratio = _owner_ratio(names[0], all_specs)
        window = s.sliding_window or ratio
        if window % ratio or window // ratio not in (1, 2):
            raise ValueError(f"layer {names[0]}: compressor state window {window} is not 1 or 2 windows of "
                             f"ratio {ratio}")
        carried = window - ratio  # the overlapping window: tokens before a boundary the next compression reads
        reads = (f"the next ratio-{ratio} compression after a chunk boundary reads the kv/score state of the "
                 f"{carried} tokens before it")
        if carried == 0:
            draft.skipped, draft.skip_reason = True, (
                f"compressor state (ratio {ratio}, window {window}): restoring without it is exact, the next "
                f"compression reads no token before a {ratio}-aligned chunk boundary")
        elif s.kind.value in policy.skip_spec_kinds:
            draft.skipped, draft.exact_restore = True, False
            draft.skip_reason = (f"compressor state (ratio {ratio}, window {window}) listed in skip_spec_kinds; "
                                 f"restore is approximate: {reads}")
        else:
            draft.stored_window = carried
            draft.note = (f"compressor state (ratio {ratio}, window {window}): the window is not stored, only its "
                          f"last {carried} rows, because {reads}")
        return
    if s.kind.value in policy.skip_spec_kinds:
        draft.skipped, draft.skip_reason = True, f"spec kind {s.kind.value} is listed in skip_spec_kinds"
        return
    if s.kind == SpecKind.MAMBA:
        if s.mamba_cache_mode not in ("align", "all"):
            raise ValueError(
                f"layers {names[:3]}: mamba_cache_mode {s.mamba_cache_mode!r} keeps one running state per request, "
                "so no state exists at chunk boundaries; serve with --mamba-cache-mode align (or list 'mamba' in "
                "skip_spec_kinds to offload attention only, which makes every hit recompute)"
            )
        draft.stored_window = s.tokens_per_block  # one state: the one after the chunk's last token
        draft.note = f"recurrent state, one {s.tokens_per_block}-token checkpoint per block: the chunk-end state"


def _draft_groups(kv_cache_config: Any) -> tuple[list[_Draft], dict[str, LayerSpec]]:
    """Plan groups in scheduler order: one per distinct geometry inside each scheduler group."""
    layer_specs: dict[str, LayerSpec] = {}
    drafts: list[_Draft] = []
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        by_key: dict[tuple, _Draft] = {}
        for s in layer_specs_of_group(gi, group):
            if s.layer in layer_specs:
                raise ValueError(f"layer {s.layer} appears in more than one KV-cache group")
            layer_specs[s.layer] = s
            draft = by_key.get(_geometry_key(s))
            if draft is None:
                draft = by_key[_geometry_key(s)] = _Draft(gi, [])
                drafts.append(draft)
            draft.specs.append(s)
    return drafts, layer_specs


# Kinds whose cache every TP rank computes whole: an MLA latent (and its rope part, DSA indexer keys and scales,
# DeepSeek-V4's compressed, sliding and compressor caches) is not split by heads.
_LATENT_KINDS = (SpecKind.MLA, SpecKind.SLIDING_WINDOW_MLA, SpecKind.COMPRESSOR_STATE)
# Kinds that split KV heads across TP ranks: identical on every rank only when the model has a single KV head.
_HEAD_SPLIT_KINDS = (SpecKind.FULL_ATTENTION, SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL)


def replication_factor(kind: SpecKind, tp_size: int, total_kv_heads: Optional[int]) -> int:
    """How many consecutive TP ranks hold identical bytes of a group of this kind: the whole group for latent kinds;
    for head-split attention tp_size / heads when TP exceeds the KV heads (vLLM gives rank r head r // that), else
    1; 1 for recurrent states (split by heads) and where the heads are unknown (never guessed)."""
    if tp_size <= 1:
        return 1
    if kind in _LATENT_KINDS:
        return tp_size
    if kind in _HEAD_SPLIT_KINDS and total_kv_heads is not None and total_kv_heads < tp_size \
            and tp_size % total_kv_heads == 0:
        return tp_size // total_kv_heads
    return 1


def replicated_across_tp(kind: SpecKind, tp_size: int, total_kv_heads: Optional[int]) -> bool:
    """Whether every rank of a TP group of `tp_size` holds the same bytes for a group of this kind."""
    return tp_size > 1 and replication_factor(kind, tp_size, total_kv_heads) == tp_size


def share_group_ranks(factors: Sequence[int]) -> int:
    """The share group's size for groups replicated `factors`-fold: the largest run of consecutive ranks inside
    which every replicated group is identical (their gcd; 1 when nothing is replicated)."""
    replicated = [f for f in factors if f > 1]
    return math.gcd(*replicated) if replicated else 1


def _planes(components: Sequence[Component], drafts: Sequence[_Draft], plan_index: Mapping[str, int],
            num_blocks: int, replicated: Sequence[bool] = ()) -> tuple[list[Plane], list[list[PlaneInfo]]]:
    """One plane per component, named `layer:role`, in component order (payload order inside a layer)."""
    by_layer: dict[str, list[Component]] = {}
    for c in components:
        by_layer.setdefault(c.layers[0], []).append(c)
    planes: list[Plane] = []
    infos: list[list[PlaneInfo]] = [[] for _ in drafts]
    for c in components:
        gi = plan_index[c.layers[0]]
        if c.num_blocks != num_blocks:
            # fewer: the scheduler may hand out blocks past the end; more: block b may not be logical block b
            # (vllm-ascend's DCP-replicated indexer is [num_blocks x replicas, ...])
            raise ValueError(f"layer {c.layers[0]}, tensor {c.index}: {c.num_blocks} blocks, but the KV-cache config "
                             f"has num_blocks {num_blocks}; every paged tensor needs exactly one block per block id")
        siblings = by_layer[c.layers[0]]
        name = f"{c.layers[0]}:{_component_role(drafts[gi].specs[0].kind, siblings, siblings.index(c))}"
        shared = bool(replicated[gi]) if replicated else False
        planes.append(Plane(c.pages, gi, c.rows_per_block, c.row_bytes, c.layout, c.nz_unit_bytes, c.dtype, name,
                            shared))
        infos[gi].append(PlaneInfo(name, tuple(c.layers), c.index, dtype_name(c.dtype), c.row_bytes,
                                   c.block_stride_bytes, "fractal_nz" if c.layout == PageLayout.FRACTAL_NZ else "nd"))
    return planes, infos


def _granularity(s: LayerSpec) -> int:
    """Tokens per stored row (a mamba state covers its block); packed fp8 rows move as whole blocks."""
    return s.compress_ratio if s.rows_are_tokens else s.tokens_per_block


def _finish_group(gi: int, d: _Draft, chunk_tokens: int, infos: Sequence[PlaneInfo],
                  replicated: bool = False) -> LayoutGroup:
    """Checks the chunk against the group's granularity and fixes what each chunk stores of it."""
    s = d.specs[0]
    where = (f"group {gi} ({s.spec_class}, scheduler group {d.scheduler_group}, "
             f"layers {[x.layer for x in d.specs][:3]})")
    recurrent = s.kind == SpecKind.MAMBA
    granularity = _granularity(s)
    stored = chunk_tokens if d.stored_window is None else min(chunk_tokens, d.stored_window)
    if not d.skipped and chunk_tokens % granularity:
        unit = ("one state per block" if recurrent else "one compressed row per ratio tokens" if s.rows_are_tokens
                else "rows pack with their scales, whole blocks only")
        raise ValueError(f"{where}: chunk_tokens {chunk_tokens} is not a multiple of the group's token "
                         f"granularity {granularity} ({unit})")
    if not d.skipped and stored % granularity:
        raise ValueError(f"{where}: the stored tail of {stored} tokens is not a multiple of the group's token "
                         f"granularity {granularity}")
    geometry = GroupSpec(s.tokens_per_block, s.compress_ratio, d.stored_window, d.skipped, d.skip_reason,
                         f"{s.kind.value}#{gi}")
    return LayoutGroup(
        index=gi, scheduler_group=d.scheduler_group, spec=s.spec_class, kind=s.kind,
        layers=tuple(x.layer for x in d.specs), block_size=s.block_size, geometry=geometry,
        rows_per_block=s.rows_per_block, sliding_window=s.sliding_window,
        stored_tokens=stored, rows_per_chunk=stored // s.compress_ratio, recurrent=recurrent, note=d.note, planes=tuple(infos),
        exact_restore=d.exact_restore, chunk_tokens=chunk_tokens, replicated=replicated and not d.skipped)


def _decided_drafts(kv_cache_config: Any, policy: LayoutPolicy) -> tuple[list[_Draft], dict[str, LayerSpec]]:
    if not kv_cache_config.kv_cache_groups:
        raise ValueError("the KV-cache config has no groups: an attention-free model has no KV cache to offload")
    drafts, layer_specs = _draft_groups(kv_cache_config)
    for d in drafts:
        _decide(d, policy, layer_specs)
    return drafts, layer_specs


def token_granularity(kv_cache_config: Any, policy: Optional[LayoutPolicy] = None) -> int:
    """The smallest chunk every stored group can take, from the specs alone: the LCM of each group's token
    granularity (one compressed row, one packed block, one recurrent state) and of its stored window's."""
    drafts, _ = _decided_drafts(kv_cache_config, policy or LayoutPolicy())
    unit = 1
    for d in drafts:
        if d.skipped:
            continue
        granularity = _granularity(d.specs[0])
        unit = math.lcm(unit, granularity)
        if d.stored_window is not None and d.stored_window % granularity:
            raise ValueError(f"layers {[x.layer for x in d.specs][:3]}: the stored window of {d.stored_window} "
                             f"tokens is not a multiple of the group's token granularity {granularity}")
    return unit


def default_chunk_tokens(granularity: int, hash_block_size: int = 1, target: int = DEFAULT_CHUNK_TOKENS) -> int:
    """The smallest multiple of the group granularity and vLLM's hash block that holds `target` tokens."""
    if granularity < 1 or hash_block_size < 1 or target < 1:
        raise ValueError(f"default_chunk_tokens needs positive sizes, got granularity={granularity}, "
                         f"hash_block_size={hash_block_size}, target={target}")
    unit = math.lcm(granularity, hash_block_size)
    return unit * max(1, -(-target // unit))


def discover_layout(kv_cache_config: Any, kv_caches: Mapping[str, KVValue],
                    policy: Optional[LayoutPolicy] = None,
                    attention_backends: Optional[Mapping[str, str]] = None) -> KVLayout:
    """Validates what vLLM handed the connector and plans every non-skipped group's chunk rows.
    `attention_backends` (layer -> backend name) tells how backends that pack rows their own way lay them out."""
    policy = policy or LayoutPolicy()
    packings: dict[str, KVPacking] = {layer: packing_of(name) for layer, name in (attention_backends or {}).items()}
    drafts, layer_specs = _decided_drafts(kv_cache_config, policy)
    missing = [n for n in layer_specs if n not in kv_caches]
    if missing:
        raise ValueError(f"layers {missing[:5]} are in the KV-cache config but register_kv_caches gave no tensor")
    aliases = _kv_sharing_aliases(kv_caches, layer_specs)
    plan_index = {s.layer: i for i, d in enumerate(drafts) for s in d.specs}
    components = collect_components({n: v for n, v in kv_caches.items() if n not in aliases},
                                    {n: s.rows_per_block for n, s in layer_specs.items()},
                                    policy.fractal_nz, scope=plan_index, packings=packings)
    components, covering = drop_covering_views(components, scope=plan_index)
    _note_covering_views(covering, drafts, plan_index)
    factors = [replication_factor(d.specs[0].kind, policy.tp_size, policy.total_kv_heads) for d in drafts]
    share_ranks = share_group_ranks(factors)
    replicated = [share_ranks > 1 and f % share_ranks == 0 for f in factors]
    planes, infos = _planes(components, drafts, plan_index, int(kv_cache_config.num_blocks), replicated)
    for d in drafts:
        s = d.specs[0]
        if d.stored_window is not None and s.kind in _KEPT_WHOLE_BLOCKS and policy.chunk_tokens % s.tokens_per_block:
            d.stored_window = None  # a chunk end inside a block: the window's first block starts in earlier chunks
    groups = tuple(_finish_group(gi, d, policy.chunk_tokens, infos[gi], replicated[gi]) for gi, d in enumerate(drafts))
    block_sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
    hash_block = policy.hash_block_size or math.gcd(*block_sizes)
    hash_blocks_per_chunk(policy.chunk_tokens, hash_block)
    plan = TransferPlan([g.geometry for g in groups], planes, policy.chunk_tokens)
    caveats = tuple(f"group {g.index}: {g.skip_reason}" for g in groups if not g.exact_restore)
    for caveat in caveats:
        logger.warning("%s (exact restores: drop 'compressor_state' from skip_spec_kinds)", caveat)
    return KVLayout(plan, groups, hash_block, aliases, caveats, tuple(covering), share_ranks)


def _note_covering_views(covering: Sequence[CoveringView], drafts: Sequence[_Draft],
                         plan_index: Mapping[str, int]) -> None:
    """Says, in each plan group's note, which registered views are stored once as the views they cover."""
    by_group: dict[int, list[CoveringView]] = {}
    for view in covering:
        by_group.setdefault(plan_index[view.layers[0]], []).append(view)
    for gi, views in by_group.items():
        first = views[0]
        under = ", ".join(str(index) for _, index in first.covered_by)
        text = (f"{len(views)} layer(s) register a view (payload {first.index}, {dtype_name(first.dtype)} rows of "
                f"{first.row_bytes} B) over the same bytes as payloads {under}: stored once, as their rows; a load "
                "fills it through them")
        drafts[gi].note = f"{drafts[gi].note}; {text}" if drafts[gi].note else text
        logger.info("group %d: %s (first layer %s)", gi, text, first.layers[0])


def _same_memory(a: KVValue, b: KVValue) -> bool:
    ta = [a] if isinstance(a, torch.Tensor) else list(a)
    tb = [b] if isinstance(b, torch.Tensor) else list(b)
    return len(ta) == len(tb) and all(
        x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
        for x, y in zip(ta, tb))


def _kv_sharing_aliases(kv_caches: Mapping[str, KVValue], specs: Mapping[str, LayerSpec]) -> dict[str, str]:
    """Layers registered without a spec must reuse another layer's KV (vLLM cross-layer KV sharing)."""
    aliases = {}
    for name, value in kv_caches.items():
        if name in specs:
            continue
        if not isinstance(value, (torch.Tensor, tuple, list)):
            raise ValueError(f"layer {name}: expected a Tensor or a tuple/list of Tensors, got {type(value).__name__}")
        target = next((t for t in specs if _same_memory(value, kv_caches[t])), None)
        if target is None:
            raise ValueError(f"layer {name} has KV tensors but no KV-cache spec in any group, and does not share "
                             "another layer's KV cache")
        aliases[name] = target
    return aliases
