"""A chunk is loaded only by the model that computed it: the namespace is named by the weights' content (not the
model's path or name), LoRA chunks by the adapter's content, and persistent tiers (disk, Mooncake, the node cache)
refuse weights nothing can name.
Driven by vLLM 0.23's real scheduler and the simulated model (`engine.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from lmcache_npu.integration.vllm.engine_identity import UnnamedWeightsError
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.node.capacity import NodeCapacity

from .conftest import prompt
from .vllm_cpu import tiny_model_dir

PROMPT = prompt(3 * 256 + 40, seed=5)
WHOLE_CHUNKS = 3 * 256


def _model_dir(root, weights_seed: int) -> str:
    """The tiny model's config with weights drawn from `weights_seed`, at `root` (rewritten in place if present)."""
    os.makedirs(root, exist_ok=True)
    shutil.copy(os.path.join(tiny_model_dir(), "config.json"), os.path.join(root, "config.json"))
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(weights_seed))
    save_file({"model.embed_tokens.weight": weights}, os.path.join(root, "model.safetensors"))
    return str(root)


def _adapter_dir(root, seed: int) -> str:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, f)
    generator = torch.Generator().manual_seed(seed)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 256, generator=generator),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(256, 4, generator=generator)},
              os.path.join(root, "adapter_model.safetensors"))
    return str(root)


def _serve_once(make_engine, model_dir: str, disk: str, lora=None) -> int:
    """One engine on `disk` serves PROMPT once; the tokens it loaded (its disk writes are flushed before it closes)."""
    engine = make_engine(model_dir=model_dir, extra_config={"disk_path": disk, "disk_bytes": "256MiB"})
    engine.add(PROMPT, max_tokens=2, request_id="a", lora_request=lora)
    engine.run()
    engine.workers[0].worker_half.executor.disk.flush(30)
    loaded = engine.loaded_tokens.get("a", 0)
    engine.close()
    return loaded


def test_new_weights_at_the_same_path_never_load_the_old_weights_chunks(make_engine, tmp_path):
    model = _model_dir(tmp_path / "model", weights_seed=1)
    disk = str(tmp_path / "kv")
    assert _serve_once(make_engine, model, disk) == 0
    assert _serve_once(make_engine, model, disk) == WHOLE_CHUNKS  # control: unchanged weights hit the disk
    _model_dir(tmp_path / "model", weights_seed=2)  # a redeploy: new weights, same path, same config.json
    assert _serve_once(make_engine, model, disk) == 0
    assert _serve_once(make_engine, model, disk) == WHOLE_CHUNKS  # the new weights' own chunks are found again


def test_a_moved_model_directory_keeps_its_chunks(make_engine, tmp_path):
    """The weights' content names the chunks, not the directory's path."""
    disk = str(tmp_path / "kv")
    assert _serve_once(make_engine, _model_dir(tmp_path / "a", weights_seed=3), disk) == 0
    assert _serve_once(make_engine, _model_dir(tmp_path / "b", weights_seed=3), disk) == WHOLE_CHUNKS


def test_two_models_under_one_model_name_never_share_chunks(make_engine, tmp_path):
    disk = str(tmp_path / "kv")
    settings = {"disk_path": disk, "disk_bytes": "256MiB", "model_name": "chat"}
    first = make_engine(model_dir=_model_dir(tmp_path / "a", weights_seed=4), extra_config=settings)
    second = make_engine(model_dir=_model_dir(tmp_path / "b", weights_seed=5), extra_config=settings)
    assert first.connector.scheduler_half.namespace != second.connector.scheduler_half.namespace
    namespace = first.connector.scheduler_half.namespace
    first.close()  # one engine per namespace and rank may hold a disk directory
    same = make_engine(model_dir=_model_dir(tmp_path / "c", weights_seed=4), extra_config=settings)
    assert same.connector.scheduler_half.namespace == namespace  # control: the same weights share


def test_persistent_tiers_refuse_weights_nothing_names(make_engine, tmp_path):
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(os.path.join(tiny_model_dir(), "config.json"), bare / "config.json")
    with pytest.raises(UnnamedWeightsError, match="model_fingerprint"):
        make_engine(model_dir=str(bare), extra_config={"disk_path": str(tmp_path / "kv"), "disk_bytes": "64MiB"})
    arena_only = make_engine(model_dir=str(bare))  # the arena dies with the engine: it runs
    assert arena_only.connector.scheduler_half.index is not None
    named = make_engine(model_dir=str(bare), extra_config={"disk_path": str(tmp_path / "kv2"), "disk_bytes": "64MiB",
                                                           "model_fingerprint": "release-2026-11-25"})
    renamed = make_engine(model_dir=str(bare), extra_config={"model_fingerprint": "release-2026-11-26"})
    assert named.connector.scheduler_half.namespace != renamed.connector.scheduler_half.namespace
    identity = dict(named.workers[0].get_handshake_metadata().identity)
    assert identity["weights"] == "named by the model_fingerprint key"


