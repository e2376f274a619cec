"""Cold then warm: the same prompts computed, then loaded from the plugin, hold byte-identical full-attention rows
and give the same greedy tokens and top-5 logprobs (within 1e-4 for fp32 models; the bf16 MoE models within their
rounding, near ties aside: `lmcache_npu.tools.replay.compare`), for every model the CPU engine runs, through the AscendC
kernel source (emu) and the torch backend. vLLM's own prefix cache is off, or emptied before the warm run, so every
hit is the plugin's."""

from __future__ import annotations

import time

import pytest

from .compare import assert_identical, prompt
from .rows import RowRecorder, assert_same_prefix_rows
from .conftest import ENGINE_VLLM

PROMPT_TOKENS = 700
DECODE_STEPS = 32

RUNS_EVERYWHERE = ["llama", "gemma3", "gpt-oss", "qwen3-next"]


def _settle_stores(engine, timeout_s: float = 120.0) -> None:
    """Steps the engine (a 3-token request: no chunk, no store, no slice) until the plugin has no command queued or
    in flight: on a loaded machine the cold run's last stores can still be copying when it returns, and a chunk
    being written is a miss for the warm run."""
    index = engine.scheduler_connector.scheduler_half.index
    deadline = time.monotonic() + timeout_s
    while index.in_flight or index.queued_commands():
        assert time.monotonic() < deadline, "the cold run's stores never finished"
        engine.generate([[1, 2, 3]], 1)


def _cold_then_warm(engine, prompts):
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    _settle_stores(engine)
    if engine.settings.prefix_caching:
        engine.reset_prefix_cache()
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    return cold, warm


def _load_rows_one_token_late(monkeypatch) -> None:
    """From now on loads put every row one token late: row t gets token t-1's bytes, a chunk's last row its first."""
    from lmcache_npu.transfer import mover

    from ..late_rows import loads_one_token_late

    monkeypatch.setattr(mover.KVMover, "_cut_runs", loads_one_token_late(mover.KVMover._cut_runs))


def _assert_warm_run_loaded_the_cold_rows(engine, rows, prompts, cold, warm) -> None:
    """Every warm prompt hit its whole-chunk prefix, loaded exactly the rows its cold run computed, and generated the
    cold run's tokens."""
    hit = _expected_hit(engine, PROMPT_TOKENS)
    lost = _lost_hits(engine)  # read on every run, so the message cannot break when it is needed
    assert [w.cached_tokens for w in warm] == [hit] * len(prompts), f"why hits were lost: {lost}"
    for text in prompts:
        computed, loaded = rows.of(text)
        assert_same_prefix_rows(computed, loaded, hit)
    assert_identical(cold, warm, engine.settings.dtype)


def _lost_hits(engine) -> dict[str, float]:
    """Every non-zero counter of both halves (the lookups, claims, declines, failures and refusals among them): a warm
    run that misses under load names its path."""
    halves = {"scheduler": engine.scheduler_connector.scheduler_half, "worker": engine.worker_connector.worker_half}
    return {f"{side} {name}": value for side, half in halves.items()
            for name, value in half.counters.snapshot().items() if value}


def _expected_hit(engine, prompt_tokens: int) -> int:
    chunk = engine.scheduler_connector.scheduler_half.chunk_tokens
    return (prompt_tokens - 1) // chunk * chunk  # vLLM computes at least the prompt's last token


@pytest.mark.parametrize("backend", ["emu", "torch"])
@pytest.mark.parametrize("recipe", RUNS_EVERYWHERE)
def test_a_warm_run_matches_the_cold_run(engines, model_dirs, recipe: str, backend: str) -> None:
    engine = engines(recipe, model_dirs(recipe), extra_config={"backend": backend, "cpu_bytes": "256MiB"})
    rows = RowRecorder(engine)
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(3)]
    cold, warm = _cold_then_warm(engine, prompts)
    assert [c.cached_tokens for c in cold] == [0, 0, 0]
    _assert_warm_run_loaded_the_cold_rows(engine, rows, prompts, cold, warm)
    worker = engine.worker_connector.worker_half
    assert worker.mover.backends[next(iter(worker.mover.backends))].name == backend


