"""Every layout preset in both device families, through vLLM 0.23's real Scheduler: a request computes and stores a
prompt, a second request with that prefix loads it, and every page the next forward reads matches the simulated
model's bytes (checked at every step). Both the emulated AscendC kernel and the torch backend move the bytes."""

from __future__ import annotations

import pytest

from .conftest import PRESET_ENGINES, assert_quiescent, preset_engine, prompt

CASES = sorted(PRESET_ENGINES)


def _expected_hit(chunk: int, stored_tokens: int, next_prompt: int) -> int:
    """Whole chunks of the first request, short of the next prompt's last token."""
    return min(stored_tokens // chunk, (next_prompt - 1) // chunk) * chunk


@pytest.mark.parametrize("backend", ["emu", "torch"])
@pytest.mark.parametrize("preset,family", CASES)
def test_prefix_is_loaded_exactly(make_engine, preset: str, family: str, backend: str) -> None:
    engine = preset_engine(make_engine, preset, family, backend=backend)
    chunk = engine.connector.scheduler_half.chunk_tokens
    if engine.connector.scheduler_half.has_end_state:
        # a recurrent state exists only where a step ends: one chunk per step keeps every chunk complete
        engine.spec.max_num_batched_tokens = chunk
        engine.scheduler.max_num_scheduled_tokens = chunk
    first = prompt(2 * chunk + chunk // 2, seed=1)
    engine.add(first, max_tokens=2, request_id="first")
    engine.run()
    engine.evict_device_cache()
    second = first + prompt(chunk // 2, seed=2)
    engine.add(second, max_tokens=3, request_id="second")
    engine.run()
    assert engine.loaded_tokens.get("second", 0) == _expected_hit(chunk, len(first) + 1, len(second))
    assert engine.loaded_tokens["second"] > 0
    assert len(engine.output_tokens("second")) == 3
    assert_quiescent(engine)
