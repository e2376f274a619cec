"""Layout discovery: from vLLM's KV-cache config and registered tensors to a TransferPlan (DESIGN §6)."""

from .components import Component, collect_components, layer_components, nz_component, paged_component

__all__ = ["Component", "collect_components", "layer_components", "nz_component", "paged_component"]
