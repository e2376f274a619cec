"""The plugin inside vLLM's real MultiConnector, beside a connector with a handshake of its own (NixlConnector's
shape: tests/integration/pd_stub.py), in either order, in a real CPU engine: the engine starts, the plugin's plans
reach its scheduler half with the workers' first step, and a warm run is loaded by the plugin with the cold run's
tokens and logprobs."""

from __future__ import annotations

import pytest

from lmcache_npu.tools.replay.configs import PLUGIN, PLUGIN_CONNECTOR, RunConfig
from lmcache_npu.tools.replay.connectors import ConnectorServices, transfer_config
from lmcache_npu.tools.replay.engine import Engine, EngineSettings

from .compare import assert_identical, prompt

PROMPT_TOKENS = 700


def _multi(beside: str) -> dict:
    ours = transfer_config(RunConfig(PLUGIN, PLUGIN_CONNECTOR, {"cpu_bytes": "256MiB"}), ConnectorServices())
    assert ours is not None
    stub = {"kv_connector": "PDStubConnector", "kv_connector_module_path": "tests.integration.pd_stub",
            "kv_role": "kv_both"}
    children = [stub, ours] if beside == "before" else [ours, stub]
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": children}}


@pytest.mark.parametrize("beside", ["before", "after"])
def test_the_plugin_serves_warm_runs_beside_a_handshaking_connector(model_dirs, beside: str) -> None:
    settings = EngineSettings.for_recipe("llama", model_dirs("llama"))
    with Engine(settings, transfer=_multi(beside)) as engine:
        children = engine.engine_core.scheduler.connector._connectors
        plugin = next(c for c in children if type(c).__name__ == "LMCacheNPUConnector")
        stub = next(c for c in children if type(c).__name__ == "PDStubConnector")
        assert stub.handshakes and all(type(m).__name__ == "StubHandshake" for m in stub.handshakes.values())
        prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(2)]
        cold = engine.generate(prompts, 16, logprobs=5)
        half = plugin.scheduler_half
        assert half.index is not None and half.composed  # the plans came with the workers' first step
        warm = engine.generate(prompts, 16, logprobs=5)  # vLLM's own prefix cache is off: hits are the plugin's
        chunk = half.chunk_tokens
        assert [w.cached_tokens for w in warm] == [(PROMPT_TOKENS - 1) // chunk * chunk] * 2
        assert_identical(cold, warm, settings.dtype)
        assert stub.served == []
