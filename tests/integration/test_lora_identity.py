"""LoadedAdapters: a LoRA adapter's digest as vLLM loaded it, per lora_int_id (lora_identity.py)."""

from __future__ import annotations

from pathlib import Path

from lmcache_npu.integration.vllm.adapter import LoraRef
from lmcache_npu.integration.vllm.lora_identity import LoadedAdapters


def _adapter(root: Path, content: bytes) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (root / "adapter_model.bin").write_bytes(content)
    return str(root)


def test_the_digest_is_kept_per_id_and_a_change_underneath_bypasses_until_a_reload(tmp_path: Path) -> None:
    path = _adapter(tmp_path / "a", b"v1" * 1000)
    adapters = LoadedAdapters()
    first = adapters.digest(LoraRef("a", 1, path, False))
    assert first is not None and adapters.digest(LoraRef("a", 1, path, False)) == first  # kept
    _adapter(tmp_path / "a", b"v2" * 1001)
    assert adapters.digest(LoraRef("a", 1, path, False)) is None and adapters.stale_ids == {1}
    _adapter(tmp_path / "a", b"v1" * 1000)  # put back: vLLM may still have reloaded v2 meanwhile
    assert adapters.digest(LoraRef("a", 1, path, False)) is None
    _adapter(tmp_path / "a", b"v3" * 1002)
    reloaded = adapters.digest(LoraRef("a", 1, path, True))  # load_inplace: vLLM reads the files again
    assert reloaded is not None and reloaded != first and adapters.stale_ids == set()
    assert adapters.digest(LoraRef("a", 1, path, False)) == reloaded


def test_ids_are_independent_and_unreadable_or_moved_adapters_name_nothing(tmp_path: Path) -> None:
    adapters = LoadedAdapters()
    one = adapters.digest(LoraRef("a", 1, _adapter(tmp_path / "a", b"x" * 100), False))
    two = adapters.digest(LoraRef("b", 2, _adapter(tmp_path / "b", b"y" * 100), False))
    assert one is not None and two is not None and one != two
    assert adapters.digest(LoraRef("c", 3, str(tmp_path / "missing"), False)) is None
    assert adapters.digest(LoraRef("a", 1, str(tmp_path / "b"), False)) is None  # same id, other path: unknown
    assert adapters.stale_ids == {1} and adapters.digest(LoraRef("b", 2, str(tmp_path / "b"), False)) == two
