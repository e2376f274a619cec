"""The comparison logic without an engine: the order runs go in, percentiles and spreads against hand computations,
warm-up records and a cold run detected, and a verdict that says what the numbers say."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from lmcache_npu.tools.replay.configs import BASELINE, PLUGIN, RunConfig, default_configs, run_order
from lmcache_npu.tools.replay.engine import Completion
from lmcache_npu.tools.replay.sizing import kv_memory_for, longest_request_tokens, working_set_tokens
from lmcache_npu.tools.replay.spread import Spread, percentile, spread_of
from lmcache_npu.tools.replay.verdict import Summary, change, verdict_line
from lmcache_npu.tools.replay.warmup import WarmUp, cold_runs, shadow_first_turn, warm_up, warmup_prompts
from lmcache_npu.tools.replay.workload import multi_turn_chat


def test_percentiles_match_a_hand_computation():
    values = [4.0, 1.0, 3.0, 2.0, 10.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 50) == 3.0
    # p90: position (5 - 1) * 0.9 = 3.6, between 4 and 10: 4 + 0.6 * 6
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile([1.0, 2.0], 50) == 1.5 and percentile([5.0], 90) == 5.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 90) != pytest.approx(4.0)  # negative control: not the nearest rank below
    with pytest.raises(ValueError, match="within"):
        percentile(values, 101)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentiles_agree_with_numpy(values, q):
    import numpy as np

    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_a_spread_is_median_and_range():
    assert spread_of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)
    assert spread_of([4.0, 1.0]) == Spread(2.5, 1.0, 4.0)


def test_repeats_alternate_which_configuration_goes_first():
    configs = default_configs({"chunk_tokens": 128})
    order = run_order(configs, 3)
    assert [(r, c.name) for r, c in order] == [(0, BASELINE), (0, PLUGIN), (1, PLUGIN), (1, BASELINE),
                                                (2, BASELINE), (2, PLUGIN)]
    three = [RunConfig("a"), RunConfig("b"), RunConfig("c")]
    firsts = [c.name for r, c in run_order(three, 3)][::3]
    assert firsts == ["a", "b", "c"]  # each goes first once
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        run_order(configs, 0)
    with pytest.raises(ValueError, match="unique"):
        run_order([RunConfig("a"), RunConfig("a")], 1)
    assert configs[1].plugin and not configs[0].plugin and configs[1].extra_config == {"chunk_tokens": 128}


def test_a_cold_run_is_detected():
    warm = WarmUp(requests=8, prompt_tokens=4096, seconds=2.0)
    assert cold_runs([("vLLM alone (repeat 1)", warm), ("plugin (repeat 1)", warm)]) == []
    assert cold_runs([("vLLM alone (repeat 1)", None), ("plugin (repeat 1)", warm)]) == ["vLLM alone (repeat 1)"]
    assert cold_runs([("x", WarmUp(0, 0, 0.0))]) == ["x"]


def test_warmup_prompts_are_unrelated_to_the_workload():
    chats = multi_turn_chat(2, 2, 64, 16, 4, vocab=2048, seed=0)
    prompts = warmup_prompts(4, 64, 2048)
    assert len(prompts) == 4 and all(len(p) == 64 for p in prompts)
    assert all(tuple(p[:16]) != chats[0].system[:16] for p in prompts)
    assert prompts == warmup_prompts(4, 64, 2048)  # the same every run: both configurations warm up alike


def test_the_warm_up_shadows_the_first_waves_shapes_with_unrelated_tokens():
    chats = multi_turn_chat(3, 2, 64, 16, 4, vocab=2048, seed=0)
    prompts = shadow_first_turn(chats, 2048)
    assert [len(p) for p in prompts] == [80, 80, 80]
    assert prompts[0][:64] == prompts[1][:64] == prompts[2][:64]  # the shared system prompt stays shared
    assert prompts[0][64:] != prompts[1][64:]
    assert all(p[:64] != list(chats[0].system) for p in prompts)  # negative control: nothing of the workload


class RecordingEngine:
    def __init__(self, prefix_caching: bool) -> None:
        self.settings = type("S", (), {"prefix_caching": prefix_caching})()
        self.batches: list[int] = []
        self.logprobs: list[int] = []
        self.resets = 0

    def generate(self, prompts, max_tokens, logprobs=0):
        self.batches.append(len(prompts))
        self.logprobs.append(logprobs)

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def test_the_warm_up_runs_one_then_the_batch_twice_and_empties_vllms_cache():
    engine = RecordingEngine(prefix_caching=True)
    warm = warm_up(engine, [[11] * 5, [12] * 5, [13] * 5])
    assert engine.batches == [1, 3, 3] and engine.resets == 1
    assert (warm.requests, warm.prompt_tokens) == (7, 35)
    assert not cold_runs([("run", warm)])
    off = RecordingEngine(prefix_caching=False)
    warm_up(off, [[11] * 5])
    assert off.resets == 0


def test_the_warm_up_asks_for_the_logprobs_the_timed_run_asks_for():
    """vLLM sets up its logprobs path on the first request asking for them (seconds on a CPU engine): a warm-up
    without them leaves that to the timed run's first wave."""
    from lmcache_npu.tools.replay.runs import COMPARED_LOGPROBS

    engine = RecordingEngine(prefix_caching=False)
    warm_up(engine, [[11] * 5, [12] * 5], logprobs=COMPARED_LOGPROBS)
    assert engine.logprobs == [COMPARED_LOGPROBS] * 3
    bare = RecordingEngine(prefix_caching=False)  # negative control: the default asks for none
    warm_up(bare, [[11] * 5])
    assert bare.logprobs == [0, 0, 0]


