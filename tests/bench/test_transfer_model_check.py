"""The transfer-model check's arithmetic (issue 40: the cost model's transfer side against the device window): each
size is predicted before it runs, from the worker timer's samples of the sizes before it, on a fake connector path
whose times are injected (the GPU runs are the study's)."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.cost.timer import TransferTimer
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.tools.bench import connector_path
from lmcache_npu.tools.bench.studies import transfer_model_check as check

OBJECT_BYTES = 16 << 20


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_path(device_slowdown: float, clock: FakeClock) -> Any:
    """A connector path whose transfers take 0.2 ms + bytes / 25 GB/s as its timer sees them, and that times on the
    device `device_slowdown` times as long."""
    ids = iter(range(1, 1 << 30))

    def run(source: Any, backend: str, chunks: int = 1, repeats: int = 1, starts: Any = ("idle",),
            timer: TransferTimer | None = None) -> connector_path.PathReport:
        seconds = 2e-4 + chunks * OBJECT_BYTES / 25e9
        rows = []
        for name, kind in (("store", Store), ("load", Load)):
            for _ in range(repeats):
                commands = [kind(next(ids), ChunkKey("r", bytes(8)), i, "r", i) for i in range(chunks)]
                if timer is not None:
                    timer.started(commands)
                clock.now += seconds
                if timer is not None:
                    for command in commands:
                        timer.finished(command.cmd_id, True)
            rows.append(connector_path.PathRow(name, "idle", chunks, chunks * OBJECT_BYTES, seconds * 1e3,
                                               seconds * device_slowdown * 1e3, 1.0, seconds * 1e3, seconds * 1e3))
        return connector_path.PathReport("fake", backend, OBJECT_BYTES, tuple(rows), True)

    return run


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(check, "TransferTimer", lambda object_bytes: TransferTimer(object_bytes, clock=fake))
    return fake


def test_a_linear_device_is_predicted_within_3_percent_before_each_size_runs(monkeypatch, clock):
    monkeypatch.setattr(check, "run_connector_path", fake_path(1.0, clock))
    predictions = check.predict_sizes("fake", "torch", (1, 2, 4, 8), 5, ("idle",), "cuda")
    assert [(p.direction, p.chunks) for p in predictions][:4] == [("store", 1), ("load", 1), ("store", 2), ("load", 2)]
    # the seed still weighs a little after twenty batches
    assert check.worst(predictions, "device") < 0.03 and check.worst(predictions, "reported") < 0.03
    assert predictions[-1].payload_mb == pytest.approx(8 * OBJECT_BYTES / 1e6)


def test_negative_control_a_device_slower_than_the_timer_sees_fails_the_target(monkeypatch, clock):
    monkeypatch.setattr(check, "run_connector_path", fake_path(2.0, clock))
    predictions = check.predict_sizes("fake", "torch", (1, 2, 4, 8), 5, ("idle",), "cuda")
    assert check.worst(predictions, "device") == pytest.approx(0.5, abs=0.01)
    assert check.worst(predictions, "device") > check.TARGET
    assert check.worst(predictions, "reported") < 0.03  # what the timer saw is still predicted
