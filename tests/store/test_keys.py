"""Chunk keys from vLLM 0.23's own request block hasher: stable across processes, scoped by model and layout."""

import importlib.util
import logging
import os
import subprocess
import sys

import pytest

from lmcache_npu.store.keys import (
    CRYPTOGRAPHIC_HASH_ALGORITHMS,
    STABLE_HASH_ALGORITHMS,
    ChunkKey,
    check_stable_hashing,
    chunk_keys,
    model_fingerprint,
    namespace_of,
)

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM is not installed (make setup)")

HASH_BLOCK = 16
CHUNK = 64
TOKENS = list(range(1000, 1000 + 3 * CHUNK + 10))  # three full chunks and a partial one

# Computes a request's chunk keys in a fresh interpreter (vLLM seeds NONE_HASH from PYTHONHASHSEED at init).
_CHILD = """
import sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from lmcache_npu.store.keys import chunk_keys
for algo in sys.argv[1:]:
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    r = Request("r", list(range(1000, 1000 + 3 * 64 + 10)), SamplingParams(max_tokens=1), None,
                block_hasher=kv_cache_utils.get_request_block_hasher(16, fn))
    print(algo, ",".join(k.chunk_hash.hex() for k in chunk_keys(r.block_hashes, 16, 64, "n" * 32)))
"""


def _request(algo: str, monkeypatch: pytest.MonkeyPatch, **extra: object):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", None, raising=False)
    kv_cache_utils.init_none_hash(fn)
    return Request("r", TOKENS, SamplingParams(max_tokens=1), None,
                   block_hasher=kv_cache_utils.get_request_block_hasher(HASH_BLOCK, fn), **extra)


ALGORITHMS = ["sha256", "sha256_cbor"] + (["xxhash"] if importlib.util.find_spec("xxhash") else [])