class AnsweringEngine(RecordingEngine):
    """Answers every prompt with `max_tokens` tokens, as a vLLM alone engine of the replay would."""

    engine_core = None
    llm = SimpleNamespace(llm_engine=None)  # no vLLM config: the device capacity is not known

    def generate(self, prompts, max_tokens, logprobs=0):
        super().generate(prompts, max_tokens, logprobs)
        return [Completion(len(p), (11,) * max_tokens, (), 0, 0.01) for p in prompts]

    def vllm_counter(self, name: str) -> float:
        return 0.0


def test_a_timed_run_warms_up_with_the_logprobs_it_runs_with():
    from lmcache_npu.tools.replay.runs import COMPARED_LOGPROBS, timed_run

    engine = AnsweringEngine(prefix_caching=False)
    chats = multi_turn_chat(conversations=2, turns=2, system_tokens=8, user_tokens=4, output_tokens=3, vocab=500)
    run = timed_run(engine, RunConfig("vLLM alone"), 0, 0, chats, vocab=500)
    assert run.warmup is not None and len(engine.logprobs) == 3 + 2  # the warm-up's three generates, two turns
    assert set(engine.logprobs) == {COMPARED_LOGPROBS}


def test_the_working_set_counts_a_shared_system_prompt_once():
    chats = multi_turn_chat(conversations=4, turns=3, system_tokens=100, user_tokens=20, output_tokens=5, vocab=500)
    assert working_set_tokens(chats) == 100 + 4 * 3 * 25
    assert longest_request_tokens(chats) == 100 + 3 * 25
    # 400 tokens / 4 = 100, below two of the longest request (350): 350 rounded up to 256-token blocks = 512
    assert kv_memory_for(chats, 4, bytes_per_token=10) == 512 * 10
    # a 768-token max_model_len needs 1.5 x 768 = 1152 tokens: 1280 in whole blocks
    assert kv_memory_for(chats, 4, bytes_per_token=10, max_model_len=768) == 1280 * 10
    # the ratio rules where the working set is large: (100 + 400 conversations x 75 tokens) / 4 = 7,525 -> 7,680
    big = multi_turn_chat(conversations=400, turns=3, system_tokens=100, user_tokens=20, output_tokens=5, vocab=500)
    assert kv_memory_for(big, 4, bytes_per_token=1) == 7680
    with pytest.raises(ValueError, match="--working-set-ratio must be >= 1"):
        kv_memory_for(chats, 0.5, 10)


def summary(base_ttft=(2.0, 1.9, 2.2), cand_ttft=(1.0, 0.9, 1.1), base_wall=(30.0, 29.0, 31.0),
            cand_wall=(20.0, 19.0, 21.0), cold=(), base_hits=None, cand_hits=None) -> Summary:
    return Summary("vLLM alone", "vLLM + lmcache-npu", 3, (Spread(*base_ttft), Spread(*cand_ttft)),
                   (Spread(3.0, 2.9, 3.1), Spread(1.5, 1.4, 1.6)), (Spread(*base_wall), Spread(*cand_wall)), 10000,
                   base_hits or {"vllm": 4000, "arena": 0, "disk": 0, "mooncake": 0, "computed": 6000},
                   cand_hits or {"vllm": 3000, "arena": 4500, "disk": 500, "mooncake": 0, "computed": 2000},
                   True, 4.2, list(cold))


