"""The newcomer's first run (issue 42): `lmcache-npu replay` as `make demo` runs it, in a short configuration, prints
its progress, tables and verdicts and nothing of the engines'. vLLM's log lines, safetensors' progress bars, torch's
C++ warnings, Python's warnings and Mooncake's glog lines go to the log file whose path is printed once; the log
holding vLLM's lines is the negative control (the engines did speak, and the console check would have seen it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_npu.tools.replay.connectors import peer_unavailable

from .conftest import ENGINE_VLLM

# what an engine prints: vLLM's logger ("INFO 11-28 23:59:12 [...]", prefixed with the process in 0.32), glog
# ("I1128 23:42:31.877964 ..."), torch's C++ warnings ("[W1128 ..."), tqdm bars and Python's warnings
ENGINE_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d |^[IWEF]\d{4} \d\d:\d\d:\d\d"
                         r"|^\[[WIE]\d{4} |Loading safetensors|Warning: |DeprecationWarning|FutureWarning")
VLLM_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?INFO \d\d-\d\d ", re.MULTILINE)


def engine_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ENGINE_LINE.search(line)]


def test_negative_control_the_pattern_sees_each_kind_of_engine_line() -> None:
    noise = ["(EngineCore pid=7) INFO 11-28 23:59:12 [block_pool.py:861] Successfully reset prefix cache",
             "WARNING 11-28 23:59:02 [cpu_worker.py:140] CPU backend doesn't allow ...",
             "I1128 23:42:31.877964 24164 client_metric.cpp:102] Client metrics enabled",
             "[W1128 23:41:04.622757830 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
             "Loading safetensors checkpoint shards: 100% Completed | 1/1"]
    table = ["│    1 │ vLLM alone │  1622 ms │", "run 1/2: starting vLLM alone", "every conversation's tokens were "
             "identical in every run"]
    assert engine_lines("\n".join(noise + table)) == noise


@pytest.mark.one_era(0, 32)  # the demo's era (Makefile DEMO_VLLM), with its peer where Mooncake runs
def test_the_demos_console_holds_only_the_tools_lines(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    peer = [] if peer_unavailable() else ["--peer"]
    done = subprocess.run([sys.executable, "-m", "lmcache_npu.tools.cli", "replay", *peer, "--no-restart",
                           "--repeats", "1", "--conversations", "1", "--turns", "1", "--system-tokens", "300",
                           "--user-tokens", "64", "--output-tokens", "8", "--log-file", str(log)],
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"})  # as `make demo`
    assert done.returncode == 0, done.stderr + log.read_text()[-4000:]
    console = done.stdout + done.stderr
    assert engine_lines(console) == []
    assert console.count(str(log)) == 1 and "every conversation's tokens were identical" in done.stdout
    text = log.read_text()
    assert VLLM_LINE.search(text) and "Loading safetensors" in text  # the engines spoke, into the log
    assert ENGINE_VLLM is not None
