"""`lmcache-npu bench`: presets, --geometry files, --check that really fails, JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_npu.bench.geometry import geometry_from_dict, materialize
from lmcache_npu.bench.presets import PRESETS, get_preset
from lmcache_npu.cli import main
from lmcache_npu.ops import emu_backend

# Bytes per 256-token chunk, written out by hand from the preset geometry.
EXPECTED_OBJECT_BYTES = {
    "llama3-8b": 2 * 32 * 256 * 2048,  # K+V, 32 layers, 8 heads x 128 x bf16
    "llama3-8b-310p": 2 * 32 * 256 * 2048,
    "deepseek-v3": 61 * 256 * (1024 + 128),  # nope 512 + rope 64, bf16
    "deepseek-v3.2-c8": 61 * 256 * (1024 + 128 + 128) + 61 * 512,  # + int8 indexer; fp16 scale 512 B per chunk
    # c4: 64 rows x (1024 + 128 + 2->128 aligned); c128: 2 rows x 1024; SWA: 43 layers x 128-row tail x 1024
    "deepseek-v4-flash": 21 * (65536 + 8192 + 128) + 20 * 2048 + 43 * 128 * 1024,
    "gpt-oss-120b": 18 * 2 * 128 * 1024 + 18 * 2 * 256 * 1024,  # SW 128 tail + full, 8 heads x 64 x bf16
}
NAIVE_OBJECT_BYTES_V4 = 21 * 64 * 1154 + 20 * 2048 + 43 * 256 * 1024 + 21 * 256 * 8192 + 20 * 256 * 4096


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_object_bytes(name: str) -> None:
    plan = materialize(get_preset(name), chunks=1, device=torch.device("cpu")).plan
    assert plan.object_bytes == EXPECTED_OBJECT_BYTES[name]


def test_deepseek_v4_flash_groups_and_naive_bytes() -> None:
    plan = materialize(get_preset("deepseek-v4-flash"), chunks=1, device=torch.device("cpu")).plan
    assert len(plan.groups) == 11
    assert [g.skip for g in plan.groups] == [False] * 7 + [True] * 4
    assert plan.rows_per_chunk[:3] == (64, 2, 128)  # c4, c128, SWA tail
    assert plan.object_bytes_naive() == NAIVE_OBJECT_BYTES_V4


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_bench_check_passes_on_every_preset(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    soc = ["--soc", "310p"] if name.endswith("310p") else []
    assert main(["bench", "--backend", "emu", "--preset", name, "--chunks", "2", "--check", *soc]) == 0
    assert "check: ok" in capsys.readouterr().out


def test_bench_main_job_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["bench", "--backend", "emu", "--preset", "deepseek-v4-flash", "--chunks", "4", "--check",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["groups"] == 11 and report["check"] == "ok"
    assert [r["direction"] for r in report["rows"]] == ["store", "load"]
    assert report["rows"][0]["dma_ops"] == 4 * 338  # 126 c4 + 40 c128 + 172 SWA DMAs per chunk


def test_bench_geometry_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    geometry = {
        "chunk_tokens": 256,
        "groups": [
            {"tokens_per_block": 128, "compress_ratio": 1, "sliding_window": None, "skip": False,
             "planes": [{"layers": 3, "row_bytes": 1152, "rows_per_block": 128, "block_stride_bytes": 147456,
                         "num_blocks": 64}]},
            {"tokens_per_block": 64, "compress_ratio": 4, "sliding_window": None, "skip": False,
             "planes": [{"layers": 2, "row_bytes": 3, "rows_per_block": 16, "block_stride_bytes": 100,
                         "num_blocks": 64}]},
            {"tokens_per_block": 16, "sliding_window": 16, "skip": True,
             "planes": [{"layers": 2, "row_bytes": 64, "rows_per_block": 16, "block_stride_bytes": 1024,
                         "num_blocks": 4}]},
        ],
    }
    path = tmp_path / "model.json"
    path.write_text(json.dumps(geometry))
    assert main(["bench", "--backend", "emu", "--geometry", str(path), "--chunks", "8", "--check"]) == 0
    assert "check: ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "mutation,message",
    [
        (lambda g: g["groups"][0].update(colour="red"), "groups[0]: unknown keys ['colour']; valid keys are"),
        (lambda g: g["groups"][0]["planes"][0].pop("row_bytes"), "groups[0].planes[0]: missing keys ['row_bytes']"),
        (lambda g: g["groups"][0]["planes"][0].update(num_blocks=2), "groups[0]: 2 blocks hold fewer than the 9 that 4 chunks need"),
        (lambda g: g["groups"][0]["planes"][0].update(block_stride_bytes=10), "block stride 10 B is smaller"),
    ],
)
def test_bad_geometry_files_name_the_problem(tmp_path: Path, mutation, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    geometry = {"chunk_tokens": 256, "groups": [{"tokens_per_block": 128, "planes": [
        {"row_bytes": 64, "rows_per_block": 128, "block_stride_bytes": 8192, "num_blocks": 16}]}]}
    mutation(geometry)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(geometry))
    assert main(["bench", "--backend", "emu", "--geometry", str(path), "--chunks", "4"]) == 2
    assert message in capsys.readouterr().err


def test_check_fails_when_bytes_are_wrong(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    original = emu_backend.EmuBackend.transfer

    def corrupting(self, batch):  # type: ignore[no-untyped-def]
        stats = original(self, batch)
        batch.objects[0][100] ^= 0xFF  # one flipped byte after every transfer
        return stats

    monkeypatch.setattr(emu_backend.EmuBackend, "transfer", corrupting)
    assert main(["bench", "--backend", "emu", "--preset", "llama3-8b", "--chunks", "1", "--check"]) == 1
    assert "round trip check failed" in capsys.readouterr().out


def test_geometry_round_trips_through_json() -> None:
    geometry = get_preset("deepseek-v4-flash")
    again = geometry_from_dict(json.loads(json.dumps(geometry.to_dict())))
    assert again == geometry