def test_the_verdict_states_gain_and_both_caches_shares():
    text, style = verdict_line(summary())
    assert style == "green"
    assert "TTFT p50 2000 ms -> 1000 ms (2.00x faster) [1900 ms-2200 ms vs 900 ms-1100 ms]" in text
    assert "the workload 30.0 s -> 20.0 s (1.50x faster)" in text
    assert "working set is 4.2x the device KV cache" in text and "medians of 3 runs each" in text
    assert "vLLM alone hit 4,000 (40%) in vLLM's own cache and computed 6,000 (60%)" in text
    assert ("vLLM's own cache 3,000 (30%), the plugin 5,000 (50%) (host arena 4,500, disk 500, Mooncake 0), "
            "computed 2,000 (20%)") in text


def test_overlapping_ranges_are_not_called_a_gain():
    """Negative control: a candidate whose range overlaps the baseline's is not 'faster', and one above is slower."""
    text, style = verdict_line(summary(cand_ttft=(1.9, 1.5, 2.1)))
    assert style == "yellow" and "1.05x, within the run-to-run spread" in text and "p50 2000 ms -> 1900 ms" in text
    assert change(Spread(1.0, 0.9, 1.1), Spread(2.0, 1.8, 2.2)) == "2.00x slower"


def test_the_verdict_credits_the_plugin_only_with_its_own_hits():
    """Negative control: every hit in vLLM's cache, none the plugin's: the plugin's share reads 0."""
    text, _ = verdict_line(summary(cand_hits={"vllm": 8000, "arena": 0, "disk": 0, "mooncake": 0, "computed": 2000}))
    assert "vLLM's own cache 8,000 (80%), the plugin 0 (0%)" in text


def test_the_plugin_against_the_peer_names_each_connectors_hits():
    """The head-to-head line: the peer's hits are the peer connector's, the plugin's its tiers'; a peer candidate's
    hits are never described as the plugin's (negative control)."""
    base = summary(base_hits={"vllm": 3000, "arena": 0, "disk": 0, "mooncake": 0, "peer": 2500, "computed": 4500})
    text, _ = verdict_line(dataclasses.replace(base, baseline="peer", baseline_connector="peer"))
    assert "peer hit 3,000 (30%) in vLLM's own cache, the peer connector 2,500 (25%) and computed 4,500 (45%)" in text
    assert "the plugin 5,000 (50%) (host arena 4,500" in text
    peer_hits = {"vllm": 3000, "arena": 0, "disk": 0, "mooncake": 0, "peer": 5000, "computed": 2000}
    peer_candidate = dataclasses.replace(summary(cand_hits=peer_hits), candidate_connector="peer")
    text, _ = verdict_line(peer_candidate)
    assert "the peer connector 5,000 (50%), computed 2,000 (20%)" in text and "the plugin" not in text
    with pytest.raises(ValueError, match="unknown connector kind 'nixl'"):
        verdict_line(dataclasses.replace(base, candidate_connector="nixl"))


def test_a_cold_run_makes_the_verdict_refuse():
    text, style = verdict_line(summary(cold=["vLLM alone (repeat 1)"]))
    assert style == "red" and text.startswith("not comparable: vLLM alone (repeat 1) ran without a warm-up")
    assert "faster" not in text


def test_kv_bytes_per_token_from_a_config(tmp_path):
    import json

    from lmcache_npu.tools.replay.sizing import kv_bytes_per_token

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "num_key_value_heads": 2,
                                                      "head_dim": 64, "hidden_size": 1024,
                                                      "num_attention_heads": 16}))
    assert kv_bytes_per_token(str(tmp_path), "float32") == 2 * 6 * 2 * 64 * 4  # K and V, every layer
    assert kv_bytes_per_token(str(tmp_path), "bfloat16") == 2 * 6 * 2 * 64 * 2
    with pytest.raises(ValueError, match="no byte width for dtype 'int4'"):
        kv_bytes_per_token(str(tmp_path), "int4")


def test_the_turn_verdict_calls_a_turn_slower_only_beyond_the_spread():
    from lmcache_npu.tools.replay.verdict import turn_verdict

    same = Spread(1.0, 0.9, 1.1)
    inside, faster, slower = Spread(1.05, 0.95, 1.2), Spread(0.5, 0.45, 0.55), Spread(1.3, 1.2, 1.4)
    text, style = turn_verdict("vLLM alone", "plugin", "turn", [(same, inside, same, inside), (same, faster, same, same)],
                               3)
    assert style == "green" and "never slower" in text and "turn 2 p50 1000 ms -> 500 ms (2.00x faster)" in text
    # negative control: one turn's p90 range wholly above the baseline's is caught, and named
    text, style = turn_verdict("vLLM alone", "plugin", "turn", [(same, inside, same, inside), (same, same, same, slower)],
                               3)
    assert style == "red" and "SLOWER on turn 2" in text and "never slower" not in text
