"""`lmcache-npu replay` end to end on a real engine: small workloads of each kind, the JSON report checked: tokens by
source (exact: the plugin's share is what it loaded, vLLM's cache the rest), the run order, the restart phase."""

from __future__ import annotations

import json

import pytest

from lmcache_npu.tools.cli import main
from lmcache_npu.tools.replay.connectors import peer_unavailable

from .conftest import ENGINE_VLLM

SOURCES = ("vllm", "arena", "disk", "mooncake", "peer", "computed")


def run_of(report: dict, config: str, repeat: int = 0) -> dict:
    return next(r for r in report["runs"] if r["config"] == config and r["repeat"] == repeat)


def hits(report: dict, config: str, source: str) -> list[int]:
    return [t["hits"][source] for t in run_of(report, config)["turns"]]


@pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: era-neutral, runs once
@pytest.mark.parametrize("workload", [
    ["--conversations", "2", "--turns", "2", "--system-tokens", "300", "--user-tokens", "64", "--output-tokens", "8"],
    ["--workload", "prefix-repetition", "--num-prompts", "4", "--prefix-repetition-num-prefixes", "2",
     "--prefix-repetition-prefix-len", "300", "--prefix-repetition-suffix-len", "20",
     "--prefix-repetition-output-len", "8"],
], ids=["chat", "prefix-repetition"])
def test_replay_without_vllms_cache_credits_every_hit_to_the_plugin(tmp_path, workload) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", "--model", "gemma3", "--chunk-tokens", "128", "--vllm-prefix-cache", "off", "--repeats",
                 "1", "--no-restart", "--json", str(out), *workload]) == 0
    report = json.loads(out.read_text())
    assert report["identical"] and report["per_config"]["vLLM + lmcache-npu"]["requests"] == 4
    assert report["rows"] == ("turn" if "--turns" in workload else "wave")
    plugin, alone = "vLLM + lmcache-npu", "vLLM alone"
    # turn 2 loads turn 1's history (300 + 64 + 8 tokens: two whole 128-token chunks); the second wave finds both
    # prefixes (two whole chunks of 300 tokens)
    assert hits(report, plugin, "arena") == [0, 2 * 2 * 128]
    assert hits(report, plugin, "vllm") == [0, 0] and hits(report, alone, "vllm") == [0, 0]
    assert hits(report, alone, "arena") == [0, 0]  # negative control: no plugin, nothing credited to it
    for run in report["runs"]:
        assert run["warmup"]["requests"] > 0 and not run["accounting_mismatches"]
        assert all(sum(t["hits"][s] for s in SOURCES) == t["prompt_tokens"] for t in run["turns"])
    assert run_of(report, plugin)["plugin_stats"]["stores"] > 0
    assert report["settings"]["extra_config"]["chunk_tokens"] == 128 and not report["settings"]["prefix_caching"]


@pytest.mark.one_era(0, 28)
def test_replay_with_vllms_cache_alternates_and_restarts_on_the_disk_tier(tmp_path) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", "--model", "gemma3", "--chunk-tokens", "128", "--repeats", "2", "--conversations", "2",
                 "--turns", "2", "--system-tokens", "300", "--user-tokens", "64", "--output-tokens", "8",
                 "--plot", str(tmp_path / "plots"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical"] and report["settings"]["prefix_caching"] and report["repeats"] == 2
    assert [(r["config"], r["position"]) for r in report["runs"]] == [
        ("vLLM alone", 0), ("vLLM + lmcache-npu", 1), ("vLLM + lmcache-npu", 0), ("vLLM alone", 1)]
    alone = run_of(report, "vLLM alone")["turns"]
    assert alone[1]["hits"]["vllm"] > 0 and all(t["hits"]["arena"] == 0 for t in alone)
    assert report["working_set_ratio"] > 0 and "verdict" in report
    restart = report["restart"]
    assert restart["identical"]
    cold, restarted = restart["cold"]["hits"], restart["restarted"]["hits"]
    assert cold["arena"] == cold["disk"] == 0  # no plugin: only vLLM's cache, and it restarted empty
    # the first conversation's history is only on disk (the arena restarted empty): its three whole chunks at least;
    # chunks the first promoted may be found in the arena by the second
    assert restarted["disk"] >= 3 * 128 and restarted["computed"] < cold["computed"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["replay-sources.png", "replay-ttft.png"]


@pytest.mark.one_era(0, 28)
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
                 "128", "--vllm-prefix-cache", "off", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == f"trace {trace}" and report["identical"]
    assert hits(report, "vLLM + lmcache-npu", "arena")[1] == 2 * 2 * 128  # 260 + 30 + 4 tokens: two whole chunks
    assert "disk_path" not in report["settings"]["extra_config"] and "restart" not in report  # no disk: no restart


PEER_MISSING = peer_unavailable() if ENGINE_VLLM is not None else "no engine"


@pytest.mark.skipif(ENGINE_VLLM is not None and ENGINE_VLLM < (0, 32),
                    reason="the peer (vLLM's MooncakeStoreConnector) is compared on the 0.32 era, as issue 22 measured")
@pytest.mark.skipif(bool(PEER_MISSING), reason=f"the peer cannot start here: {PEER_MISSING}")
def test_replay_with_the_peer_credits_its_hits_to_it_and_matches_vllm_alone(tmp_path) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", "--model", "gemma3", "--configs", "baseline,peer", "--vllm-prefix-cache", "off",
                 "--repeats", "1", "--conversations", "2", "--turns", "2", "--system-tokens", "300", "--user-tokens",
                 "64", "--output-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    peer, alone = "vLLM + MooncakeStoreConnector", "vLLM alone"
    assert report["configs"] == [alone, peer] and report["identical"]
    assert report["per_config"][peer]["matching"] == report["per_config"][peer]["requests"] == 4
    # turn 1 stored each prompt's whole 128-token blocks (300 + 64 = 364 tokens: two); turn 2 loads them
    assert hits(report, peer, "peer") == [0, 2 * 2 * 128]
    assert hits(report, alone, "peer") == [0, 0]  # negative control: vLLM alone has no external hits
    for source in ("arena", "disk", "mooncake", "vllm"):  # the peer's hits are never the plugin's (nor vLLM's)
        assert hits(report, peer, source) == [0, 0]
    for run in report["runs"]:
        assert all(sum(t["hits"][s] for s in SOURCES) == t["prompt_tokens"] for t in run["turns"])
        assert not run["accounting_mismatches"]
    assert "restart" not in report  # no plugin: no restart phase
    assert any(v["candidate"] == peer and "the peer connector 512" in v["text"] for v in report["verdicts"])
