"""A local node cache service for studies and tests: `lmcache-npu node-cache` as a child process, its socket in a
folder of the caller's, its Prometheus endpoint on a free loopback port, and what its host arena holds read from
that endpoint (the node's own series, `engine="node"`).

    with LocalNodeCache(folder, "2GiB") as node:     # up once the socket exists and /metrics answers
        extra_config = {"node_cache": node.socket}   # what each engine sets
        node.used_bytes()                            # the node's arena bytes in use, every pool together
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .mooncake_local import LOOPBACK, free_port
from .status import Sample, fetch_metrics, parse_metrics

START_TIMEOUT_S = 60.0


def node_used_bytes(samples: Sequence[Sample]) -> int:
    """The node cache's host arena bytes in use: per pool (namespace), used chunks times bytes per chunk, summed
    over pools; an attached engine's own series (another `engine` label) are not the node's."""
    used: dict[str, float] = {}
    size: dict[str, float] = {}
    for sample in samples:
        if sample.label("engine") != "node":
            continue
        if sample.name == "lmcache_npu:cpu_used_chunks":
            used[sample.label("namespace")] = sample.value
        elif sample.name == "lmcache_npu:chunk_bytes":
            size[sample.label("namespace")] = sample.value
    missing = sorted(set(used) ^ set(size))
    if missing:
        raise ValueError(f"node cache metrics: namespace(s) {missing} lack cpu_used_chunks or chunk_bytes")
    return int(sum(used[n] * size[n] for n in used))


class LocalNodeCache:
    """`lmcache-npu node-cache --socket <folder>/node-cache.sock --cpu-bytes SIZE` with metrics on 127.0.0.1,
    stopped (SIGTERM: its disk tier flushes) and reaped on exit; its output goes to <folder>/node-cache.log."""

    def __init__(self, folder: str, cpu_bytes: str, extra_args: Sequence[str] = ()) -> None:
        if not os.path.isdir(folder):
            raise ValueError(f"the node cache's folder {folder!r} is not a directory")
        self.socket = os.path.join(folder, "node-cache.sock")
        self.log_path = os.path.join(folder, "node-cache.log")
        self.metrics_port = free_port()
        self.cpu_bytes = cpu_bytes
        self.extra_args = list(extra_args)
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "LocalNodeCache":
        argv = [sys.executable, "-m", "lmcache_npu.tools.cli", "node-cache", "--socket", self.socket,
                "--cpu-bytes", self.cpu_bytes, "--metrics-port", str(self.metrics_port), "--metrics-host", LOOPBACK,
                *self.extra_args]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if os.path.exists(self.socket):
                with contextlib.suppress(ConnectionError):
                    self.samples()
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the node cache service did not come up on {self.socket}: {self.log_tail()}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def samples(self) -> list[Sample]:
        return parse_metrics(fetch_metrics(f"http://{LOOPBACK}:{self.metrics_port}/metrics"))

    def used_bytes(self) -> int:
        return node_used_bytes(self.samples())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def log_tail(self, characters: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-characters:]
        except OSError:
            return ""
