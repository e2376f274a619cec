"""`lmcache-npu inspect`: the table a person reads and the JSON a script reads."""

from __future__ import annotations

import json
import os

import pytest

from lmcache_npu.tools.cli import main

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def test_deepseek_v4_flash_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--preset", "deepseek-v4-flash", "--json", "--chunk-tokens", "256"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"groups", "bytes_per_chunk", "naive_bytes_per_chunk"}
    assert (data["bytes_per_chunk"], data["naive_bytes_per_chunk"]) == (8_088_192, 88_885_888)
    keys = {"index", "spec", "tokens_per_block", "compress_ratio", "sliding_window", "skipped", "skip_reason",
            "rows_per_chunk", "planes"}
    assert all(keys <= set(g) for g in data["groups"])
    state = [g for g in data["groups"] if g["kind"] == "compressor_state"]
    assert [(g["stored"], g["rows_per_chunk"]) for g in state] == [("boundary", 4), ("skipped", 0)]
    assert "restoring without it is exact" in state[1]["skip_reason"]
    windowed = [g for g in data["groups"] if g["kind"] == "sliding_window_mla"]
    assert [(g["stored"], g["rows_per_chunk"]) for g in windowed] == [("tail", 128)] * 2  # 128-token tail of 256


def test_table_names_groups_reasons_and_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--preset", "gpt-oss-120b", "--device-family", "cuda", "--chunk-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "SlidingWindowSpec" in out and "FullAttentionSpec" in out
    assert "14,155,776 stored vs 18,874,368 for a naive copier" in out and "1.33x" in out


def test_chunk_tokens_override_and_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--preset", "qwen3-next-80b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunk_tokens"] == 1024  # one mamba state block per chunk
    assert main(["inspect", "--preset", "qwen3-next-80b", "--chunk-tokens", "256"]) == 2
    err = capsys.readouterr().err
    assert "chunk_tokens 256 is not a multiple of the group's token granularity 1024 (one state per block)" in err


def test_skipping_state_and_bad_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--preset", "deepseek-v4-flash", "--skip-spec-kinds", "compressor_state", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["skipped"] for g in data["groups"] if g["kind"] == "compressor_state"] == [True, True]
    assert len(data["caveats"]) == 1 and "approximate" in data["caveats"][0]
    assert main(["inspect", "--preset", "deepseek-v4-flash", "--skip-spec-kinds", "swa"]) == 2
    assert "skip_spec_kinds: unknown spec kinds ['swa']" in capsys.readouterr().err


def test_310p_exists_only_for_ascend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--preset", "llama3-8b-310p", "--device-family", "cuda"]) == 2
    assert "preset llama3-8b-310p exists only for ascend" in capsys.readouterr().err


def test_inspect_model_prints_what_the_weights_fingerprint_is_made_of(tmp_path, capsys) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    assert main(["inspect", "--preset", "llama3-8b", "--json", "--model", str(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out)["weights"]
    assert first["digest"].startswith("sha256:") and first["weight_files"] == 1
    save_file({"w": torch.ones(8) * 3}, str(tmp_path / "model.safetensors"))
    assert main(["inspect", "--preset", "llama3-8b", "--json", "--model", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["weights"]["digest"] != first["digest"]  # content, not the path
    assert main(["inspect", "--preset", "llama3-8b", "--model", str(tmp_path)]) == 0
    assert "weights of" in capsys.readouterr().out
