"""PYTHONHASHSEED=0 with a shared or persistent tier (finding N7): 0 disables hash randomization, so every deployment
that sets it computes the same block hashes and chunk names are predictable across unrelated deployments sharing a
store. It is refused at start with a disk or Mooncake tier; a host-only arena runs with it; any other fixed seed
runs."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from lmcache_npu.store.keys import check_stable_hashing
from lmcache_npu.store.secret import SECRET_ENV

SEED = "20261127"


@pytest.mark.parametrize("zero", ["0", "00", " 0 "])
def test_a_zero_seed_is_refused_naming_the_variable_the_reason_and_the_fix(zero):
    with pytest.raises(ValueError) as refusal:
        check_stable_hashing("sha256", {"PYTHONHASHSEED": zero})
    text = str(refusal.value)
    assert f"PYTHONHASHSEED={zero}" in text
    assert "disables hash randomization" in text and "predictable across unrelated deployments" in text
    assert "secret random value shared by the instances of this deployment" in text


@pytest.mark.parametrize("seed", [SEED, "1", "4294967295", "10"])
def test_a_non_zero_seed_is_accepted(seed):
    check_stable_hashing("sha256", {"PYTHONHASHSEED": seed})
    check_stable_hashing("sha256_cbor", {"PYTHONHASHSEED": seed})


def test_an_unset_seed_is_still_refused_for_its_own_reason():
    for env in ({}, {"PYTHONHASHSEED": ""}, {"PYTHONHASHSEED": "random"}):
        with pytest.raises(ValueError, match="PYTHONHASHSEED is not set"):
            check_stable_hashing("sha256", env)


# ---- through a real vLLM scheduler and the connector --------------------------------------------------------------

@pytest.fixture
def engine_with_seed(monkeypatch) -> Iterator[Any]:
    """Builds an engine (tests/integration/engine.py) under a PYTHONHASHSEED; closes it, and puts vLLM's NONE_HASH
    back (the engine re-seeds it from the variable) so later tests in this process hash as before."""
    from tests.integration.engine import Engine, EngineSpec, engines_closed_after

    def make(seed: str, **extra_config: Any) -> Any:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        engine = Engine(EngineSpec(extra_config=extra_config))
        engines.append(engine)
        return engine

    with engines_closed_after() as engines:
        yield make


def test_an_engine_with_a_disk_tier_refuses_seed_0(engine_with_seed, tmp_path):
    with pytest.raises(ValueError, match=r"PYTHONHASHSEED=0 is refused with a disk or Mooncake tier"):
        engine_with_seed("0", disk_path=str(tmp_path / "kv"), disk_bytes="64MiB")
    # control: the same engine with a fixed non-zero seed starts and has its disk tier
    engine = engine_with_seed(SEED, disk_path=str(tmp_path / "kv"), disk_bytes="64MiB")
    assert engine.workers[0].worker_half.executor.disk is not None


def test_an_engine_with_a_mooncake_tier_refuses_seed_0(engine_with_seed, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "a-store-secret-of-enough-bytes")
    # refused before any connection: nothing listens on these addresses
    mooncake = {"master": "127.0.0.1:9", "metadata": "http://127.0.0.1:9/metadata"}
    with pytest.raises(ValueError, match=r"PYTHONHASHSEED=0 is refused with a disk or Mooncake tier"):
        engine_with_seed("0", mooncake=mooncake)


def test_a_host_only_arena_runs_with_seed_0(engine_with_seed):
    engine = engine_with_seed("0")  # the arena dies with the process: no chunk name outlives it
    assert engine.connector.scheduler_half.index is not None
    assert engine.workers[0].worker_half.executor.disk is None