def _served_through_the_node(make_engine, model_dir: str, path: str, fingerprint: str, request_id: str) -> int:
    """One engine on the node cache at `path`, its weights named `fingerprint`, serves PROMPT once: tokens loaded."""
    engine = make_engine(model_dir=model_dir, extra_config={"node_cache": path, "model_fingerprint": fingerprint})
    engine.add(PROMPT, max_tokens=2, request_id=request_id)
    engine.run()
    return engine.loaded_tokens.get(request_id, 0)


def test_the_node_cache_refuses_weights_nothing_names_as_the_disk_tier_does(make_engine, tmp_path):
    """Issue 39, C1 (the review's S2): the node cache keeps chunks beyond the engine and shares them with every engine
    of the node, so weights nothing names are refused as with a disk tier. Before, a config-only model attached, and
    another model of that config got the same namespace and loaded its KV."""
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(os.path.join(tiny_model_dir(), "config.json"), bare / "config.json")
    path = os.path.join(tempfile.mkdtemp(prefix="lmc-id-", dir="/tmp"), "node.sock")  # socket paths must stay short
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(256 << 20), max_pools=2)).start()
    try:
        with pytest.raises(UnnamedWeightsError, match="node cache keep chunks beyond this engine.*model_fingerprint"):
            make_engine(model_dir=str(bare), extra_config={"node_cache": path})
        assert service.pools == {}  # it never attached
        # the control: named weights share through the node, by their name only
        assert _served_through_the_node(make_engine, str(bare), path, "release-a", "writer") == 0
        assert _served_through_the_node(make_engine, str(bare), path, "release-b", "other") == 0
        assert _served_through_the_node(make_engine, str(bare), path, "release-a", "same") == WHOLE_CHUNKS
        assert len(service.pools) == 2
    finally:
        service.close()


def test_ranks_with_other_weights_are_refused_with_what_differs(make_engine):
    engine = make_engine(world=2)
    half = engine.connector.scheduler_half
    geometries = [w.get_handshake_metadata() for w in engine.workers]
    assert all(g.namespace == geometries[0].namespace for g in geometries)
    other = dict(geometries[1].identity, **{"weights.digest": "another"})
    odd = dataclasses.replace(geometries[1], namespace="0" * 32, identity=tuple(sorted(other.items())))
    with pytest.raises(ValueError, match=r"rank 1 runs another model identity .*weights\.digest"):
        half.set_worker_geometry([geometries[0], odd])
    half.set_worker_geometry(geometries)  # control: the ranks' own handshakes agree


def test_a_lora_adapter_replaced_under_its_name_misses(make_engine, tmp_path):
    from vllm.lora.request import LoRARequest

    model = _model_dir(tmp_path / "model", weights_seed=6)
    disk = str(tmp_path / "kv")
    adapter = _adapter_dir(tmp_path / "adapter", seed=1)
    lora = LoRARequest("tenant", 1, adapter)
    assert _serve_once(make_engine, model, disk, lora) == 0
    assert _serve_once(make_engine, model, disk, lora) == WHOLE_CHUNKS  # control: the same adapter hits
    assert _serve_once(make_engine, model, disk) == 0  # the base model never gets the adapter's KV
    _adapter_dir(tmp_path / "adapter", seed=2)  # new adapter files under the same name and path
    assert _serve_once(make_engine, model, disk, lora) == 0


def test_a_lora_adapter_whose_files_cannot_be_read_bypasses_the_plugin(make_engine, tmp_path):
    from vllm.lora.request import LoRARequest

    engine = make_engine(model_dir=_model_dir(tmp_path / "model", weights_seed=7))
    lora = LoRARequest("remote", 2, str(tmp_path / "missing"))
    for request_id in ("a", "b"):
        engine.add(PROMPT, max_tokens=2, request_id=request_id, lora_request=lora)
        engine.run()
        engine.evict_device_cache()
    assert engine.loaded_tokens.get("b", 0) == 0
    assert engine.stats.data.get("lora_bypassed_requests") == 2
    assert not engine.stats.data.get("store_chunks")


