"""Model identity from content: fingerprints of real safetensors/.bin checkpoints built in tmp dirs."""

import json
import logging
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_npu.identity.adapters import AdapterDigests, adapter_digest
from lmcache_npu.identity.sampling import PAGE_BYTES
from lmcache_npu.identity.weights import NoWeightsFound, find_model_dir, fingerprint_weights

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (make setup)")

# Small enough that the sampling path runs on a ~1 MB checkpoint (the default budget would read it whole).
SAMPLED = 256 << 10
EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensors(seed: int, spec: dict[str, tuple[tuple[int, ...], "torch.dtype"]]) -> dict[str, "torch.Tensor"]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype) in spec.items()}


def _write_model(root: Path, shards: dict[str, dict[str, "torch.Tensor"]], extra: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        safetensors_torch.save_file(tensors, str(root / name))
    (root / "config.json").write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 2}))
    if extra:
        (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
        (root / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
        (root / "README.md").write_text("# a model\n")
    return root


def _many_tensor_shards() -> dict[str, dict[str, "torch.Tensor"]]:
    """Shard 1: 30 small tensors (4 B .. 3 KiB, read whole when sampled) among 6 large ones; shard 2: 3 large."""
    small = {f"layers.{i}.norm": ((1 + 25 * i,), torch.float32) for i in range(30)}
    large = {f"layers.{i}.proj": ((64 + 32 * i, 256), torch.float32) for i in range(6)}
    one = _tensors(1, {**small, **large, "layers.0.k_scale": ((1,), torch.float32)})
    two = _tensors(2, {f"layers.{i}.mlp": ((128, 256 + 64 * i), torch.bfloat16) for i in range(3)})
    return {"model-00001-of-00002.safetensors": one, "model-00002-of-00002.safetensors": two}


def _tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute [begin, end) of each tensor, parsed here independently of the module under test."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("many") / "model", _many_tensor_shards())


@pytest.fixture()
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every os.pread and os.preadv (the page-cache path) the fingerprint makes, as (file path, offset, bytes
    returned), counted outside the module."""
    seen: list[tuple[str, int, int]] = []
    real, real_v = os.pread, os.preadv

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = real(fd, length, offset)
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(data)))
        return data

    def counting_v(fd: int, buffers: list, offset: int, *flags: int) -> int:
        got = real_v(fd, buffers, offset, *flags)
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), offset, got))
        return got

    monkeypatch.setattr(os, "pread", counting)
    monkeypatch.setattr(os, "preadv", counting_v)
    return seen


def test_copies_and_renamed_directories_are_equal(tmp_path: Path) -> None:
    a = _write_model(tmp_path / "a", _many_tensor_shards())
    shutil.copytree(a, tmp_path / "b")
    (tmp_path / "b").rename(tmp_path / "renamed")
    for budget in (SAMPLED, 512 << 20):
        fa = fingerprint_weights(a, max_read_bytes=budget)
        assert len(fa.digest) == 32
        assert fingerprint_weights(tmp_path / "renamed", max_read_bytes=budget).digest == fa.digest
    # Negative control: the same comparison sees one flipped byte (a small tensor, read whole even when sampling).
    begin, _ = _tensor_ranges(tmp_path / "renamed" / "model-00001-of-00002.safetensors")["layers.3.norm"]
    _flip(tmp_path / "renamed" / "model-00001-of-00002.safetensors", begin + 5)
    for budget in (SAMPLED, 512 << 20):
        assert fingerprint_weights(tmp_path / "renamed", max_read_bytes=budget).digest != \
            fingerprint_weights(a, max_read_bytes=budget).digest


def test_small_checkpoint_is_read_whole_and_described(many: Path) -> None:
    fp = fingerprint_weights(many)
    sizes = sum(p.stat().st_size for p in many.glob("*.safetensors"))
    assert fp.read_whole and fp.files == 2 and fp.weight_bytes == sizes and fp.tensors == 40
    assert fp.bytes_read == sizes + (many / "config.json").stat().st_size
    described = json.loads(json.dumps(fp.describe()))
    assert described["digest"] == fp.digest.hex() and described["definition_files"] == ["config.json"]


@EXAMPLES
@given(data=st.data())
def test_any_byte_of_any_tensor_is_seen_when_read_whole(many: Path, data: st.DataObject) -> None:
    before = fingerprint_weights(many).digest
    shard = many / data.draw(st.sampled_from(sorted(p.name for p in many.glob("*.safetensors"))))
    begin, end = data.draw(st.sampled_from(sorted(_tensor_ranges(shard).values())))
    offset = data.draw(st.integers(begin, end - 1))
    _flip(shard, offset)
    try:
        assert fingerprint_weights(many).digest != before
    finally:
        _flip(shard, offset)
    assert fingerprint_weights(many).digest == before  # restored: the flip, not something else, made the change


@EXAMPLES
@given(data=st.data())
def test_any_byte_of_a_small_tensor_is_seen_when_sampling(many: Path, data: st.DataObject) -> None:
    shard = many / "model-00001-of-00002.safetensors"
    small = sorted(r for r in _tensor_ranges(shard).values() if r[1] - r[0] <= PAGE_BYTES)
    assert len(small) == 31  # 30 norms and a KV scale, among the 6 large projections of the same shard
    fp = fingerprint_weights(many, max_read_bytes=SAMPLED)
    assert not fp.read_whole and fp.tensor_sample_bytes == PAGE_BYTES and fp.bytes_read <= SAMPLED
    begin, end = data.draw(st.sampled_from(small))
    offset = data.draw(st.integers(begin, end - 1))
    _flip(shard, offset)
    try:
        assert fingerprint_weights(many, max_read_bytes=SAMPLED).digest != fp.digest
    finally:
        _flip(shard, offset)
    assert fingerprint_weights(many, max_read_bytes=SAMPLED).digest == fp.digest


@EXAMPLES
@given(data=st.data())
def test_a_fine_tuned_large_tensor_is_seen_when_sampling(many: Path, data: st.DataObject) -> None:
    """A fine-tune changes (nearly) every element of the tensors it touched: every large tensor is sampled."""
    shard = many / data.draw(st.sampled_from(sorted(p.name for p in many.glob("*.safetensors"))))
    large = sorted(r for r in _tensor_ranges(shard).values() if r[1] - r[0] > PAGE_BYTES)
    begin, end = data.draw(st.sampled_from(large))
    before = fingerprint_weights(many, max_read_bytes=SAMPLED).digest
    original = shard.read_bytes()
    tuned = bytearray(original)
    stride = data.draw(st.integers(1, 64))  # how sparse the change is, down to one byte in 64
    for i in range(begin, end, stride):
        tuned[i] ^= 0x01
    shard.write_bytes(bytes(tuned))
    try:
        assert fingerprint_weights(many, max_read_bytes=SAMPLED).digest != before
    finally:
        shard.write_bytes(original)
    assert fingerprint_weights(many, max_read_bytes=SAMPLED).digest == before


def test_sampled_bytes_are_seen_and_unsampled_ones_are_not(many: Path, reads: list) -> None:
    """Sampling is what it says: a byte of a large tensor inside a read range changes the digest, one outside
    every read range does not (the budget is real, not a whole read in disguise)."""
    shard = many / "model-00001-of-00002.safetensors"
    begin, end = _tensor_ranges(shard)["layers.5.proj"]
    before = fingerprint_weights(many, max_read_bytes=SAMPLED).digest
    mine = [(o, o + n) for path, o, n in reads if path == str(shard.resolve()) and n]
    inside = next(max(o, begin) for o, e in mine if o < end and begin < e)
    outside = next(i for i in range(begin, end) if not any(o <= i < e for o, e in mine))
    for offset, changes in ((inside, True), (outside, False)):
        _flip(shard, offset)
        try:
            assert (fingerprint_weights(many, max_read_bytes=SAMPLED).digest != before) is changes
        finally:
            _flip(shard, offset)


def test_kv_scale_change_is_seen(tmp_path: Path) -> None:
    shards = _many_tensor_shards()
    a = _write_model(tmp_path / "a", shards)
    shards["model-00001-of-00002.safetensors"]["layers.0.k_scale"] = torch.tensor([0.25])
    b = _write_model(tmp_path / "b", shards)
    assert fingerprint_weights(a, max_read_bytes=SAMPLED).digest != _sampled(b)
    shards["model-00001-of-00002.safetensors"]["layers.0.k_scale"] = torch.tensor([0.25])
    c = _write_model(tmp_path / "c", shards)  # control: rebuilding the same tensors gives the same digest
    assert _sampled(b) == _sampled(c)


def test_cached_and_device_reads_give_one_digest(many: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches whose pages are cached are read on the calling thread (RWF_NOWAIT), the rest on the pool: the
    digest must not depend on which path a batch took, and both paths see a changed byte."""
    from lmcache_npu.identity import sample_reads

    cached = fingerprint_weights(many, max_read_bytes=SAMPLED, threads=4).digest
    monkeypatch.setattr(sample_reads, "RWF_NOWAIT", None)  # every batch through the blocking reads of the pool
    assert fingerprint_weights(many, max_read_bytes=SAMPLED, threads=4).digest == cached
    assert fingerprint_weights(many, max_read_bytes=SAMPLED, threads=1).digest == cached
    shard = many / "model-00001-of-00002.safetensors"
    begin, _ = _tensor_ranges(shard)["layers.0.k_scale"]
    _flip(shard, begin)
    try:
        assert fingerprint_weights(many, max_read_bytes=SAMPLED, threads=4).digest != cached
        monkeypatch.undo()
        assert fingerprint_weights(many, max_read_bytes=SAMPLED, threads=4).digest != cached
    finally:
        _flip(shard, begin)


def _sampled(root: Path) -> bytes:
    return fingerprint_weights(root, max_read_bytes=SAMPLED).digest


def test_definition_files_count_and_tokenizer_readme_do_not(tmp_path: Path) -> None:
    root = _write_model(tmp_path / "m", _many_tensor_shards())
    (root / "modeling_custom.py").write_text("SCALE = 1\n")
    base = fingerprint_weights(root, max_read_bytes=SAMPLED)
    assert set(base.definition_files) == {"config.json", "modeling_custom.py"}
    for name, text in (("tokenizer.json", "{}"), ("README.md", "new text"), ("generation_config.json", "{}"),
                       ("special_tokens_map.json", "{}"), ("merges.txt", "a b")):
        (root / name).write_text(text)
        assert fingerprint_weights(root, max_read_bytes=SAMPLED).digest == base.digest, name
    for name, text in (("config.json", json.dumps({"hidden_size": 256, "num_hidden_layers": 3})),
                       ("modeling_custom.py", "SCALE = 2\n"), ("quant_config.json", "{}")):
        original = (root / name).read_text() if (root / name).exists() else None
        (root / name).write_text(text)
        assert fingerprint_weights(root, max_read_bytes=SAMPLED).digest != base.digest, name
        if original is None:
            (root / name).unlink()
        else:
            (root / name).write_text(original)
    assert fingerprint_weights(root, max_read_bytes=SAMPLED).digest == base.digest


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + n]))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_header_dtype_change_is_seen(tmp_path: Path) -> None:
    root = _write_model(tmp_path / "m", {"model.safetensors": _tensors(3, {"w": ((64, 512), torch.float16)})})
    before = fingerprint_weights(root, max_read_bytes=SAMPLED).digest
    shard = root / "model.safetensors"
    _rewrite_header(shard, lambda h: h)  # control: re-serialising the same header only (maybe) changes spacing
    same_fields = fingerprint_weights(root, max_read_bytes=SAMPLED).digest
    _rewrite_header(shard, lambda h: {**h, "w": {**h["w"], "dtype": "BF16"}})
    after = fingerprint_weights(root, max_read_bytes=SAMPLED).digest
    assert after != before and after != same_fields
    _rewrite_header(shard, lambda h: {**h, "w": {**h["w"], "dtype": "F16"}})
    assert fingerprint_weights(root, max_read_bytes=SAMPLED).digest == same_fields


