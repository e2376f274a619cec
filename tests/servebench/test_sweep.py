"""The sweep's order and its handling of a server that never comes up: a configuration other than the baseline is
recorded as not run (with the log's reason) and the rest still run; a baseline that cannot start stops the sweep."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from lmcache_npu.replay.configs import BASELINE, PLUGIN, PLUGIN_CONNECTOR, RunConfig
from lmcache_npu.servebench import sweep as sweep_module
from lmcache_npu.servebench.load import LoadResult
from lmcache_npu.servebench.metrics import ServerCounters
from lmcache_npu.servebench.server import ServerSettings, ServerStartError
from lmcache_npu.servebench.sweep import Pace, Point, SweepSettings, run_sweep

CONFIGS = [RunConfig(BASELINE), RunConfig(PLUGIN, PLUGIN_CONNECTOR, {"cpu_bytes": "1GiB"})]
SERVER = ServerSettings("model", tokenizer="tok")
LOG = "vllm serve exited with 1:\nloading\nTraceback (most recent call last):\nRuntimeError: no segment"


def _fake(monkeypatch: pytest.MonkeyPatch, failing: str) -> list[tuple[str, str, str]]:
    """Servers whose args carry `failing` do not start; every point is recorded (config, workload, pace)."""
    ran: list[tuple[str, str, str]] = []

    @contextlib.contextmanager
    def server(model: str, args: list[str], log_path: Path, env: Any = None) -> Iterator[str]:
        if failing in " ".join(args):
            raise ServerStartError(LOG)
        yield "http://127.0.0.1:1"

    def point(base: str, server: ServerSettings, sweep: SweepSettings, config: RunConfig, name: str, index: int,
              pace: Pace, folder: Path) -> Point:
        ran.append((config.name, name, pace.label))
        return Point(config.name, config.plugin, name, pace, LoadResult(1, 0, 1.0, 1.0, 1.0, 1, 1, 1, 1, 1, 1),
                     ServerCounters())

    monkeypatch.setattr(sweep_module, "vllm_server", server)
    monkeypatch.setattr(sweep_module, "_run_point", point)
    monkeypatch.setattr(sweep_module, "_warm_up", lambda *args: None)
    return ran


def test_a_connector_server_that_does_not_start_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    ran = _fake(monkeypatch, "LMCacheNPUConnector")
    result = run_sweep(CONFIGS, SERVER, SweepSettings(names=("chat", "random")), tmp_path)
    assert result.configs == [BASELINE]
    assert result.unavailable[PLUGIN].startswith("vllm serve exited with 1")
    assert "RuntimeError: no segment" in result.unavailable[PLUGIN]
    # the baseline ran chat at the reusing pace, random at both paces
    assert ran == [(BASELINE, "chat", "concurrency 4"), (BASELINE, "random", "concurrency 1"),
                   (BASELINE, "random", "concurrency 2")]


def test_every_configuration_runs_when_all_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ran = _fake(monkeypatch, "no server has this argument")  # negative control: nothing fails, nothing is skipped
    result = run_sweep(CONFIGS, SERVER, SweepSettings(names=("random",)), tmp_path)
    assert result.configs == [BASELINE, PLUGIN] and result.unavailable == {}
    assert [r[0] for r in ran] == [BASELINE, BASELINE, PLUGIN, PLUGIN]


def test_a_baseline_that_does_not_start_stops_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake(monkeypatch, "--enable-prefix-caching")  # every server has it: the baseline fails first
    with pytest.raises(ServerStartError, match="no segment"):
        run_sweep(CONFIGS, SERVER, SweepSettings(names=("random",)), tmp_path)
