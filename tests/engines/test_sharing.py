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


@pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: era-neutral, runs once
@pytest.mark.skipif(bool(_mooncake_reason()), reason=_mooncake_reason() or "ok")
def test_a_second_engine_hits_what_the_first_stored_in_mooncake(tmp_path) -> None:
    from lmcache_npu.tools.replay.models import RECIPES

    from .sharing import DECODE_STEPS, PROMPTS, RECIPE

    found = _scenario(tmp_path, "share")
    reader = found["reader"]
    assert [len(c.token_ids) for c in found["writer"]] == [DECODE_STEPS] * len(PROMPTS)
    assert_identical(found["writer"], reader["completions"], RECIPES[RECIPE].dtype)
    assert [c.cached_tokens for c in reader["completions"]] == [(length - 1) // 256 * 256 for length, _ in PROMPTS]
    assert reader["promotions_remote"] == sum((length - 1) // 256 for length, _ in PROMPTS)
    assert reader["rejected"] == 0


def _scenario(tmp_path, mode: str) -> dict:
    from lmcache_npu.tools.mooncake_local import run_in_loopback_netns

    out = tmp_path / f"{mode}.pkl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", "tests.engines.sharing", str(out), mode], env=env,
                                 timeout=500)
    assert done.returncode == 0, f"the {mode} scenario failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return pickle.loads(out.read_bytes())


@pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: era-neutral, runs once
@pytest.mark.skipif(bool(_mooncake_reason()), reason=_mooncake_reason() or "ok")
def test_mooncake_objects_of_other_weights_overwritten_or_forged_are_never_loaded(tmp_path) -> None:
    """Other weights under the writer's model_name find nothing; an object another client overwrote with other
    bytes of the same length, or re-sealed without the secret, is a counted miss; the untouched prompt still
    loads from Mooncake (the control), and every completion is the writer's."""
    from lmcache_npu.tools.replay.compare import differences
    from lmcache_npu.tools.replay.models import RECIPES

    from .sharing import PROMPTS, RECIPE

    found = _scenario(tmp_path, "trust")
    whole = [(length - 1) // 256 * 256 for length, _ in PROMPTS]
    other = found["other_weights"]
    assert other["promotions_remote"] == 0 and [c.cached_tokens for c in other["completions"]] == [0] * len(PROMPTS)
    assert differences(found["writer"], other["completions"]), "other weights gave the writer's tokens"
    assert found["overwritten"] == found["forged"] == whole[0] // 256
    reader = found["reader"]
    assert [c.cached_tokens for c in reader["completions"]] == [0, 0, whole[2]]
    # every promotion but the untouched prompt's was refused (at least the first chunk of each tampered prompt)
    assert reader["rejected"] == reader["promotions_remote"] - whole[2] // 256 >= 2
    assert_identical(found["writer"], reader["completions"], RECIPES[RECIPE].dtype)


@pytest.mark.parametrize("write_through", [True, False])
def test_an_engine_restarted_on_the_same_disk_directory_hits_from_disk(engines, model_dirs, tmp_path,
                                                                       write_through) -> None:
    """Gemma-3 (two KV-cache groups). With write-through the restart finds every stored chunk; without it, only
    those the small arena evicted (spilled)."""
    recipe, model_dir = "gemma3", model_dirs("gemma3")
    prompts = [prompt(700, 300 + i) for i in range(3)]
    # the 2 MiB arena holds one prompt's 256-token chunks of Gemma-3 but not three prompts'
    # every hit claimed (load-all): this checks what the disk kept, and the cost model may rightly compute a tiny
    # model's 512 tokens rather than wait for their promotion from disk
    config = {"cpu_bytes": "2MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "256MiB",
              "disk_write_through": write_through, "chunk_tokens": 256, "load_policy": "load-all"}
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
