"""Parsers that only fail one way (issue 31 item 5, audit finding N5): every input boundary raises ValueError for any
input, never OverflowError, RecursionError, TypeError, KeyError, struct.error or the like.

One bounded hypothesis fuzz test per boundary, each with a negative control (a valid input still parses, so the
harness is not vacuous), and the findings of the 2026-11 re-audit as explicit regressions. `_only_value_error` lets
a ValueError pass and lets any other exception fail the test with its traceback.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache_npu.tools.bench.geometry import geometry_from_dict, load_geometry
from lmcache_npu.config import ENV_PREFIX, ConnectorConfig, load_config
from lmcache_npu.tools.status import engine_status, parse_metrics, render, to_json
from lmcache_npu.identity import weights as identity
from lmcache_npu.identity.adapters import AdapterDigests
from lmcache_npu.identity.safetensors_header import parse_header
from lmcache_npu.store.config import MAX_SIZE_BYTES, MooncakeConfig, StoreConfig, parse_bytes
from lmcache_npu.store.disk import HEADER_BYTES, DiskTier, scan_disk_directory
from lmcache_npu.store.envelope import ENVELOPE_BYTES, Sealer, seal, sealed_bytes, verify
from lmcache_npu.store.keys import ChunkKey

FUZZ = settings(max_examples=200, deadline=None)
FUZZ_FS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


def _only_value_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The call's result, or None when it raised ValueError; any other exception propagates and fails the test."""
    try:
        return call(*args, **kwargs)
    except ValueError:
        return None


def _deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):  # a loop: building it must not recurse either
        value = [value]
    return value


# ---- shared strategies -------------------------------------------------------------------------------------------

_huge_digits = st.integers(300, 5000).map(lambda n: "9" * n)
_special_numbers = st.sampled_from(["+Inf", "-Inf", "inf", "NaN", "nan", "1e308", "1e309", "-0", "0x10", "1_000",
                                    "\u0661\u0662", "9" * 19, "18446744073709551616"])
_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | _huge_digits | _special_numbers)
_json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
_UNITS = ["", "B", "k", "KB", "m", "MB", "G", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "gib", "PiB", "x", "e3"]
_size_strings = st.builds(lambda digits, frac, space, unit: f"{digits}{frac}{space}{unit}",
                          st.text("0123456789", min_size=1, max_size=40) | _huge_digits,
                          st.sampled_from(["", ".", ".5", ".000001", ".99999999999"]),
                          st.sampled_from(["", " ", "\t"]), st.sampled_from(_UNITS))
_config_keys = st.sampled_from([k for k in ConnectorConfig.keys() if k != "config_file"])
_MOONCAKE = {"master": "127.0.0.1:50051", "metadata": "http://127.0.0.1:8080/metadata"}


# ---- 1. config: extra_config, environment, YAML file, sizes -------------------------------------------------------

@FUZZ
@given(st.dictionaries(_config_keys | st.text(max_size=6) | st.integers(), _json_values | _size_strings, max_size=6))
@example({"cpu_bytes": "9" * 400})  # N5: OverflowError at sections.py:25
@example({"cpu_bytes": "9" * 400 + ".5GiB"})
@example({"mooncake": {**_MOONCAKE, "global_segment_bytes": "9" * 400}})
@example({1: 2, "cpu_byte": 3})  # keys of two types: sorted() raised TypeError
@example({"backend": "torch", "backend_options": {1: 2, "x": 3}})
def test_extra_config_fails_only_with_value_error(values: dict) -> None:
    _only_value_error(load_config, values, environ={})


@FUZZ
@given(st.dictionaries(_config_keys.map(lambda k: ENV_PREFIX + k.upper()),
                       st.text(max_size=40) | _huge_digits | _special_numbers
                       | st.integers(1, 20_000).map(lambda n: "[" * n) | _json_values.map(json.dumps), max_size=3))
@example({ENV_PREFIX + "MOONCAKE": "[" * 100_000})  # N5: RecursionError at config.py:180
@example({ENV_PREFIX + "BACKEND_OPTIONS": "1" * 5000})  # an int past Python's digit limit
@example({ENV_PREFIX + "IO_THREADS": "9" * 5000})
def test_environment_values_fail_only_with_value_error(environ: dict) -> None:
    _only_value_error(load_config, {}, environ=environ)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


