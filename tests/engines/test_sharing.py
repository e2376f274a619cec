"""What one engine stored, another finds: a fresh engine on the same Mooncake master, and an engine restarted on
the same disk directory. Its hits must give the tokens the first engine computed."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest

from .compare import assert_identical, prompt

ROOT = Path(__file__).resolve().parents[2]


def _mooncake_reason() -> str:
    from tests.store.test_mooncake import _real_mooncake_reason

    return _real_mooncake_reason()


@pytest.mark.skipif(bool(_mooncake_reason()), reason=_mooncake_reason() or "ok")
def test_a_second_engine_hits_what_the_first_stored_in_mooncake(tmp_path) -> None:
    from lmcache_npu.store.mooncake_local import run_in_loopback_netns

    from lmcache_npu.replay.models import RECIPES

    from .sharing import DECODE_STEPS, PROMPTS, RECIPE

    out = tmp_path / "sharing.pkl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", "tests.engines.sharing", str(out)], env=env, timeout=500)
    assert done.returncode == 0, f"the sharing scenario failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    found = pickle.loads(out.read_bytes())
    assert [len(c.token_ids) for c in found["writer"]] == [DECODE_STEPS] * len(PROMPTS)
    assert_identical(found["writer"], found["reader"], RECIPES[RECIPE].dtype)
    assert [c.cached_tokens for c in found["reader"]] == [(length - 1) // 256 * 256 for length, _ in PROMPTS]
    assert found["promotions_remote"] == sum((length - 1) // 256 for length, _ in PROMPTS)


@pytest.mark.parametrize("write_through", [True, False])
def test_an_engine_restarted_on_the_same_disk_directory_hits_from_disk(engines, model_dirs, tmp_path,
                                                                       write_through) -> None:
    """Gemma-3 (two KV-cache groups). With write-through the restart finds every stored chunk; without it, only
    those the small arena evicted (spilled)."""
    recipe, model_dir = "gemma3", model_dirs("gemma3")
    prompts = [prompt(700, 300 + i) for i in range(3)]
    config = {"cpu_bytes": "2MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "256MiB",
              "disk_write_through": write_through}
    first = engines(recipe, model_dir, extra_config=config)
    chunk = first.scheduler_connector.scheduler_half.chunk_tokens
    stored = [first.generate([text], 32, logprobs=5)[0] for text in prompts]  # each prompt's chunks find slots
    first.generate([[1, 2, 3]], 1)  # one more step issues the write-through of the last stores
    slots = first.scheduler_connector.scheduler_half.index.num_slots
    first.close()
    restarted = engines(recipe, model_dir, extra_config=config)
    # one at a time again: the small arena can promote one prompt's chunks from disk, not three prompts' at once
    loaded = [restarted.generate([text], 32, logprobs=5)[0] for text in prompts]
    assert_identical(stored, loaded, first.settings.dtype)
    hits = [c.cached_tokens for c in loaded]
    whole = (700 - 1) // chunk * chunk
    if write_through:
        assert hits == [whole] * 3
    else:  # the arena's chunks at the stop are gone; the ones it evicted (the first prompt's) were spilled
        assert 3 * whole // chunk > slots and 0 < sum(hits) < 3 * whole
    assert restarted.scheduler_connector.scheduler_half.index.counters["promotions_disk"] > 0
