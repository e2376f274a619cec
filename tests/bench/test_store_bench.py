"""`lmcache-npu store-bench`: every tier puts and gets through the executor, bytes checked, table and JSON out."""

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from lmcache_npu.tools.bench.store_bench import render_store_bench, run_store_bench
from lmcache_npu.tools.cli import main
from lmcache_npu.store.disk import DiskTier
from lmcache_npu.tools.mooncake_local import run_in_loopback_netns

from ..store.test_mooncake import _real_mooncake_reason

ROOT = Path(__file__).resolve().parents[2]
NO_MASTER = _real_mooncake_reason()


def test_cpu_and_disk_tiers_round_trip(tmp_path):
    results = run_store_bench(["cpu", "disk"], 100_000, 40, disk_path=str(tmp_path / "kv"))
    assert [r.tier for r in results] == ["cpu", "disk"]
    for r in results:
        assert r.check == "ok" and r.failed == 0 and r.put_gbps > 0 and r.get_gbps > 0
        assert r.to_json()["put_ops"] > 0
    assert not list((tmp_path / "kv").rglob("*.kv"))  # the bench removes what it wrote
    assert render_store_bench(results).row_count == 2


def test_disk_queue_holds_every_put_while_the_disk_is_slow(tmp_path, monkeypatch):
    """The writer starts only after the last put is queued (a slow CI disk): none may be refused as queue full."""
    chunks = 12
    queued = threading.Event()
    calls = []
    write_async, run_writer = DiskTier.write_async, DiskTier._run_writer

    def counting_write(self, *args, **kwargs):
        result = write_async(self, *args, **kwargs)
        calls.append(result)
        if len(calls) == chunks:
            queued.set()
        return result

    def stalled_writer(self):
        assert queued.wait(60)
        run_writer(self)

    monkeypatch.setattr(DiskTier, "write_async", counting_write)
    monkeypatch.setattr(DiskTier, "_run_writer", stalled_writer)
    [result] = run_store_bench(["disk"], 50_000, chunks, disk_path=str(tmp_path / "kv"))
    assert all(r.ok for r in calls) and len(calls) == chunks
    assert result.failed == 0 and result.check == "ok", result.notes


def test_cli_writes_json_and_refuses_bad_arguments(tmp_path, capsys):
    out = tmp_path / "store.json"
    assert main(["store-bench", "--tiers", "cpu", "--chunks", "8", "--chunk-bytes", "64KiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data[0]["tier"] == "cpu" and data[0]["chunk_bytes"] == 65536 and data[0]["check"] == "ok"
    assert main(["store-bench", "--tiers", "cpu,tape"]) == 2
    assert "unknown tier(s) tape; choose from cpu, disk, mooncake" in capsys.readouterr().err
    assert main(["store-bench", "--chunk-bytes", "lots"]) == 2
    assert main(["store-bench", "--tiers", "mooncake", "--mooncake-master", "10.0.0.5:50051"]) == 2
    assert "--mooncake-master and --mooncake-metadata go together" in capsys.readouterr().err


@pytest.mark.skipif(bool(NO_MASTER), reason=NO_MASTER or "ok")
def test_all_three_tiers_with_a_local_master_exit_zero(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", "lmcache_npu.tools.cli", "store-bench", "--tiers",
                                  "cpu,disk,mooncake", "--chunks", "24", "--chunk-bytes", "1MiB",
                                  "--mooncake-zero-copy", "both", "--json", str(tmp_path / "out.json")],
                                 env=env, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads((tmp_path / "out.json").read_text())
    assert [r["tier"] for r in data] == ["cpu", "disk", "mooncake-zero-copy", "mooncake"]
    assert all(r["check"] == "ok" and r["failed"] == 0 for r in data)
    assert "zero-copy" in data[2]["notes"] and "bounce" in data[3]["notes"]
