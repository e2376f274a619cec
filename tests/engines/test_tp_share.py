"""Replicated KV stored once across a TP=2 CPU engine (`tp_share`, docs/storage.md "Replicated KV"): the MLA
recipe and a one-KV-head attention model. Each rank stores its half of the replicated rows, so its chunk objects
and files are half the size they are with `tp_share: off`; a warm run loads both halves through the exchange and
matches a run without the plugin token for token, with the loaded blocks byte-equal to the computed ones; a share
lost on one rank makes the chunk a miss on both, and the recompute matches too.

The workers run in two processes (vLLM's "mp" executor, gloo): what they hold is read with `collective_rpc`
(`tp_probe.py`). One core each: vLLM's CPU workers bind threads per NUMA node, and this machine has one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lmcache_npu.tools.replay.models import HIDDEN, VOCAB, Recipe, make_model

from . import tp_probe
from .compare import assert_identical, prompt
from .conftest import ENGINE_VLLM

ONE_KV_HEAD = Recipe("llama-1kv", "LlamaConfig",
                     {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                      "max_position_embeddings": 4096},
                     "grouped-query attention with a single KV head: every TP rank holds it whole")
RECIPES = {"deepseek-mla": "deepseek-mla", "llama-1kv": ONE_KV_HEAD}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
STEPS = 16


@pytest.fixture(autouse=True)
def _one_core_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")


def _model(model_dirs: Any, recipe: "str | Recipe") -> str:
    """The recipe's model directory (the session fixture keys by name; a Recipe made here is made directly)."""
    return model_dirs(recipe) if isinstance(recipe, str) else str(make_model(recipe))


def _store(tmp_path: Path, mode: str) -> dict[str, Any]:
    return {"cpu_bytes": "64MiB", "disk_path": str(tmp_path / f"kv-{mode}"), "disk_bytes": "256MiB",
            "tp_share": mode}


def _finished_blocks(engine: Any) -> dict[tuple[int, ...], list[list[int]]]:
    """prompt -> block ids of every finished request, recorded when vLLM hands them to the connector."""
    half = engine.scheduler_connector.scheduler_half
    seen: dict[tuple[int, ...], list[list[int]]] = {}
    finished = half.request_finished

    def record(request: Any, block_ids: Any) -> Any:
        seen.setdefault(tuple(request.prompt_token_ids), []).append(list(block_ids[0]))
        return finished(request, block_ids)

    half.request_finished = record
    return seen


def _same(expected: list[Any], got: list[Any], name: str, dtype: str) -> None:
    """Identical completions. MLA: tokens only (vLLM's CPU MLA gives a prefix read back as context logprobs up to
    2e-2 off, without any plugin: tests/engines/test_tokens.py); its rows are compared byte for byte instead."""
    if name == "deepseek-mla":
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    else:
        assert_identical(expected, got, dtype)


def _each(engine: Any, prompts: list[list[int]]) -> list[Any]:
    """One request at a time: the random MLA model's greedy near-ties turn with the batch's shape (two prompts
    prefilled together vs loaded then decoded), with or without the plugin and with tp_share off alike."""
    return [engine.generate([p], STEPS, logprobs=5)[0] for p in prompts]


def _facts(engine: Any) -> list[dict[str, Any]]:
    engine.llm.collective_rpc(tp_probe.flush_disk)
    return sorted(engine.llm.collective_rpc(tp_probe.share_facts), key=lambda f: f["rank"])


MLA_IMPORTS = pytest.mark.skipif(
    ENGINE_VLLM is not None and ENGINE_VLLM < (0, 29),
    reason="vLLM 0.28's CPU MLA backend does not import: cannot import name "
           "'compile_flash_attn_varlen_func_from_specs' from 'vllm.v1.attention.backends.fa_utils'")
NAMES = [pytest.param("deepseek-mla", marks=MLA_IMPORTS), "llama-1kv"]


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_stores_half_and_a_warm_run_matches(engines, model_dirs, tmp_path: Path, name: str) -> None:
    recipe = RECIPES[name]
    model = _model(model_dirs, recipe)
    prompts = [prompt(300, 900 + i) for i in range(2)]
    plain = engines(recipe, model, plugin=False, engine_args=TP2)
    expected = _each(plain, prompts)
    plain.close()

    whole = engines(recipe, model, extra_config=_store(tmp_path, "off"), engine_args=TP2)
    _same(expected, _each(whole, prompts), name, whole.settings.dtype)
    before = _facts(whole)
    whole.close()

    shared = engines(recipe, model, extra_config=_store(tmp_path, "auto"), engine_args=TP2)
    blocks = _finished_blocks(shared)
    chunk = shared.scheduler_connector.scheduler_half.chunk_tokens
    full_blocks = (299 // chunk * chunk) // shared.llm.llm_engine.vllm_config.cache_config.block_size
    cold, warm = [], []
    for p in prompts:
        cold += _each(shared, [p])
        computed = shared.llm.collective_rpc(tp_probe.block_digests, args=(blocks[tuple(p)][0][:full_blocks],))
        assert shared.llm.collective_rpc(tp_probe.poison_all)  # a row the load does not write cannot pass
        poisoned = shared.llm.collective_rpc(tp_probe.block_digests, args=(blocks[tuple(p)][0][:full_blocks],))
        assert poisoned != computed  # negative control: the digests see the poison
        warm += _each(shared, [p])
        loaded = shared.llm.collective_rpc(tp_probe.block_digests, args=(blocks[tuple(p)][1][:full_blocks],))
        assert loaded == computed  # per rank and layer, the loaded blocks hold the bytes computing them wrote
    after = _facts(shared)
    assert [c.cached_tokens for c in cold] == [0, 0]
    assert [c.cached_tokens for c in warm] == [299 // chunk * chunk] * 2
    _same(expected, cold, name, shared.settings.dtype)
    _same(expected, warm, name, shared.settings.dtype)
    for b, a in zip(before, after):
        assert not b["shared"] and a["shared"]
        assert b["object_bytes"] == a["full_bytes"]
        assert a["object_bytes"] <= b["object_bytes"] // 2 + 64  # own part is empty: everything is replicated
        assert b["disk_writes"] > 0 and a["disk_writes"] > 0
        # per chunk file: the share object and its envelope, against the whole object and its envelope
        assert a["disk_write_bytes"] / a["disk_writes"] < 0.55 * b["disk_write_bytes"] / b["disk_writes"]


@pytest.mark.parametrize("name", NAMES)
def test_a_share_lost_on_one_rank_is_a_miss_on_both(engines, model_dirs, tmp_path: Path, name: str) -> None:
    recipe = RECIPES[name]
    model = _model(model_dirs, recipe)
    prompts = [prompt(300, 700 + i) for i in range(2)]
    config = _store(tmp_path, "auto")
    first = engines(recipe, model, extra_config=config, engine_args=TP2)
    expected = _each(first, prompts)
    first.generate([[1, 2, 3]], 1)  # one more step issues the last write-through
    _facts(first)
    first.close()

    again = engines(recipe, model, extra_config=config, engine_args=TP2)  # adopts every chunk both ranks have
    lost = [f for f in Path(config["disk_path"]).rglob("*") if f.is_file() and "-r1." in f.name]
    assert lost, "rank 1 wrote no chunk file"
    for f in lost:
        f.unlink()
    recomputed = _each(again, prompts)
    assert [c.cached_tokens for c in recomputed] == [0, 0]
    _same(expected, recomputed, name, again.settings.dtype)
    assert again.plugin_stats().get("promote_failed", 0) >= 1
