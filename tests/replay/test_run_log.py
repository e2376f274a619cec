"""tools/run_log.py: what a noisy engine prints through every channel (Python's stdout and stderr, logging, a C-level
write to descriptor 2, a child process) reaches the run log, not the terminal, while the tool's own lines do; an
error brings the terminal back and prints the log's last lines with its path. A fake noisy engine in a child Python
stands in for vLLM, torch and Mooncake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NOISY = r"""
import atexit, logging, os, subprocess, sys
from contextlib import nullcontext
from pathlib import Path
from lmcache_npu.tools.run_log import RunLog

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
atexit.register(lambda: os.write(2, b"I1128 real_client.cpp:628] Cleaning up at exit\n"))  # a native client's goodbye
log, mode = Path(sys.argv[1]), sys.argv[2]
run = RunLog(log, until_exit=True) if mode != "without" else None
with run if run is not None else nullcontext():
    out, err = (run.console_out, run.console_err) if run is not None else (sys.stdout, sys.stderr)
    out.write("the table\n")
    err.write("progress: run 1/2\n")
    print("INFO 11-28 vllm engine line")
    sys.stderr.write("Loading safetensors checkpoint shards: 100%\n")
    logging.getLogger("vllm.config").warning("a deprecation warning")
    sys.stderr.flush()
    os.write(2, b"I1128 23:42:31.877964 client_metric.cpp:102] glog line\n")
    subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"])
    if mode == "fail":
        raise RuntimeError("Engine core initialization failed")
print("after the run")
"""
NOISE = ("INFO 11-28 vllm engine line", "Loading safetensors", "a deprecation warning", "glog line", "child out",
         "child err", "Cleaning up at exit")


def run_noisy(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    log = tmp_path / "logs" / "run.log"
    done = subprocess.run([sys.executable, "-c", NOISY, str(log), mode], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    return done, log


def test_the_engines_noise_goes_to_the_log_and_the_tools_lines_to_the_terminal(tmp_path: Path) -> None:
    done, log = run_noisy(tmp_path, "with")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the table\nafter the run\n"
    assert done.stderr == "progress: run 1/2\n"
    text = log.read_text()
    assert all(line in text for line in NOISE), text


def test_negative_control_without_the_run_log_the_noise_reaches_the_terminal(tmp_path: Path) -> None:
    done, log = run_noisy(tmp_path, "without")
    assert done.returncode == 0, done.stderr
    assert all(line in done.stdout + done.stderr for line in NOISE)
    assert not log.exists()


def test_an_error_brings_the_terminal_back_with_the_logs_last_lines_and_path(tmp_path: Path) -> None:
    done, log = run_noisy(tmp_path, "fail")
    assert done.returncode == 1
    assert f"the last lines of {log}:" in done.stderr and "glog line" in done.stderr and "child err" in done.stderr
    assert "RuntimeError: Engine core initialization failed\n" in done.stderr  # after the descriptors came back
    assert "after the run" not in done.stdout and "Engine core" not in log.read_text()
    assert "Cleaning up at exit" in done.stderr  # after a failure the terminal stays the terminal


def test_a_second_run_starts_an_empty_log(tmp_path: Path) -> None:
    run_noisy(tmp_path, "with")
    done, log = run_noisy(tmp_path, "with")
    assert done.returncode == 0 and log.read_text().count("glog line") == 1
