"""Every layout preset in both device families, through vLLM 0.23's real Scheduler: a request computes and stores a
prompt, a second request with that prefix loads it, and every page the next forward reads matches the simulated
model's bytes (checked at every step). Both the emulated AscendC kernel and the torch backend move the bytes."""

from __future__ import annotations

import pytest

from .conftest import PRESET_ENGINES, prefix_is_loaded_exactly, preset_engine

CASES = sorted(PRESET_ENGINES)


@pytest.mark.parametrize("backend", ["emu", "torch"])
@pytest.mark.parametrize("preset,family", CASES)
def test_prefix_is_loaded_exactly(make_engine, preset: str, family: str, backend: str) -> None:
    prefix_is_loaded_exactly(preset_engine(make_engine, preset, family, backend=backend))
