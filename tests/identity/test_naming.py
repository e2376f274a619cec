"""identity/naming.py: how the engine and doctor name an engine's weights: by the content of a local checkpoint, or by
nothing with the reason, which the refusal of tiers that outlive the engine quotes."""

from __future__ import annotations

from pathlib import Path

from lmcache_npu.identity.naming import content_of, unnamed_weights_refusal
from lmcache_npu.identity.weights import WeightsFingerprint


def test_a_checkpoint_is_named_by_its_content_wherever_it_lies(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file({"w": torch.ones(4)}, str(tmp_path / name / "model.safetensors"))
    first, where = content_of(str(tmp_path / "a"))
    second, _ = content_of(str(tmp_path / "b"))
    assert isinstance(first, WeightsFingerprint) and where == str(tmp_path / "a")
    assert isinstance(second, WeightsFingerprint) and first.digest == second.digest


def test_negative_control_without_weight_files_nothing_names_them_and_the_reason_is_given(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    reason, where = content_of(str(tmp_path))
    assert isinstance(reason, str) and "holds no weight files" in reason and where == ""
    missing, _ = content_of(str(tmp_path / "gone"))
    assert missing == f"{str(tmp_path / 'gone')!r} is neither a local directory nor a cached hub snapshot"


def test_the_refusal_quotes_the_reason_and_names_the_key() -> None:
    text = unnamed_weights_refusal("load_format 'dummy' does not read the weights from local files")
    assert "(load_format 'dummy' does not read the weights from local files)" in text
    assert "model_fingerprint" in text and "host arena alone" in text