def test_a_worker_side_kv_dtype_rewrite_does_not_split_the_halves(make_engine, tmp_path):
    """vllm-ascend on A5 sets cache_dtype to fp8 inside the worker after the scheduler fixed its own: the namespace
    comes from the workers (what they hold), and the scheduler adopts it instead of refusing the handshake."""
    from lmcache_npu.integration.vllm import LMCacheNPUConnector

    def rewriting_worker(vllm_config, role, kv_cache_config):
        vllm_config.cache_config.cache_dtype = "fp8_e4m3"  # what the model code does in the worker process
        return LMCacheNPUConnector(vllm_config, role, kv_cache_config)

    model = _model_dir(tmp_path / "model", weights_seed=8)
    rewritten = make_engine(model_dir=model, worker_factory=rewriting_worker)
    plain = make_engine(model_dir=model)
    assert rewritten.connector.scheduler_half.index is not None
    identity = dict(rewritten.workers[0].get_handshake_metadata().identity)
    assert identity["kv_cache_dtype"] == "fp8_e4m3"
    assert rewritten.connector.scheduler_half.namespace == rewritten.workers[0].get_handshake_metadata().namespace
    assert rewritten.connector.scheduler_half.namespace != plain.connector.scheduler_half.namespace  # control


def _stored(half, request, digest: bytes) -> int:
    """How many of `request`'s whole chunks the index holds under the adapter digest `digest`."""
    from lmcache_npu.store.keys import chunk_keys

    keys = chunk_keys(request.block_hashes, half.hash_block_size, half.chunk_tokens, half.namespace,
                      adapter_digest=digest)
    return sum(half.index.presence(keys, remote=False))


def _in_place_update(make_engine, tmp_path, adapters=None):  # type: ignore[no-untyped-def]
    """One engine: request a with the adapter, the adapter rewritten in place, request b (vLLM keeps the first
    weights loaded for the id), then request c with load_inplace (vLLM reloads). Returns what the index holds."""
    from vllm.lora.request import LoRARequest

    from lmcache_npu.identity.adapters import adapter_digest

    path = _adapter_dir(tmp_path / "adapter", seed=1)
    engine = make_engine(model_dir=_model_dir(tmp_path / "model", weights_seed=1))
    half = engine.connector.scheduler_half
    if adapters is not None:
        half._adapters = adapters
    first = adapter_digest(path)
    engine.add(PROMPT, max_tokens=2, request_id="a", lora_request=LoRARequest("tenant", 1, path))
    engine.run()
    _adapter_dir(tmp_path / "adapter", seed=2)  # updated in place: same name, id and path
    second = adapter_digest(path)
    assert second != first
    engine.add(prompt(3 * 256 + 40, seed=6), max_tokens=2, request_id="b", lora_request=LoRARequest("tenant", 1, path))
    engine.run()
    found = {"a_first": _stored(half, engine.requests["a"], first),
             "b_first": _stored(half, engine.requests["b"], first),
             "b_second": _stored(half, engine.requests["b"], second)}
    engine.add(prompt(3 * 256 + 40, seed=7), max_tokens=2, request_id="c",
               lora_request=LoRARequest("tenant", 1, path, load_inplace=True))
    engine.run()
    found["c_second"] = _stored(half, engine.requests["c"], second)
    found["bypassed"] = engine.stats.data.get("lora_bypassed_requests", 0)
    engine.close()
    return found


def test_an_adapter_updated_in_place_never_files_the_old_weights_kv_under_the_new_digest(make_engine, tmp_path):
    """Issue 31, finding N2: vLLM keeps the weights it loaded for a lora_int_id; a request after the files changed
    may run either version, so it stores nothing (not under the new digest, not under the old); a load_inplace
    request (vLLM reloads) stores under the new files' digest."""
    found = _in_place_update(make_engine, tmp_path)
    assert found["a_first"] == 3, found  # control: the first request's chunks are filed under the loaded weights
    assert found["b_second"] == 0 and found["b_first"] == 0 and found["bypassed"] == 1, found
    assert found["c_second"] == 3, found


def test_keys_that_follow_the_files_would_file_old_weights_kv_under_the_new_digest(make_engine, tmp_path):
    """Negative control of the test above: a digest taken from the files at each request (the old behaviour) files
    request b, computed with the weights vLLM still holds (the first), under the second digest."""
    from lmcache_npu.identity.adapters import AdapterDigests

    class FollowTheFiles:
        def __init__(self) -> None:
            self.digests = AdapterDigests()

        def digest(self, lora):  # type: ignore[no-untyped-def]
            return self.digests.get(lora.path)

    assert _in_place_update(make_engine, tmp_path, FollowTheFiles())["b_second"] == 3
