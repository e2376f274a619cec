"""`lmcache-npu bench-scheduler`: every measurement runs on vLLM's own objects, checks its own setup (the 128K
prompt hits 511 chunks, the prefill and decode steps store the chunks they complete), with the in-process index and
with the node cache's client (a live service in a thread), and prints a table."""

import json

import pytest

from lmcache_npu.tools.cli import main

pytest.importorskip("vllm", reason="bench-scheduler drives vLLM's own objects: vLLM is not installed")


def test_cli_measures_every_call_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert main(["bench-scheduler", "--repeats", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    operations = {(r["operation"], r["preset"], r["index"]) for r in rows}
    for index in ("in-process", "node cache"):  # the setup checks (511 chunks hit, every chunk stored) ran for both
        assert ("get_num_new_matched_tokens, hit, first call", "llama3-8b", index) in operations
        assert ("build_connector_meta, decode step", "deepseek-v4-flash", index) in operations
        assert ("build_connector_meta, prefill step", "llama3-8b", index) in operations
    assert ("node cache round trip (a verb that does nothing)", "llama3-8b", "node cache") in operations
    assert len(rows) == 2 * 6 + 2 * 7 and all(r["median_us"] > 0 for r in rows)
    text = capsys.readouterr().out
    assert "connector scheduler half" in text and "node cache" in text
    assert main(["bench-scheduler", "--repeats", "0"]) == 2
