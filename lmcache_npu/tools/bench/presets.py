"""Bench presets: the layout presets (one source of truth), materialised with block tables for N chunks."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ...layout.discovery import KVLayout
from ..presets import PresetKV, preset_layout, preset_names
from ...layout.slots import layout_slots
from .geometry import Materialized

PRESETS = tuple(preset_names())


def blocks_for(layout: KVLayout, kv_cache_config: object, chunks: int) -> list[int]:
    """Blocks each scheduler group needs to hold `chunks` chunks of one request."""
    tokens = chunks * layout.plan.chunk_tokens
    needed = []
    for gi in range(len(kv_cache_config.kv_cache_groups)):  # type: ignore[attr-defined]
        per_block = max((g.tokens_per_block for g in layout.groups if g.scheduler_group == gi), default=1)
        needed.append(math.ceil(tokens / per_block))
    return needed


def block_tables(needed: list[int], num_blocks: int, generator: torch.Generator) -> list[np.ndarray]:
    """Disjoint, shuffled block ids per scheduler group from one pool, block 0 left as vLLM's null block."""
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).numpy()
    tables, cursor = [], 0
    for n in needed:
        tables.append(pool[cursor:cursor + n])
        cursor += n
    return tables


def materialize_preset(name: str, chunks: int, device: torch.device, seed: int = 0,
                       chunk_tokens: Optional[int] = None, device_family: str = "ascend",
                       skip_spec_kinds: Optional[tuple[str, ...]] = None) -> tuple[Materialized, KVLayout, PresetKV]:
    """The preset allocated with room for `chunks` chunks of one request, and that request's chunk slots."""
    options = {} if skip_spec_kinds is None else {"skip_spec_kinds": skip_spec_kinds}
    probe, preset = preset_layout(name, device_family, chunk_tokens, num_blocks=2, **options)
    needed = blocks_for(probe, preset.kv_cache_config, chunks)
    layout, preset = preset_layout(name, device_family, probe.plan.chunk_tokens, num_blocks=1 + sum(needed),
                                   seed=seed, device=device, **options)
    tables = block_tables(needed, 1 + sum(needed), torch.Generator().manual_seed(seed + 1))
    slots = layout_slots(layout, tables, np.arange(chunks))
    tensors = [None if s is None else torch.from_numpy(s) for s in slots]
    return Materialized(layout.plan, tensors, preset.allocations, tables), layout, preset
