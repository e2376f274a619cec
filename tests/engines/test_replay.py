"""`lmcache-npu replay` end to end on a real engine: small workloads of each kind, the JSON report checked."""

from __future__ import annotations

import json

import pytest

from lmcache_npu.cli import main


@pytest.mark.parametrize("workload", [
    ["--conversations", "2", "--turns", "2", "--system-tokens", "300", "--user-tokens", "64", "--output-tokens", "8"],
    ["--workload", "prefix-repetition", "--num-prompts", "4", "--prefix-repetition-num-prefixes", "2",
     "--prefix-repetition-prefix-len", "300", "--prefix-repetition-suffix-len", "20",
     "--prefix-repetition-output-len", "8"],
], ids=["chat", "prefix-repetition"])
def test_replay_reports_hits_and_identical_tokens(tmp_path, workload) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", "--model", "gemma3", "--chunk-tokens", "128", "--json", str(out), *workload]) == 0
    report = json.loads(out.read_text())
    assert report["totals"]["identical"] and report["totals"]["requests"] == 4
    turns = report["turns"]
    assert report["rows"] == ("turn" if "--turns" in workload else "wave")
    if "--turns" in workload:  # turn 2 loads turn 1's history (300 + 64 + 8 tokens: two whole 128-token chunks)
        assert [t["loaded_tokens"] for t in turns][1] == 2 * 2 * 128
    else:  # two waves of one prompt per prefix: the second finds both prefixes (two whole chunks of 300 tokens)
        assert [t["loaded_tokens"] for t in turns] == [0, 2 * 2 * 128]
    assert report["plugin_stats"]["stores"] > 0 and report["settings"]["extra_config"]["chunk_tokens"] == 128


def test_replay_of_a_trace_file_on_a_model_made_from_a_config_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_NPU_MODEL_CACHE", str(tmp_path / "models"))
    config = tmp_path / "tiny-qwen2.json"
    config.write_text(json.dumps({"model_type": "qwen2", "vocab_size": 500, "hidden_size": 128, "num_hidden_layers": 2,
                                  "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "max_position_embeddings": 2048, "torch_dtype": "float32"}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"system": 260, "turns": [{"user": 30, "output": 4}] * 2})
                               for _ in range(2)))
    out = tmp_path / "replay.json"
    assert main(["replay", "--model-config", str(config), "--trace", str(trace), "--no-disk", "--chunk-tokens",
                 "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == f"trace {trace}" and report["totals"]["identical"]
    assert report["turns"][1]["loaded_tokens"] == 2 * 2 * 128  # 260 + 30 + 4 tokens: two whole chunks each
    assert "disk_path" not in report["settings"]["extra_config"]
