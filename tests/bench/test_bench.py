"""`lmcache-npu bench`: presets, --geometry files, --check that really fails, JSON output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lmcache_npu.tools.bench.geometry import geometry_from_dict
from lmcache_npu.tools.cli import main
from lmcache_npu.ops import emu_backend

# presets are built from vLLM's spec classes; --geometry files need no vLLM (the GPU machines have none)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="presets are built from vLLM's spec classes: vLLM is not installed")


@needs_vllm
@pytest.mark.parametrize("args", [
    ["--preset", "llama3-8b-310p", "--soc", "310p"],  # FRACTAL_NZ pages on the 310P kernel
    ["--preset", "gpt-oss-120b", "--device-family", "cuda"],  # vLLM's CUDA flash layout [nb, 2, bs, h, d]
    ["--preset", "qwen3-next-80b"],  # recurrent groups: chunks of one 1024-token state block
])
def test_bench_check_passes(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--backend", "emu", "--chunks", "2", "--check", *args]) == 0
    assert "check: ok" in capsys.readouterr().out


@needs_vllm
def test_bench_main_job_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["bench", "--backend", "emu", "--preset", "deepseek-v4-flash", "--chunks", "4", "--chunk-tokens", "256", "--check",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["preset"] == "deepseek-v4-flash (ascend)" and report["check"] == "ok"
    assert (report["groups"], report["moved_planes"], report["planes"]) == (6, 168, 188)
    assert (report["object_bytes"], report["naive_object_bytes"]) == (8_088_192, 88_885_888)
    assert [r["direction"] for r in report["rows"]] == ["store", "load"]
    # per chunk, one DMA in and one out per run or UB tile: c4 63 planes x 2, c128 20 x 2, SWA 43 x 2 tiles x 2
    # (128 KiB > one 83,456 B tile), c4 compressor-state boundary 42 x 2
    assert report["rows"][0]["dma_ops"] == 4 * (126 + 40 + 172 + 84)


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


@needs_vllm
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
    data = {"chunk_tokens": 256, "name": "two-groups", "notes": "", "groups": [
        {"tokens_per_block": 512, "compress_ratio": 4, "planes": [
            {"row_bytes": 1024, "rows_per_block": 128, "block_stride_bytes": 131072, "layers": 21, "dtype": "bf16"},
            {"row_bytes": 2, "rows_per_block": 128, "block_stride_bytes": 16640, "layers": 21, "dtype": "fp16",
             "page": "indexer", "page_offset_bytes": 16384}]},
        {"tokens_per_block": 8, "sliding_window": 8, "skip": True, "skip_reason": "state", "planes": [
            {"row_bytes": 8192, "rows_per_block": 8, "block_stride_bytes": 131072}]}]}
    geometry = geometry_from_dict(data)
    again = geometry_from_dict(json.loads(json.dumps(geometry.to_dict())))
    assert again == geometry and again.groups[0].planes[1].page == "indexer"


def test_a_geometry_without_chunk_tokens_is_refused_not_given_a_size() -> None:
    data = {"groups": [{"tokens_per_block": 16, "planes": [
        {"row_bytes": 64, "rows_per_block": 16, "block_stride_bytes": 1024}]}]}
    with pytest.raises(ValueError, match=r"^geometry: missing keys \['chunk_tokens'\]$"):
        geometry_from_dict(data)
    assert geometry_from_dict({**data, "chunk_tokens": 32}).chunk_tokens == 32  # control: the same file with it
