"""Trust at the boundary in real engines: a chunk on disk is loaded only by the weights (and LoRA adapter) that
computed it. A redeploy of new weights at the same path, or a new adapter under an old name, loads nothing and gives
the tokens a plugin-less engine gives; unchanged weights still hit. The negative control names new weights with an
old `model_fingerprint` (what naming by path did before): the old KV is loaded and the comparison sees it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmcache_npu.layout.discovery import DEFAULT_CHUNK_TOKENS
from lmcache_npu.tools.replay.compare import differences
from lmcache_npu.tools.replay.models import HIDDEN, RECIPES, make_model

from .compare import assert_identical, prompt

RECIPE = "llama"
DTYPE = RECIPES[RECIPE].dtype
PROMPTS = [prompt(700, 400 + i) for i in range(2)]
STEPS = 16
WHOLE = (700 - 1) // DEFAULT_CHUNK_TOKENS * DEFAULT_CHUNK_TOKENS  # the automatic chunk: one CPU block of llama


def _weights_at(path: Path, seed: int) -> str:
    """The recipe's model made with `seed`, copied over `path` (a redeploy keeps the path and the config)."""
    path.mkdir(parents=True, exist_ok=True)
    for item in make_model(RECIPE, seed=seed).iterdir():
        shutil.copy(item, path / item.name)
    return str(path)


def _disk(tmp_path: Path, **extra: object) -> dict:
    return {"cpu_bytes": "64MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "256MiB", **extra}


def _serve(engines, model: str, config: dict, lora=None, **settings) -> list:
    """A fresh engine's completions of PROMPTS; its chunks are on disk when it returns."""
    engine = engines(RECIPE, model, extra_config=config, **settings)
    done = engine.generate(PROMPTS, STEPS, logprobs=5, lora_request=lora)
    engine.generate([[1, 2, 3]], 1, lora_request=lora)  # one more step issues the last write-through
    engine.close()
    return done


def _plain(engines, model: str, lora=None, **settings) -> list:
    engine = engines(RECIPE, model, plugin=False, **settings)
    done = engine.generate(PROMPTS, STEPS, logprobs=5, lora_request=lora)
    engine.close()
    return done


def test_new_weights_at_the_same_path_load_nothing_and_match_a_plain_run(engines, tmp_path) -> None:
    model = _weights_at(tmp_path / "model", seed=0)
    assert [c.cached_tokens for c in _serve(engines, model, _disk(tmp_path))] == [0, 0]
    again = _serve(engines, model, _disk(tmp_path))
    assert [c.cached_tokens for c in again] == [WHOLE, WHOLE]  # control: unchanged weights hit the disk
    _weights_at(tmp_path / "model", seed=1)
    redeployed = _serve(engines, model, _disk(tmp_path))
    assert [c.cached_tokens for c in redeployed] == [0, 0]
    assert_identical(_plain(engines, model), redeployed, DTYPE)


def test_a_stale_model_fingerprint_serves_the_old_weights_kv_and_the_comparison_sees_it(engines, tmp_path) -> None:
    """Negative control: weights named by the operator are trusted by that name, so new weights under an old name
    load the old weights' KV, as every redeploy did when the namespace was the model's path."""
    config = _disk(tmp_path, model_fingerprint="release-2026-11")
    model = _weights_at(tmp_path / "model", seed=0)
    _serve(engines, model, config)
    _weights_at(tmp_path / "model", seed=1)
    stale = _serve(engines, model, config)
    assert [c.cached_tokens for c in stale] == [WHOLE, WHOLE]
    found = differences(_plain(engines, model), stale)
    assert len(found) == len(PROMPTS), f"the old weights' KV went unnoticed for some request: {found}"


def _adapter(path: Path, seed: int, rank: int = 8) -> str:
    """A PEFT LoRA adapter for the recipe's q/v projections, its weights drawn from `seed` (large enough to move
    the tokens)."""
    path.mkdir(parents=True, exist_ok=True)
    config = RECIPES[RECIPE].arguments
    q_out = config["num_attention_heads"] * config["head_dim"]
    v_out = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in (("q_proj", q_out), ("v_proj", v_out)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=generator) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
         "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "base"}))
    return str(path)


LORA_ENGINE = {"engine_args": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}}


def test_a_lora_adapter_replaced_under_its_name_loads_nothing(engines, tmp_path) -> None:
    from vllm.lora.request import LoRARequest

    model = _weights_at(tmp_path / "model", seed=0)
    adapter = tmp_path / "adapter"
    lora = LoRARequest("tenant", 1, _adapter(adapter, seed=1))
    first = _serve(engines, model, _disk(tmp_path), lora, **LORA_ENGINE)
    assert [c.cached_tokens for c in first] == [0, 0]
    again = _serve(engines, model, _disk(tmp_path), lora, **LORA_ENGINE)
    assert [c.cached_tokens for c in again] == [WHOLE, WHOLE]  # control: the same adapter hits
    assert_identical(first, again, DTYPE)
    _adapter(adapter, seed=2)  # new adapter files, same name and path
    replaced = _serve(engines, model, _disk(tmp_path), lora, **LORA_ENGINE)
    assert [c.cached_tokens for c in replaced] == [0, 0]
    reference = _plain(engines, model, lora, **LORA_ENGINE)
    assert_identical(reference, replaced, DTYPE)
    assert differences(reference, first), "the two adapters give the same tokens: the test could not see a wrong load"


_REFUSED_START = """
import json, sys
from lmcache_npu.tools.replay.engine import Engine, EngineSettings
try:
    Engine(EngineSettings.for_recipe(sys.argv[1], sys.argv[2], extra_config=json.loads(sys.argv[3]),
                                     engine_args={"load_format": "dummy"}))
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
else:
    print("STARTED")
"""


def test_an_engine_without_named_weights_refuses_the_disk_tier(engines, tmp_path) -> None:
    """Random weights (`load_format: dummy`) have no content to name them: the disk tier refuses to start, naming
    the key that would name them (in a child process: an engine that fails to start leaves vLLM's globals behind);
    the arena alone runs."""
    model = str(make_model(RECIPE))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", _REFUSED_START, RECIPE, model, json.dumps(_disk(tmp_path))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert "REFUSED UnnamedWeightsError" in done.stdout and "model_fingerprint" in done.stdout, done.stdout[-2000:]
    arena = engines(RECIPE, model, extra_config={"cpu_bytes": "64MiB"}, engine_args={"load_format": "dummy"})
    assert arena.generate([PROMPTS[0]], 1)[0].cached_tokens == 0