_yaml_texts = (st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1"))
               | _json_values.map(lambda v: yaml.safe_dump({"cpu_bytes": v, "mooncake": v}))
               | st.dictionaries(_config_keys, _json_values | _size_strings, max_size=4).map(yaml.safe_dump)
               | st.sampled_from([50, 1100]).map(lambda n: "a: " + "[" * n))  # pyyaml is slow on depth


@FUZZ_FS
@given(text=_yaml_texts, raw=st.binary(max_size=64))
@example(text="[" * 1100, raw=b"")  # N5: RecursionError at config.py:208
@example(text="io_threads: " + "9" * 5000, raw=b"")
@example(text="a: &a [*a]\nmodel_name: &b [*b]", raw=b"")  # a self-referencing alias
@example(text="", raw=b"\xff\xfe\x00 not utf-8")
@example(text="mooncake: &a {master: *a}", raw=b"")
def test_config_file_fails_only_with_value_error(scratch: Path, text: str, raw: bytes) -> None:
    path = scratch / "config.yaml"
    path.write_bytes(raw + text.encode("utf-8", "surrogatepass"))
    _only_value_error(load_config, {"config_file": str(path)}, environ={})


@FUZZ
@given(_size_strings | _scalars | _json_values)
def test_sizes_fail_only_with_value_error_and_stay_in_range(value: Any) -> None:
    size = _only_value_error(parse_bytes, "cpu_bytes", value)
    assert size is None or (type(size) is int and 0 <= size <= MAX_SIZE_BYTES)
    _only_value_error(StoreConfig.from_dict, {"cpu_bytes": value, "disk_path": "/x", "disk_bytes": value})
    _only_value_error(MooncakeConfig.from_dict, {**_MOONCAKE, "bounce_bytes": value, "timeout_s": value})