def test_a_deliberately_wrong_load_is_seen(engines, model_dirs, monkeypatch) -> None:
    """Negative control: loads that put every row one token late (row t gets token t-1's bytes, the chunk's last
    row goes to its first) must change the tokens or the logprobs beyond the tolerance: the comparison above would
    catch a wrong load."""
    from lmcache_npu.tools.replay.compare import differences

    engine = engines("llama", model_dirs("llama"), extra_config={"cpu_bytes": "256MiB"})
    prompts = [prompt(PROMPT_TOKENS, seed) for seed in range(3)]
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    _load_rows_one_token_late(monkeypatch)
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    lost = _lost_hits(engine)
    assert [w.cached_tokens for w in warm] == [_expected_hit(engine, PROMPT_TOKENS)] * 3, (  # the wrong rows were used
        f"why hits were lost: {lost}")
    found = differences(cold, warm)
    assert len(found) == 3, f"a one-token shift went unnoticed for some request: {found}"


@pytest.mark.parametrize("wrong", ["one_token_late", "nothing_written"])
def test_a_deliberately_wrong_load_is_seen_in_the_rows(engines, model_dirs, monkeypatch, wrong: str) -> None:
    """Negative controls of the row check on a bf16 model, whose logprobs barely notice a one-token shift (0.01-0.02,
    within its rounding): the loaded rows must differ from the computed ones, also where the load wrote nothing into
    blocks the writer just freed (the recorder poisons a load's blocks first)."""
    from lmcache_npu.ops import Direction

    from ..integration.wrappers import Hollow

    engine = engines("gpt-oss", model_dirs("gpt-oss"), extra_config={"cpu_bytes": "256MiB"})
    rows = RowRecorder(engine)
    text = prompt(PROMPT_TOKENS, 7)
    engine.generate([text], 2)
    if wrong == "one_token_late":
        _load_rows_one_token_late(monkeypatch)
    else:
        mover = engine.worker_connector.worker_half.mover
        mover.set_backend(Direction.LOAD, Hollow(mover.backends[Direction.LOAD]))
    hit = _expected_hit(engine, PROMPT_TOKENS)
    assert engine.generate([text], 2)[0].cached_tokens == hit
    computed, loaded = rows.of(text)
    with pytest.raises(AssertionError, match="differ from the rows computing them wrote"):
        assert_same_prefix_rows(computed, loaded, hit)


@pytest.mark.skipif(ENGINE_VLLM is not None and ENGINE_VLLM < (0, 29),
                    reason="vLLM 0.28's CPU MLA backend does not import: cannot import name "
                           "'compile_flash_attn_varlen_func_from_specs' from 'vllm.v1.attention.backends.fa_utils'")
def test_mla_loads_exactly_the_rows_the_prefill_wrote(engines, model_dirs) -> None:
    """DeepSeek-V2-style MLA: the loaded latent rows equal, byte for byte, the rows computing them wrote. (Its
    logprobs are not compared: vLLM's CPU MLA gives different logprobs for a prefix computed in another batch or
    read back as context, by up to 2e-2 without any plugin.)"""
    engine = engines("deepseek-mla", model_dirs("deepseek-mla"), extra_config={"cpu_bytes": "256MiB"})
    rows = RowRecorder(engine)  # the latent caches are [blocks, 1, 16, 576]
    text = prompt(PROMPT_TOKENS, 5)
    engine.generate([text[:512]], 1)
    warm = engine.generate([text], 4)
    assert warm[0].cached_tokens == 512
    (computed,), (loaded,) = rows.of(text[:512]), rows.of(text)
    assert_same_prefix_rows(computed, loaded, 512)
