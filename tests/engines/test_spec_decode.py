"""Speculative decoding in a real vLLM CPU engine: ngram (prompt lookup), the method vLLM's CPU engine runs without a
draft model. With a speculative config vLLM defers `wait_for_save` and `clear_connector_metadata` until after
drafting (`finalize_kv_connector`), so the plugin's `get_finished` runs before the step's stores are queued; the
tokens must stay those of an engine without the plugin, the repeated prompts must hit the plugin, and the drafts
must still be accepted (the acceptance rate read from vLLM's spec-decode counters is logged for the report)."""

from __future__ import annotations

import logging

from .compare import assert_identical, prompt

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 700
DECODE_STEPS = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _repetitive(seed: int) -> list[int]:
    """A prompt made of one 50-token phrase over and over (a random tail breaks exact periodicity): prompt lookup
    finds every 2..4-gram earlier in it, so ngram always has drafts to offer."""
    phrase = prompt(50, seed)
    text = (phrase * (PROMPT_TOKENS // len(phrase) + 1))[:PROMPT_TOKENS - 20]
    return text + prompt(20, 1000 + seed)


def _acceptance(engine) -> tuple[float, float]:
    """(accepted, drafted) speculative tokens so far, from vLLM's own Prometheus counters."""
    return (engine.vllm_counter("vllm:spec_decode_num_accepted_tokens"),
            engine.vllm_counter("vllm:spec_decode_num_draft_tokens"))


def test_ngram_tokens_match_an_engine_without_the_plugin_and_hits_load(engines, model_dirs) -> None:
    recipe = "llama"
    prompts = [_repetitive(seed) for seed in range(3)]
    spec = {"speculative_config": dict(NGRAM)}
    plain = engines(recipe, model_dirs(recipe), plugin=False, engine_args=spec)
    reference = plain.generate(prompts, DECODE_STEPS, logprobs=5)
    plain_accepted, plain_drafted = _acceptance(plain)
    plain.close()

    # load-all: the test is about spec decode over loaded rows; on a CPU engine the cost model may rightly compute a
    # 640-token prefix instead (it did on vLLM 0.28), and the cut point has tests of its own (test_cut_point.py)
    engine = engines(recipe, model_dirs(recipe), extra_config={"cpu_bytes": "256MiB", "load_policy": "load-all"},
                     engine_args=spec)
    worker = engine.worker_connector.worker_half
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    accepted, drafted = _acceptance(engine)

    chunk = engine.scheduler_connector.scheduler_half.chunk_tokens
    hit = (PROMPT_TOKENS - 1) // chunk * chunk  # ngram keeps no draft KV: no chunk is dropped from the hit
    assert [c.cached_tokens for c in cold] == [0, 0, 0]
    assert [w.cached_tokens for w in warm] == [hit] * 3, "the repeated prompts did not hit the plugin"
    assert_identical(reference, cold, engine.settings.dtype)
    assert_identical(reference, warm, engine.settings.dtype)
    assert drafted > 0 and accepted > 0, f"ngram proposed {drafted} tokens and {accepted} were accepted"
    assert plain_drafted > 0
    assert worker.executor is not None and not worker._stores, "a step's stores were never queued"
    logger.warning("spec-decode acceptance (ngram k=%d, %s): with plugin %.0f/%.0f = %.3f; without %.0f/%.0f = "
                   "%.3f; plugin hit %d tokens per repeated request", NGRAM["num_speculative_tokens"], recipe,
                   accepted, drafted, accepted / drafted, plain_accepted, plain_drafted,
                   plain_accepted / plain_drafted, hit)


def test_a_wrong_load_under_speculative_decoding_is_seen(engines, model_dirs, monkeypatch) -> None:
    """Negative control of the comparison above: with ngram on, loads that put every row one token late must
    change the warm run's tokens or logprobs beyond the tolerance."""
    from lmcache_npu.tools.replay.compare import differences

    from .test_tokens import _load_rows_one_token_late

    recipe = "llama"
    prompts = [_repetitive(seed) for seed in range(2)]
    engine = engines(recipe, model_dirs(recipe), extra_config={"cpu_bytes": "256MiB"},
                     engine_args={"speculative_config": dict(NGRAM)})
    cold = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    _load_rows_one_token_late(monkeypatch)
    warm = engine.generate(prompts, DECODE_STEPS, logprobs=5)
    assert all(w.cached_tokens > 0 for w in warm)  # the wrong rows were loaded and used
    found = differences(cold, warm)
    assert len(found) == len(prompts), f"a one-token shift went unnoticed under speculative decoding: {found}"