def test_truncated_and_malformed_shards_are_refused(tmp_path: Path) -> None:
    root = _write_model(tmp_path / "m", _many_tensor_shards())
    shard = root / "model-00002-of-00002.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors.*truncated"):
        fingerprint_weights(root)
    shard.write_bytes(good[:40])  # cut inside the header
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: safetensors header length .* absurd"):
        fingerprint_weights(root)
    shard.write_bytes(b"\xff" * 8 + good[8:])
    with pytest.raises(ValueError, match="absurd"):
        fingerprint_weights(root)
    shard.write_bytes(struct.pack("<Q", 8) + b"not json" + good[16:])
    with pytest.raises(ValueError, match="not valid JSON"):
        fingerprint_weights(root)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        fingerprint_weights(root)
    shard.write_bytes(good)
    _rewrite_header(shard, lambda h: {**h, "layers.0.mlp": {**h["layers.0.mlp"], "shape": [128, 3]}})
    with pytest.raises(ValueError, match="layers.0.mlp.*data_offsets span"):
        fingerprint_weights(root)
    shard.write_bytes(good)  # control: the intact shard is accepted
    assert len(fingerprint_weights(root).digest) == 32


def test_no_weights_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.txt").write_text("not weights")
    with pytest.raises(NoWeightsFound, match=re.escape(str(tmp_path)) + r".*\*\.safetensors.*\*\.bin"):
        fingerprint_weights(tmp_path)
    assert issubclass(NoWeightsFound, ValueError)
    with pytest.raises(ValueError, match="not a directory"):
        fingerprint_weights(tmp_path / "missing")


