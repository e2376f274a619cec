"""`lmcache-npu replay` per load mode on a real engine (issue 41): the plugin's hits loaded asynchronously and sliced
give vLLM alone's tokens, and the scheduler steps from admission to first token are 1 for every sliced hit and at
least 2 for every asynchronous one (the negative control: the count is not 1 whatever happens)."""

from __future__ import annotations

import json
import os

from lmcache_npu.tools.cli import main

ASYNC, SLICED = "vLLM + lmcache-npu (async)", "vLLM + lmcache-npu (sliced)"


def test_sliced_hits_take_one_step_async_hits_at_least_two(tmp_path) -> None:
    out = tmp_path / "replay.json"
    lane_cpu = str(max(os.sched_getaffinity(0)))  # the lanes pin themselves (transfer_cpus); the engine is left alone
    assert main(["replay", "--model", "llama", "--vllm-prefix-cache", "off", "--configs",
                 "baseline,plugin-async,plugin-sliced", "--repeats", "1", "--no-restart", "--no-disk",
                 "--transfer-cpus", lane_cpu, "--workload", "prefix-repetition", "--num-prompts", "4",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "300",
                 "--prefix-repetition-suffix-len", "40", "--prefix-repetition-output-len", "4",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical"]
    assert report["settings"]["configs"][SLICED]["extra_config"]["transfer_cpus"] == [int(lane_cpu)]
    sliced = report["per_config"][SLICED]["admission_to_first_token_steps"]
    async_ = report["per_config"][ASYNC]["admission_to_first_token_steps"]
    assert sliced["hits"] == async_["hits"] == 2  # the second wave finds both prefixes
    assert sliced["sliced"] == 2 and sliced["histogram"] == {"1": 2}
    assert async_["sliced"] == 0 and async_["min"] >= 2
    assert report["per_config"][SLICED]["load_mode"] == "sliced"