@FUZZ
@given(st.integers(0, 10**6), st.sampled_from(["B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "TiB"]))
def test_valid_sizes_still_parse_exactly(number: int, unit: str) -> None:
    multiple = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
                "TiB": 2**40}[unit]
    assert parse_bytes("cpu_bytes", f"{number}{unit}") == number * multiple
    assert parse_bytes("cpu_bytes", f"{number}.5 {unit}") == number * multiple + multiple // 2


def test_valid_configs_still_load_from_every_source(scratch: Path) -> None:
    """Negative control of the config fuzzers: the same boundaries accept good input from each source."""
    config = load_config({"cpu_bytes": "1.5GiB", "backend": "torch", "skip_spec_kinds": [], "io_threads": 3,
                          "mooncake": {**_MOONCAKE, "global_segment_bytes": "2GiB"}}, environ={})
    assert config.store.cpu_bytes == 3 << 29 and config.store.io_threads == 3
    assert config.store.mooncake_config().global_segment_bytes == 2 << 30
    assert parse_bytes("cpu_bytes", str(MAX_SIZE_BYTES)) == MAX_SIZE_BYTES  # exact: float() used to round it
    path = scratch / "good.yaml"
    path.write_text(yaml.safe_dump({"cpu_bytes": "2GiB", "mooncake": _MOONCAKE}))
    config = load_config({"config_file": str(path)}, environ={ENV_PREFIX + "IO_THREADS": "5",
                                                              ENV_PREFIX + "BACKEND_OPTIONS": "{}"})
    assert config.store.cpu_bytes == 2 << 30 and config.store.io_threads == 5 and config.store.mooncake is not None


@pytest.mark.parametrize("source,match", [
    (lambda p: load_config({"cpu_bytes": "9" * 400}, environ={}), r"cpu_bytes: expected a size in bytes"),
    (lambda p: load_config({"cpu_bytes": str(2**63)}, environ={}), r"cpu_bytes: a size must be at most"),
    (lambda p: load_config({}, environ={ENV_PREFIX + "MOONCAKE": "[" * 100_000}),
     r"LMCACHE_NPU_MOONCAKE: expected JSON"),
    (lambda p: (p.write_text("[" * 1100), load_config({"config_file": str(p)}, environ={})),
     r"config_file '.*': not a readable YAML config \(RecursionError"),
    (lambda p: (p.write_bytes(b"\xff\xfe"), load_config({"config_file": str(p)}, environ={})),
     r"config_file '.*': not UTF-8 text"),
    (lambda p: load_config({"mooncake": _deep(50)}, environ={}), r"mooncake: the value nests deeper than 16"),
    (lambda p: load_config({"backend_options": _deep(5000)}, environ={}), r"backend_options: the value nests"),
    (lambda p: load_config({"model_name": list(range(20_000))}, environ={}), r"model_name: the value holds more"),
    (lambda p: load_config([("cpu_bytes", 1)], environ={}), r"kv_connector_extra_config must be an object"),
    (lambda p: MooncakeConfig.from_dict(["master"]), r"the mooncake config must be an object"),
], ids=["400-digit size", "size past 2**63", "deep env JSON", "deep YAML", "YAML not UTF-8", "deep value",
        "very deep value", "many items", "extra_config not a mapping", "mooncake not a mapping"])
def test_config_findings_are_named_value_errors(scratch: Path, source: Callable, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        source(scratch / "finding.yaml")


# ---- 2. geometry JSON ---------------------------------------------------------------------------------------------

_GEOMETRY = {"chunk_tokens": 256, "name": "g", "groups": [
    {"tokens_per_block": 128, "compress_ratio": 1, "sliding_window": None, "skip": False, "planes": [
        {"row_bytes": 64, "rows_per_block": 128, "block_stride_bytes": 8192, "num_blocks": 16, "dtype": "bf16"}]}]}


def _replace_at(data: Any, path: list[int], value: Any) -> Any:
    """`data` with the node picked by `path` (indices into the JSON tree, taken modulo its fan-out) replaced."""
    if not path or not isinstance(data, (dict, list)) or not data:
        return value
    if isinstance(data, dict):
        key = sorted(data)[path[0] % len(data)]
        return {**data, key: _replace_at(data[key], path[1:], value)}
    index = path[0] % len(data)
    return [*data[:index], _replace_at(data[index], path[1:], value), *data[index + 1:]]


@FUZZ
@given(st.lists(st.integers(0, 20), max_size=5), _json_values, _json_values)
@example([0], "x", None)  # chunk_tokens "x": int() raised ValueError, unnamed
@example([0], math.inf, None)  # N5: OverflowError at geometry.py:91
@example([1, 0, 1, 0, 1], [], None)  # dtype []: TypeError (unhashable) at geometry.py:83
@example([1, 0, 1, 0, 3], "x", None)  # row_bytes "x": TypeError at geometry.py:87 (comparisons)
@example([1], 5, None)  # groups 5: TypeError (not iterable) at geometry.py:77
def test_geometry_fails_only_with_value_error(path: list[int], value: Any, whole: Any) -> None:
    _only_value_error(geometry_from_dict, _replace_at(_GEOMETRY, path, value))
    _only_value_error(geometry_from_dict, whole)


@FUZZ_FS
@given(st.binary(max_size=300) | _json_values.map(lambda v: json.dumps(v).encode())
       | st.integers(1, 20_000).map(lambda n: b"[" * n))
@example(b"[" * 100_000)
@example(b"\xff\xfe\xfd")
def test_geometry_files_fail_only_with_value_error(scratch: Path, raw: bytes) -> None:
    path = scratch / "geometry.json"
    path.write_bytes(raw)
    _only_value_error(load_geometry, path)


def test_valid_geometry_still_parses(scratch: Path) -> None:
    geometry = geometry_from_dict(_GEOMETRY)
    assert geometry.chunk_tokens == 256 and geometry.groups[0].planes[0].dtype == "bf16"
    assert geometry_from_dict(json.loads(json.dumps(geometry.to_dict()))) == geometry
    path = scratch / "good.json"
    path.write_text(json.dumps(_GEOMETRY))
    assert load_geometry(path) == geometry_from_dict(_GEOMETRY, name="good")
    with pytest.raises(ValueError, match=r"groups\[0\]\.planes\[0\]: row_bytes must be an integer from 1"):
        geometry_from_dict(_replace_at(_GEOMETRY, [1, 0, 1, 0, 3], "64"))  # the path of the examples above
    with pytest.raises(ValueError, match="missing.json: cannot read the geometry file"):
        load_geometry(scratch / "missing.json")


# ---- 3. envelopes -------------------------------------------------------------------------------------------------

KEY = ChunkKey("ab" * 16, bytes(range(32)))
SECRET = b"0123456789abcdef-secret"
_SEALERS = [Sealer(), Sealer(SECRET), Sealer(digest="sha256"), Sealer(SECRET, digest="blake2b")]
_odd = st.none() | st.integers() | st.floats() | st.text(max_size=40) | st.binary(max_size=40) | st.booleans()


@FUZZ
@given(sealer_index=st.integers(0, 3), edits=st.lists(st.tuples(st.integers(0, ENVELOPE_BYTES - 1),
                                                                  st.integers(0, 255)), max_size=6),
       length=st.integers(0, 600), key=st.just(KEY) | st.builds(ChunkKey, _odd, _odd) | _odd
       | st.tuples(st.text(max_size=40), st.binary(max_size=100)).map(lambda t: ChunkKey(*t)),
       rank=st.just(3) | _odd | st.integers(-2**70, 2**70), view_kind=st.sampled_from(["ndarray", "bytes",
                                                                                       "bytearray", "str", "none"]))
@example(sealer_index=0, edits=[], length=0, key=ChunkKey(5, b"x"), rank=3, view_kind="ndarray")  # non-str namespace
def test_envelope_entry_points_fail_only_with_value_error(sealer_index: int, edits: list, length: int, key: Any,
                                                          rank: Any, view_kind: str) -> None:
    sealer = _SEALERS[sealer_index]
    data = np.random.default_rng(length).integers(0, 256, sealed_bytes(length), dtype=np.uint8)
    seal(data, KEY, 3, sealer)
    for offset, value in edits:  # mutate the trailer
        data[-ENVELOPE_BYTES + offset] = value
    view = {"ndarray": data, "bytes": data.tobytes(), "bytearray": bytearray(data.tobytes()),
            "str": "x" * data.size, "none": None}[view_kind]
    why = _only_value_error(verify, view, key, rank, sealer)
    assert why is None or isinstance(why, str)
    _only_value_error(verify, data, KEY, 3, sealer_index)  # not a Sealer
    _only_value_error(seal, view, key, rank, sealer)
    _only_value_error(Sealer, key, rank)  # a secret and a digest of any type


def test_valid_envelopes_still_verify() -> None:
    for sealer in _SEALERS:
        data = np.random.default_rng(1).integers(0, 256, sealed_bytes(1000), dtype=np.uint8)
        seal(data, KEY, 3, sealer)
        assert verify(data, KEY, 3, sealer) is None
        assert verify(data, KEY, np.int64(3), sealer) is None  # a numpy rank is still a rank
        data[5] ^= 1
        assert verify(data, KEY, 3, sealer) in ("digest", "mac")
    with pytest.raises(ValueError, match="namespace must be 32 hex digits, got 5"):
        verify(data, ChunkKey(5, b"x"), 3, Sealer())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank must be an integer"):
        verify(data, KEY, "3", Sealer())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="store secret must be bytes"):
        Sealer("a str secret of enough length")  # type: ignore[arg-type]


# ---- 4. disk headers (a read of a damaged file, and the restart scan) ---------------------------------------------

FP = bytes(range(16))
NAME = KEY.storage_name(0)


def _sealed_payload() -> bytes:
    """What the disk tier stores: a chunk object sealed for KEY, rank 0 (its envelope is the payload's digest)."""
    data = np.frombuffer(bytes(range(256)) * 16 + bytes(ENVELOPE_BYTES), dtype=np.uint8).copy()
    seal(data, KEY, 0, Sealer())
    return data.tobytes()


PAYLOAD = _sealed_payload()


@pytest.fixture(scope="module")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-disk") / "cache"


@FUZZ_FS
@given(edits=st.lists(st.tuples(st.integers(0, HEADER_BYTES + len(PAYLOAD) + 8), st.integers(0, 255)), max_size=6),
       header=st.none() | st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES),
       cut=st.none() | st.integers(0, HEADER_BYTES + len(PAYLOAD) + 16), tail=st.binary(max_size=16),
       fields=st.none() | st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)))
