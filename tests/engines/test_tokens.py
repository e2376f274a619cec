"""Cold then warm: the same prompts computed, then loaded from the plugin, give the same greedy tokens and top-5
logprobs within 1e-4 (fp32; the MoE models' bf16 weights give exact ties or nothing), for every model the CPU
engine runs, through the AscendC kernel source (emu) and the torch backend. vLLM's own prefix cache is off, or
emptied before the warm run, so every hit is the plugin's."""

from __future__ import annotations

import numpy as np
import pytest

from .compare import assert_identical, prompt
from .conftest import ENGINE_VLLM

PROMPT_TOKENS = 700
DECODE_STEPS = 32

RUNS_EVERYWHERE = ["llama", "gemma3", "gpt-oss", "qwen3-next"]


def _cold_then_warm(engine, prompts):
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    if engine.settings.prefix_caching:
        engine.reset_prefix_cache()
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    return cold, warm


def _expected_hit(engine, prompt_tokens: int) -> int:
    chunk = engine.scheduler_connector.scheduler_half.chunk_tokens
    return (prompt_tokens - 1) // chunk * chunk  # vLLM computes at least the prompt's last token


@pytest.mark.parametrize("backend", ["emu", "torch"])
@pytest.mark.parametrize("recipe", RUNS_EVERYWHERE)
def test_a_warm_run_matches_the_cold_run(engines, model_dirs, recipe: str, backend: str) -> None:
    engine = engines(recipe, model_dirs(recipe), extra_config={"backend": backend, "cpu_bytes": "256MiB"})
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(3)]
    cold, warm = _cold_then_warm(engine, prompts)
    assert [c.cached_tokens for c in cold] == [0, 0, 0]
    assert [w.cached_tokens for w in warm] == [_expected_hit(engine, PROMPT_TOKENS)] * 3
    assert_identical(cold, warm)
    worker = engine.worker_connector.worker_half
    assert worker.mover.backends[next(iter(worker.mover.backends))].name == backend


def test_a_deliberately_wrong_load_is_seen(engines, model_dirs, monkeypatch) -> None:
    """Negative control: loads that put every row one token late (row t gets token t-1's bytes, the chunk's last
    row goes to its first) must change the tokens or the logprobs beyond the tolerance: the comparison above would
    catch a wrong load."""
    from lmcache_npu.transfer import mover

    from lmcache_npu.replay.compare import differences

    right_slots = mover.KVMover._command_slots

    def one_token_late(self, command, plan, chunk):
        slots = right_slots(self, command, plan, chunk)
        if type(plan).__name__ != "LoadPlan":
            return slots
        return [np.roll(matrix, 1, axis=1) for matrix in slots]  # row r lands where row r + 1 belongs

    engine = engines("llama", model_dirs("llama"), extra_config={"cpu_bytes": "256MiB"})
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(3)]
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    monkeypatch.setattr(mover.KVMover, "_command_slots", one_token_late)
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    assert [w.cached_tokens for w in warm] == [512] * 3  # the wrong rows were loaded and used
    found = differences(cold, warm)
    assert len(found) == 3, f"a one-token shift went unnoticed for some request: {found}"


@pytest.mark.skipif(ENGINE_VLLM is not None and ENGINE_VLLM < (0, 29),
                    reason="vLLM 0.28's CPU MLA backend does not import: cannot import name "
                           "'compile_flash_attn_varlen_func_from_specs' from 'vllm.v1.attention.backends.fa_utils'")
def test_mla_loads_exactly_the_rows_the_prefill_wrote(engines, model_dirs) -> None:
    """DeepSeek-V2-style MLA: the loaded latent rows equal, byte for byte, the rows computing them wrote. (Its
    logprobs are not compared: vLLM's CPU MLA gives different logprobs for a prefix computed in another batch or
    read back as context, by up to 2e-2 without any plugin.)"""
    import torch

    engine = engines("deepseek-mla", model_dirs("deepseek-mla"), extra_config={"cpu_bytes": "256MiB"})
    half = engine.scheduler_connector.scheduler_half
    worker = engine.worker_connector.worker_half
    caches = dict(worker.kv_caches)  # layer -> its registered [blocks, 1, 16, 576] latent cache
    finished: list[list[int]] = []
    original = half.request_finished

    def remember(request, block_ids):
        finished.append(list(block_ids[0]))
        return original(request, block_ids)

    half.request_finished = remember
    text = prompt(PROMPT_TOKENS, 5)
    engine.generate([text[:512]], 1)
    written = {layer: cache[torch.tensor(finished[0][:32])].clone() for layer, cache in caches.items()}
    warm = engine.generate([text], 4)
    assert warm[0].cached_tokens == 512
    for layer, cache in caches.items():
        loaded = cache[torch.tensor(finished[1][:32])]
        assert torch.equal(loaded, written[layer]), f"{layer}: loaded latent rows differ from the computed ones"