def test_bin_checkpoints(tmp_path: Path) -> None:
    small = {"w": torch.randn(16, 16, generator=torch.Generator().manual_seed(4))}
    large = {"w": torch.randn(1024, 512, generator=torch.Generator().manual_seed(5))}  # 2 MiB: sampled
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
        torch.save(small, root / "pytorch_model-00001.bin")
        torch.save(large, root / "pytorch_model-00002.bin")
        (root / "config.json").write_text("{}")
    fa = fingerprint_weights(a, max_read_bytes=SAMPLED)
    assert not fa.read_whole and fa.files == 2 and fa.bytes_read <= SAMPLED
    assert fingerprint_weights(b, max_read_bytes=SAMPLED).digest == fa.digest
    size = (b / "pytorch_model-00002.bin").stat().st_size
    for name, offset in (("pytorch_model-00001.bin", 700), ("pytorch_model-00002.bin", size - 1),
                         ("pytorch_model-00002.bin", 0)):
        _flip(b / name, offset)
        assert fingerprint_weights(b, max_read_bytes=SAMPLED).digest != fa.digest, (name, offset)
        _flip(b / name, offset)
    assert fingerprint_weights(b, max_read_bytes=SAMPLED).digest == fa.digest


def _crowded(root: Path) -> Path:
    """900 tensors of 8 KiB in three shards: 3.6 MiB of one-page samples, more than the budgets below allow."""
    shards = {f"model-{s}.safetensors": _tensors(s, {f"t{s}.{i}": ((2048,), torch.float32) for i in range(300)})
              for s in range(3)}
    return _write_model(root, shards, extra=False)


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _crowded(tmp_path_factory.mktemp("crowded") / "model")