def test_damaged_disk_files_are_misses_never_exceptions(disk_root: Path, edits: list, header: Any, cut: Any,
                                                        tail: bytes, fields: Any) -> None:
    tier = DiskTier(disk_root, FP)
    try:
        tier.write_async(NAME, PAYLOAD)
        assert tier.flush(10)
        path = Path(tier.file_path(NAME))
        raw = bytearray(path.read_bytes())
        if header is not None:
            raw[:HEADER_BYTES] = header
        if fields is not None:  # version, header size and payload length: the fields that size things
            struct.pack_into("<II", raw, 8, fields[0], fields[1])
            struct.pack_into("<Q", raw, 32, fields[2])
        for offset, value in edits:
            if offset < len(raw):
                raw[offset] = value
        raw = raw[:cut] + bytearray(tail) if cut is not None else raw + bytearray(tail)
        path.write_bytes(bytes(raw))
        out = np.zeros(len(PAYLOAD), dtype=np.uint8)
        result = tier.read_into(NAME, out)  # a TierResult whatever the bytes: never an exception
        # and a read that passed, checked as every promotion checks it, returned the bytes written
        assert not result.ok or verify(out, KEY, 0, Sealer()) is not None or bytes(out) == PAYLOAD
    finally:
        tier.close()
    path.write_bytes(bytes(raw))
    entries = scan_disk_directory(disk_root, FP)  # the restart scan over the same damage
    assert all(e.payload_bytes >= 0 for e in entries)


