"""Layout discovery: from vLLM's KV-cache config and registered tensors to a TransferPlan (DESIGN §6)."""

from .components import Component, collect_components, layer_components, nz_component, paged_component
from .discovery import (
    DEFAULT_SKIP_SPEC_KINDS,
    KVLayout,
    LayoutGroup,
    LayoutPolicy,
    PlaneInfo,
    discover_layout,
    token_granularity,
)
from .slots import chunk_slots, layout_slots, row_tokens, stored_block_span
from .specs import KNOWN_SPEC_CLASSES, LayerSpec, SpecKind, read_layer_spec

__all__ = [
    "DEFAULT_SKIP_SPEC_KINDS",
    "KNOWN_SPEC_CLASSES",
    "Component",
    "KVLayout",
    "LayerSpec",
    "LayoutGroup",
    "LayoutPolicy",
    "PlaneInfo",
    "SpecKind",
    "chunk_slots",
    "collect_components",
    "discover_layout",
    "layer_components",
    "layout_slots",
    "nz_component",
    "paged_component",
    "read_layer_spec",
    "row_tokens",
    "stored_block_span",
    "token_granularity",
]