def test_budget_is_respected_and_every_tensor_is_still_sampled(crowded: Path, reads: list) -> None:
    budget = 1 << 20
    fp = fingerprint_weights(crowded, max_read_bytes=budget)
    counted = sum(n for _, _, n in reads)
    assert counted == fp.bytes_read <= budget
    assert fp.tensors == 900 and 0 < fp.tensor_sample_bytes < PAGE_BYTES
    shards = sorted(crowded.glob("*.safetensors"))
    assert len(shards) == 3 and all(_unsampled(reads, shard) == [] for shard in shards)
    # Control: the coverage check notices a tensor whose reads are taken away.
    begin, end = _tensor_ranges(shards[1])["t1.123"]
    without = [(p, o, n) for p, o, n in reads if not (p == str(shards[1].resolve()) and o < end and begin < o + n)]
    assert "t1.123" in _unsampled(without, shards[1])


def _unsampled(reads: list, shard: Path) -> list[str]:
    mine = [(o, o + n) for path, o, n in reads if path == str(shard.resolve())]
    return [name for name, (begin, end) in _tensor_ranges(shard).items()
            if not any(o < end and begin < e for o, e in mine)]


@EXAMPLES
@given(budget=st.integers(16 << 10, 4 << 20))
def test_any_budget_is_respected_or_refused(crowded: Path, budget: int) -> None:
    counted = []
    real, real_v = os.pread, os.preadv

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = real(fd, length, offset)
        counted.append(len(data))
        return data

    def counting_v(fd: int, buffers: list, offset: int, *flags: int) -> int:
        got = real_v(fd, buffers, offset, *flags)
        counted.append(got)
        return got

    os.pread, os.preadv = counting, counting_v
    try:
        fp = fingerprint_weights(crowded, max_read_bytes=budget)
    except ValueError as exc:
        headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in crowded.glob("*.safetensors"))
        assert f"max_read_bytes {budget} is too small" in str(exc) and budget < headers + 900  # a byte per tensor
        return
    finally:
        os.pread, os.preadv = real, real_v
    assert sum(counted) == fp.bytes_read <= budget


def test_budget_too_small_is_refused(crowded: Path) -> None:
    with pytest.raises(ValueError, match="max_read_bytes 1000 is too small"):
        fingerprint_weights(crowded, max_read_bytes=1000)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_read_bytes must be an integer >= 1"):
            fingerprint_weights(crowded, max_read_bytes=bad)
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        fingerprint_weights(crowded, threads=0)