def test_valid_disk_files_still_read_and_scan(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "cache", FP)
    tier.write_async(NAME, PAYLOAD)
    assert tier.flush(10)
    out = np.zeros(len(PAYLOAD), dtype=np.uint8)
    assert tier.read_into(NAME, out).ok and bytes(out) == PAYLOAD and verify(out, KEY, 0, Sealer()) is None
    tier.close()
    assert [e.name for e in scan_disk_directory(tmp_path / "cache", FP)] == [NAME]


# ---- 5. safetensors headers ---------------------------------------------------------------------------------------

def _shard(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


_TENSOR = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
_headers = (st.binary(max_size=200)
            | _json_values.map(lambda v: json.dumps(v).encode())
            | st.dictionaries(st.text(max_size=8), _json_values, max_size=4).map(lambda d: json.dumps(d).encode())
            | st.builds(lambda dtype, shape, offsets: json.dumps({"w": {"dtype": dtype, "shape": shape,
                                                                        "data_offsets": offsets}}).encode(),
                        _json_values, _json_values, _json_values)
            | st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n))


@FUZZ
@given(_headers, st.integers(0, 2**70))
@example(b"[" * 100_000, 100)  # N5: RecursionError at the old store/identity.py:238 (a stray deeply nested shard)
@example(b'{"w": {"dtype": "F32", "shape": [' + b"1" * 5000 + b'], "data_offsets": [0, 4]}}', 10)
def test_safetensors_headers_fail_only_with_value_error(raw: bytes, extra: int) -> None:
    ranges = _only_value_error(parse_header, "model.safetensors", 8 + len(raw) + extra, raw)
    assert ranges is None or all(0 <= b <= e for b, e in ranges)


@FUZZ_FS
@given(_headers, st.binary(max_size=64), st.none() | st.integers(0, 2**64 - 1))
@example(b"[" * 100_000, b"", None)
def test_checkpoint_directories_fail_only_with_value_error(scratch: Path, raw: bytes, data: bytes,
                                                           length: Any) -> None:
    model = scratch / "model"
    model.mkdir(exist_ok=True)
    shard = _shard(raw, data)
    if length is not None:  # a lying length prefix
        shard = struct.pack("<Q", length) + shard[8:]
    (model / "model.safetensors").write_bytes(shard)
    fp = _only_value_error(identity.fingerprint_weights, model)
    assert fp is None or len(fp.digest) == 32
    # where a file that is no checkpoint means "no digest" (LoRA adapters), it stays that, never an exception
    adapter = AdapterDigests().get(model)
    assert adapter is None or len(adapter) == 32