@pytest.fixture(scope="module")
def child_keys() -> dict[tuple[str, str], list[str]]:
    """(algorithm, PYTHONHASHSEED) -> chunk hashes another process computed for the same request."""
    found = {}
    for seed in ("0", "1"):
        env = dict(os.environ, PYTHONHASHSEED=seed, VLLM_LOGGING_LEVEL="ERROR")
        out = subprocess.run([sys.executable, "-c", _CHILD, *ALGORITHMS], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        for line in out.stdout.strip().splitlines()[-len(ALGORITHMS):]:
            algo, hashes = line.split(" ")
            found[(algo, seed)] = hashes.split(",")
    return found


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_chunk_key_is_the_block_hash_at_the_chunk_end_and_stable_across_processes(algo, monkeypatch, child_keys):
    request = _request(algo, monkeypatch)
    keys = chunk_keys(request.block_hashes, HASH_BLOCK, CHUNK, "n" * 32)
    assert len(request.block_hashes) == len(TOKENS) // HASH_BLOCK
    assert len(keys) == 3  # the partial fourth chunk has no key
    assert [k.chunk_hash for k in keys] == [bytes(request.block_hashes[i]) for i in (3, 7, 11)]
    assert child_keys[(algo, "0")] == [k.chunk_hash.hex() for k in keys]
    assert child_keys[(algo, "1")] != [k.chunk_hash.hex() for k in keys]  # another seed is another cache


def test_salt_and_lora_change_every_key(monkeypatch):
    from vllm.lora.request import LoRARequest

    plain = chunk_keys(_request("sha256", monkeypatch).block_hashes, HASH_BLOCK, CHUNK, "n" * 32)
    salted = chunk_keys(_request("sha256", monkeypatch, cache_salt="tenant-a").block_hashes, HASH_BLOCK, CHUNK,
                        "n" * 32)
    lora = chunk_keys(_request("sha256", monkeypatch, lora_request=LoRARequest("ad", 7, "/tmp/ad")).block_hashes,
                      HASH_BLOCK, CHUNK, "n" * 32)
    assert not set(plain) & set(salted) and not set(plain) & set(lora) and not set(salted) & set(lora)


def test_num_tokens_limits_keys_and_chunk_must_be_whole_hash_blocks():
    hashes = [bytes([i]) * 32 for i in range(12)]
    assert len(chunk_keys(hashes, 16, 64, "n" * 32, num_tokens=130)) == 2
    with pytest.raises(ValueError, match="chunk_tokens 40 is not a multiple of the hash block size 16"):
        chunk_keys(hashes, 16, 40, "n" * 32)


def test_an_adapter_digest_rekeys_every_chunk_and_only_its_content_matters():
    hashes = [bytes([i]) * 32 for i in range(12)]
    plain = chunk_keys(hashes, 16, 64, "n" * 32)
    first = chunk_keys(hashes, 16, 64, "n" * 32, adapter_digest=b"a" * 32)
    again = chunk_keys(hashes, 16, 64, "n" * 32, adapter_digest=b"a" * 32)
    other = chunk_keys(hashes, 16, 64, "n" * 32, adapter_digest=b"a" * 31 + b"b")  # one byte of the adapter
    assert first == again  # control: the same adapter content names the same chunks in any process
    assert len({k.chunk_hash for k in plain + first + other}) == 3 * len(plain)
    assert [len(k.chunk_hash) for k in first] == [32] * len(plain)


def test_a_fast_block_hash_is_refused_for_shared_tiers_unless_the_operator_opts_in(caplog):
    for algo in CRYPTOGRAPHIC_HASH_ALGORITHMS:
        check_stable_hashing(algo, {"PYTHONHASHSEED": "20261127"})
    for algo in set(STABLE_HASH_ALGORITHMS) - set(CRYPTOGRAPHIC_HASH_ALGORITHMS):
        with pytest.raises(ValueError, match=f"{algo!r} is not cryptographic.*allow_fast_block_hash"):
            check_stable_hashing(algo, {"PYTHONHASHSEED": "20261127"})
        with caplog.at_level(logging.WARNING, logger="lmcache_npu.store.keys"):
            check_stable_hashing(algo, {"PYTHONHASHSEED": "20261127"}, allow_fast_block_hash=True)
        assert f"{algo!r} is not cryptographic" in caplog.text
        caplog.clear()


def test_unstable_hashing_is_refused_with_the_reason():
    for algo in CRYPTOGRAPHIC_HASH_ALGORITHMS:
        check_stable_hashing(algo, {"PYTHONHASHSEED": "20261127"})
    with pytest.raises(ValueError, match="'builtin' is not stable across processes"):
        check_stable_hashing("builtin", {"PYTHONHASHSEED": "20261127"})
    for env in ({}, {"PYTHONHASHSEED": ""}, {"PYTHONHASHSEED": "random"}):
        with pytest.raises(ValueError, match="PYTHONHASHSEED is not set"):
            check_stable_hashing("sha256", env)


def test_namespaces_separate_models_and_layouts():
    from lmcache_npu.tools.presets import preset_layout

    llama = preset_layout("llama3-8b", device_family="ascend")[0].plan
    qwen = preset_layout("qwen3-32b", device_family="ascend")[0].plan
    llama_512 = preset_layout("llama3-8b", device_family="ascend", chunk_tokens=512)[0].plan
    fingerprints = {p.fingerprint for p in (llama, qwen, llama_512)}
    assert len(fingerprints) == 3 and all(len(f) == 16 for f in fingerprints)
    assert llama.fingerprint == preset_layout("llama3-8b", device_family="ascend")[0].plan.fingerprint
    m1 = model_fingerprint(name="m", dtype="bf16", tp=2)
    assert m1 == model_fingerprint(tp=2, dtype="bf16", name="m") != model_fingerprint(name="m", dtype="bf16", tp=4)
    ns = namespace_of(m1, llama.fingerprint)
    assert len(ns) == 32 and ns != namespace_of(m1, qwen.fingerprint)


def test_storage_names_round_trip_and_reject_strangers():
    key = ChunkKey("a" * 32, bytes(range(32)))
    name = key.storage_name(3)
    assert name == "a" * 32 + "-" + bytes(range(32)).hex() + "-r3"
    assert ChunkKey.from_storage_name(name) == (key, 3)
    for bad in ("x", "a" * 32 + "-zz-r1", "a" * 31 + "-00-r1", "a" * 32 + "-00-rx", "a" * 32 + "-00-1"):
        with pytest.raises(ValueError, match="not a chunk storage name"):
            ChunkKey.from_storage_name(bad)


def test_storage_names_of_a_namespace_and_a_rank():
    from lmcache_npu.store.keys import storage_names_of

    ns, other = "a" * 32, "b" * 32
    mine = ChunkKey(ns, b"\x01" * 32)
    owns = storage_names_of(ns, 1)
    assert owns(mine.storage_name(1))
    assert not owns(mine.storage_name(0)) and not owns(mine.storage_name(11))  # -r11 does not end in -r1
    assert not owns(ChunkKey(other, b"\x01" * 32).storage_name(1))
    assert storage_names_of(ns)(mine.storage_name(7)) and storage_names_of()(ChunkKey(other, b"\x02").storage_name(3))


def _hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of `tokens` (sha256, this process's seed)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    request = Request("r", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=kv_cache_utils.get_request_block_hasher(HASH_BLOCK, fn))
    return list(request.block_hashes)


def test_a_prompts_tail_chunk_is_named_by_its_whole_prefix_and_its_tail_tokens() -> None:
    from lmcache_npu.store.keys import tail_chunk_key

    tokens = TOKENS  # 3 chunks and 10 tokens
    key = tail_chunk_key(_hashes(tokens), HASH_BLOCK, CHUNK, "n" * 32, tokens, len(tokens))
    assert key is not None and key.namespace == "n" * 32
    assert key not in chunk_keys(_hashes(tokens), HASH_BLOCK, CHUNK, "n" * 32)
    assert key == tail_chunk_key(_hashes(tokens), HASH_BLOCK, CHUNK, "n" * 32, tokens, len(tokens))
    # negative controls: one other token in the tail, or in the prefix (through vLLM's chain), names another chunk
    tail_changed = tokens[:-1] + [tokens[-1] + 1]
    head_changed = [tokens[0] + 1] + tokens[1:]
    for changed in (tail_changed, head_changed):
        assert tail_chunk_key(_hashes(changed), HASH_BLOCK, CHUNK, "n" * 32, changed, len(changed)) != key
    assert tail_chunk_key(_hashes(tokens), HASH_BLOCK, CHUNK, "n" * 32, tokens, len(tokens),
                          adapter_digest=b"a" * 32) != key
    # nothing to name: a prompt ending on a chunk boundary, or shorter than one hash block
    whole = tokens[:3 * CHUNK]
    assert tail_chunk_key(_hashes(whole), HASH_BLOCK, CHUNK, "n" * 32, whole, len(whole)) is None
    short = tokens[:HASH_BLOCK - 1]
    assert tail_chunk_key(_hashes(short), HASH_BLOCK, CHUNK, "n" * 32, short, len(short)) is None


def test_a_hand_off_round_trips_and_bad_ones_are_refused_by_name() -> None:
    from lmcache_npu.integration.vllm.handoff import Handoff, is_ask

    handoff = Handoff(("prefill/dp0", "ab" * 16), "cd" * 16, 300, (b"\x01" * 32, b"\x02" * 32), b"\x03" * 32)
    assert Handoff.from_params(json_round_trip(handoff.to_params())) == handoff
    assert is_ask({"do_remote_decode": True}) and not is_ask(handoff.to_params()) and not is_ask(None)
    good = handoff.to_params()
    bad = {"writer": ({**good, "writer": ["prefill", "short"]}, "writer"),
           "namespace": ({**good, "namespace": "x"}, "namespace"),
           "prompt_tokens": ({**good, "prompt_tokens": 0}, "prompt_tokens"),
           "chunks": ({**good, "chunks": ["zz" * 16]}, "chunks"),
           "tail": ({**good, "tail": "abc"}, "tail"),
           "missing": ({"writer": good["writer"]}, "needs")}
    for value, named in bad.values():
        with pytest.raises(ValueError, match=named):
            Handoff.from_params(value)


def json_round_trip(value: object) -> object:
    import json

    return json.loads(json.dumps(value))