def test_threads_do_not_change_the_digest(crowded: Path) -> None:
    one = fingerprint_weights(crowded, max_read_bytes=2 << 20, threads=1)
    assert fingerprint_weights(crowded, max_read_bytes=2 << 20, threads=7).digest == one.digest
    # Control: a different budget samples differently, and the comparison notices.
    assert fingerprint_weights(crowded, max_read_bytes=1 << 20, threads=7).digest != one.digest


def test_symlinked_snapshot_uses_link_names(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot: files are symlinks into blobs/ named by hash; the link names count."""
    plain = _write_model(tmp_path / "plain", _many_tensor_shards())
    blobs = tmp_path / "hub" / "blobs"
    snapshot = tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(plain.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    (snapshot / ".cache").mkdir()
    (snapshot / ".cache" / "download.json").write_text("{\"etag\": 1}")  # hidden tool metadata is ignored
    for budget in (SAMPLED, 512 << 20):
        assert fingerprint_weights(snapshot, max_read_bytes=budget).digest == \
            fingerprint_weights(plain, max_read_bytes=budget).digest
    blob = (snapshot / "model-00001-of-00002.safetensors").resolve()
    assert blob.parent == blobs.resolve()
    begin, _ = _tensor_ranges(blob)["layers.0.k_scale"]
    _flip(blob, begin)  # control: the link is read through
    assert fingerprint_weights(snapshot).digest != fingerprint_weights(plain).digest
    (snapshot / "model-00001-of-00002.safetensors").unlink()
    (snapshot / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors .* broken symlink"):
        fingerprint_weights(snapshot)


def _adapter(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    tensors = _tensors(seed, {"base_model.model.layers.0.q_proj.lora_A.weight": ((8, 256), torch.float32),
                              "base_model.model.layers.0.q_proj.lora_B.weight": ((256, 8), torch.float32)})
    safetensors_torch.save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return root


def test_adapter_digest(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", 6)
    digest = adapter_digest(a)
    assert len(digest) == 32 and digest != fingerprint_weights(a).digest
    b = _adapter(tmp_path / "b", 6)
    assert adapter_digest(b) == digest  # same content elsewhere: equal
    shard = b / "adapter_model.safetensors"
    begin, end = _tensor_ranges(shard)["base_model.model.layers.0.q_proj.lora_B.weight"]
    _flip(shard, end - 1)
    assert adapter_digest(b) != digest
    (b / "adapter_model.safetensors").unlink()
    with pytest.raises(NoWeightsFound):
        adapter_digest(b)


def test_adapter_cache_recomputes_after_a_rewrite(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = AdapterDigests()
    a = _adapter(tmp_path / "a", 7)
    first = cache.get(a)
    assert first == adapter_digest(a) and cache.get(str(a)) == first and cache.computed == 1
    shard = a / "adapter_model.safetensors"
    begin, _ = _tensor_ranges(shard)["base_model.model.layers.0.q_proj.lora_B.weight"]
    st_before = shard.stat()
    _flip(shard, begin)
    os.utime(shard, ns=(st_before.st_atime_ns, st_before.st_mtime_ns + 1_000_000))  # as a later write would
    second = cache.get(a)
    assert cache.computed == 2 and second is not None and second != first
    assert cache.get(a) == second and cache.computed == 2
    with caplog.at_level(logging.WARNING, logger="lmcache_npu.identity.adapters"):
        assert cache.get(tmp_path / "missing") is None
        assert cache.get(tmp_path / "missing") is None
        empty = tmp_path / "empty"
        empty.mkdir()
        assert cache.get(empty) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "missing" in warnings[0].getMessage() and "empty" in warnings[1].getMessage()


def test_find_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _write_model(tmp_path / "local", _many_tensor_shards(), extra=False)
    assert find_model_dir(str(local)) == str(local)
    for uri in ("s3://bucket/model", "gs://b/m", "https://example.com/m", "hf://org/name"):
        assert find_model_dir(uri) is None
    assert find_model_dir(str(local / "config.json")) is None
    cache = tmp_path / "hf"
    assert find_model_dir("org/name", download_dir=str(cache)) is None
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(local, repo / "snapshots" / commit)
    found = find_model_dir("org/name", download_dir=str(cache))
    assert found is not None and Path(found) == repo / "snapshots" / commit
    assert find_model_dir("org/name", revision=commit, download_dir=str(cache)) == found
    assert find_model_dir("org/name", revision="other-branch", download_dir=str(cache)) is None
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed: no hub lookup at all
    assert find_model_dir("org/name", download_dir=str(cache)) is None
    with pytest.raises(ValueError, match="model must be a non-empty string"):
        find_model_dir("")
