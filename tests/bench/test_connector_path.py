"""`lmcache-npu bench-connector`: the connector's worker path moves the bench's chunks byte for byte, and reports
both paths side by side; a path that moves a wrong row is caught (negative control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_npu.tools.bench.connector_path import run_connector_path
from lmcache_npu.tools.bench.geometry import geometry_from_dict
from lmcache_npu.tools.cli import main

# a full-attention group (two layers, K and V) and a windowed one whose 64-token tails sit inside 128-token blocks
GEOMETRY = {
    "chunk_tokens": 256, "name": "small-hybrid",
    "groups": [
        {"tokens_per_block": 128, "planes": [{"layers": 2, "row_bytes": 256, "rows_per_block": 128,
                                              "block_stride_bytes": 32768, "name": "k"},
                                             {"layers": 2, "row_bytes": 256, "rows_per_block": 128,
                                              "block_stride_bytes": 32768, "name": "v"}]},
        {"tokens_per_block": 128, "sliding_window": 64,
         "planes": [{"layers": 2, "row_bytes": 96, "rows_per_block": 128, "block_stride_bytes": 12800}]},
    ],
}


def test_both_paths_move_the_same_bytes_and_report_each_direction(tmp_path: Path) -> None:
    path = tmp_path / "small.json"
    path.write_text(json.dumps(GEOMETRY))
    out = tmp_path / "path.json"
    assert main(["bench-connector", "--backend", "emu", "--geometry", str(path), "--chunks", "1", "3",
                 "--repeats", "2", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    assert [r["same_bytes"] for r in reports] == [True, True]
    assert [[(row["direction"], row["start"], row["chunks"]) for row in r["rows"]] for r in reports] == [
        [("store", "idle", 1), ("load", "idle", 1)], [("store", "idle", 3), ("load", "idle", 3)]]
    # per chunk: 2 layers x (K + V) x 256 rows x 256 B, and 2 layers x 64 tail rows x 96 B
    assert reports[1]["rows"][0]["payload_bytes"] == 3 * (2 * 2 * 256 * 256 + 2 * 64 * 96)
    assert all(row["connector_ms"] > 0 and row["bench_ms"] > 0 and row["submit_us"] > 0
               for r in reports for row in r["rows"])


def test_a_connector_path_that_moves_a_wrong_row_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lmcache_npu.transfer import mover

    from ..late_rows import loads_one_token_late

    monkeypatch.setattr(mover.KVMover, "_cut_runs", loads_one_token_late(mover.KVMover._cut_runs))
    report = run_connector_path(geometry_from_dict(GEOMETRY), "emu", chunks=1, repeats=1)
    assert not report.same_bytes
    path = tmp_path / "small.json"
    path.write_text(json.dumps(GEOMETRY))
    assert main(["bench-connector", "--backend", "emu", "--geometry", str(path), "--chunks", "1",
                 "--repeats", "1"]) == 1


def test_a_queued_start_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="a queued start needs a CUDA device"):
        run_connector_path(geometry_from_dict(GEOMETRY), "emu", chunks=1, repeats=1, starts=("queued",))