def test_valid_safetensors_still_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(_shard(json.dumps({"w": _TENSOR}).encode(), bytes(16)))
    fp = identity.fingerprint_weights(tmp_path)
    assert fp.files == 1 and fp.tensors == 1 and AdapterDigests().get(tmp_path) is not None
    (tmp_path / "model.safetensors").write_bytes(_shard(b"[" * 100_000))
    with pytest.raises(ValueError, match="model.safetensors: the safetensors header nests too deeply"):
        identity.fingerprint_weights(tmp_path)


# ---- 6. Prometheus text (`lmcache-npu status`) --------------------------------------------------------------------

_METRIC_NAMES = st.sampled_from(["lmcache_npu:lookups_total", "lmcache_npu:lookup_tokens_total",
                                 "lmcache_npu:hit_tokens_total", "lmcache_npu:chunk_tokens", "lmcache_npu:chunk_bytes",
                                 "lmcache_npu:cpu_capacity_chunks", "lmcache_npu:cpu_used_chunks",
                                 "lmcache_npu:hit_chunks_cpu_total", "lmcache_npu:disk_capacity_chunks",
                                 "lmcache_npu:hit_chunks_remote_total", "lmcache_npu:segments_live",
                                 "lmcache_npu:arena_bytes", "lmcache_npu:mooncake_puts_total",
                                 "lmcache_npu:store_info", "lmcache_npu:x_created", "vllm:num_requests_running"])
_values = (_special_numbers | st.floats(allow_nan=True, allow_infinity=True).map(repr)
           | st.integers(-2**80, 2**80).map(str) | _huge_digits | st.text(max_size=8))
_labels = st.sampled_from(["", '{engine="0"}', '{engine="1",model_name="m"}',
                           '{namespace="ns",eviction_policy="arc",tiers="cpu,disk,mooncake"}', "{engine=0}", "{"])
_lines = st.builds(lambda n, l, v: f"{n}{l} {v}", _METRIC_NAMES, _labels, _values) | st.text(max_size=40)


@FUZZ
@given(st.lists(_lines, max_size=8))
@example(["lmcache_npu:lookups_total +Inf"])  # N5: OverflowError at the old status.py:172-174
@example(["lmcache_npu:cpu_capacity_chunks 1e300", "lmcache_npu:chunk_bytes 1e300"])  # capacity x size: inf
@example(['lmcache_npu:store_info{tiers="disk"} NaN'])
def test_metrics_fail_only_with_value_error(lines: list[str]) -> None:
    statuses = _only_value_error(lambda: engine_status(parse_metrics("\n".join(lines))))
    if statuses is not None:
        assert isinstance(render(statuses), str) and json.loads(to_json(statuses))


def test_valid_metrics_still_render_and_bad_values_are_named() -> None:
    text = "\n".join(['lmcache_npu:store_info{engine="0",namespace="ns",eviction_policy="arc",tiers="cpu"} 1',
                      'lmcache_npu:lookup_tokens_total{engine="0"} 1000',
                      'lmcache_npu:hit_tokens_total{engine="0"} 250',
                      'lmcache_npu:chunk_tokens{engine="0"} 256', 'lmcache_npu:chunk_bytes{engine="0"} 4096',
                      'lmcache_npu:cpu_capacity_chunks{engine="0"} 1e3', 'lmcache_npu:cpu_used_chunks{engine="0"} 10'])
    (status,) = engine_status(parse_metrics(text))
    assert status.hit_rate == 0.25 and status.tiers[0].capacity_bytes == 4096 * 1000 and "25.0%" in render([status])
    with pytest.raises(ValueError, match=r"metric lmcache_npu:lookups_total\{engine='0'\} has value inf"):
        engine_status(parse_metrics(text + '\nlmcache_npu:lookups_total{engine="0"} +Inf'))
