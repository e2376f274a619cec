"""The connector's configuration: one schema over kv_connector_extra_config, a YAML file and LMCACHE_NPU_*
variables (each later source wins); every rule names its key; a bad config fails before anything is allocated."""

from __future__ import annotations

import pytest

from lmcache_npu.config import ConnectorConfig, load_config

from .conftest import preset_engine


def test_defaults():
    config = load_config({}, environ={})
    assert config.chunk_tokens is None and config.backend == "auto" and config.store_decode_chunks
    assert config.store.cpu_bytes == 8 << 30 and config.store.disk_path is None and config.store.mooncake is None


def test_the_issue_example_parses():
    config = load_config({"chunk_tokens": 256, "cpu_bytes": "64GiB", "disk_path": "/mnt/nvme/kv", "disk_bytes": "1TiB",
                          "mooncake": {"master": "10.0.0.5:50051", "metadata": "http://10.0.0.5:8080/metadata"}},
                         environ={})
    assert (config.chunk_tokens, config.store.cpu_bytes, config.store.disk_bytes) == (256, 64 << 30, 1 << 40)
    assert config.store.mooncake_config().master == "10.0.0.5:50051"


def test_sources_override_in_order(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text("cpu_bytes: 2GiB\nchunk_tokens: 512\nstore_decode_chunks: false\n")
    extra = {"config_file": str(path), "cpu_bytes": "1GiB", "model_name": "from-json"}
    config = load_config(extra, environ={"LMCACHE_NPU_CHUNK_TOKENS": "1024"})
    assert config.store.cpu_bytes == 2 << 30  # the file beats the JSON
    assert config.chunk_tokens == 1024  # the environment beats the file
    assert config.model_name == "from-json" and config.store_decode_chunks is False
    by_env = load_config({}, environ={"LMCACHE_NPU_CONFIG": str(path)})
    assert by_env.chunk_tokens == 512


@pytest.mark.parametrize("name,text,field,value", [
    ("LMCACHE_NPU_CPU_BYTES", "16GiB", "cpu_bytes", 16 << 30),
    ("LMCACHE_NPU_PINNED", "false", "pinned", False),
    ("LMCACHE_NPU_PINNED", "null", "pinned", None),
    ("LMCACHE_NPU_NUMA_NODE", "1", "numa_node", 1),
    ("LMCACHE_NPU_DISK_PATH", "/mnt/kv", "disk_path", "/mnt/kv"),
    ("LMCACHE_NPU_MOONCAKE", '{"master": "h:1", "metadata": "P2PHANDSHAKE"}', "mooncake",
     {"master": "h:1", "metadata": "P2PHANDSHAKE"}),
])
def test_environment_values_take_their_key_type(name, text, field, value):
    environ = {name: text}
    if field == "disk_path":
        environ["LMCACHE_NPU_DISK_BYTES"] = "1GiB"
    assert getattr(load_config({}, environ=environ).store, field) == value


def test_environment_connector_keys():
    config = load_config({}, environ={"LMCACHE_NPU_SKIP_SPEC_KINDS": '["compressor_state"]', "LMCACHE_NPU_BACKEND":
                                      "emu", "LMCACHE_NPU_BACKEND_OPTIONS": '{"soc": "a3", "cores": 8}',
                                      "LMCACHE_NPU_CUDA": "1", "LMCACHE_NPU_HYPOTHESIS_EXAMPLES": "3"})
    assert config.skip_spec_kinds == ("compressor_state",) and config.backend_options == {"soc": "a3", "cores": 8}


@pytest.mark.parametrize("extra,environ,message", [
    ({"cpu_byte": 1}, {}, r"unknown lmcache_npu config key\(s\) 'cpu_byte'; valid keys: chunk_tokens, backend, "),
    ({}, {"LMCACHE_NPU_CPUBYTES": "1"}, r"environment variable LMCACHE_NPU_CPUBYTES is not a lmcache_npu config key;"
                                        r" valid variables: LMCACHE_NPU_CHUNK_TOKENS"),
    ({}, {"LMCACHE_NPU_CHUNK_TOKENS": "many"}, "LMCACHE_NPU_CHUNK_TOKENS: expected an integer, got 'many'"),
    ({}, {"LMCACHE_NPU_PINNED": "maybe"}, "LMCACHE_NPU_PINNED: expected true or false"),
    ({}, {"LMCACHE_NPU_MOONCAKE": "{master"}, "LMCACHE_NPU_MOONCAKE: expected JSON"),
    ({"chunk_tokens": 0}, {}, "chunk_tokens must be an integer >= 1"),
    ({"backend": "gpu"}, {}, "backend must be one of torch, emu, host, cuda, npu, auto, got 'gpu'"),
    ({"backend": "emu", "backend_options": {"socc": "a2"}}, {},
     "backend_options: 'socc' not accepted by the emu backend; valid options: soc, cores, ub_bytes, order, seed"),
    ({"backend_options": {"soc": "a2"}}, {}, "backend_options need a named backend"),
    ({"skip_spec_kinds": ["mamba", "state"]}, {}, r"skip_spec_kinds: unknown spec kinds \['state'\]"),
    ({"skip_spec_kinds": "mamba"}, {}, "skip_spec_kinds must be a list of spec kind names"),
    ({"model_name": ""}, {}, "model_name must be a non-empty string or null"),
    ({"load_retries": 11}, {}, "load_retries must be an integer from 0 to 10"),
    ({"cpu_bytes": "lots"}, {}, "cpu_bytes: expected a size in bytes"),
    ({"mooncake": {"master": "x:1"}}, {}, "mooncake config needs metadata"),
    ({"config_file": "/nonexistent/lmcache.yaml"}, {}, r"config_file '/nonexistent/lmcache.yaml': No such file"),
])
def test_every_rule_names_its_key(extra, environ, message):
    with pytest.raises(ValueError, match=message):
        load_config(extra, environ=environ)


def test_a_config_file_must_be_a_mapping_of_known_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- cpu_bytes\n")
    with pytest.raises(ValueError, match="the top level must be a mapping"):
        load_config({"config_file": str(bad)}, environ={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("cpu_bytez: 1GiB\n")
    with pytest.raises(ValueError, match=r"unknown lmcache_npu config key\(s\) 'cpu_bytez'"):
        load_config({"config_file": str(unknown)}, environ={})


def test_every_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = [key for key in ConnectorConfig.keys() if f"`{key}`" not in doc]
    assert not missing, f"docs/configuration.md does not list {missing}"


def test_a_bad_config_fails_when_the_connector_is_built(make_engine):
    with pytest.raises(ValueError, match="backend_options: 'bogus' not accepted by the emu backend"):
        preset_engine(make_engine, "llama3-8b", "ascend", extra_config={"backend_options": {"bogus": 1}})


def test_a_chunk_that_is_not_a_multiple_of_the_hash_block_is_refused(make_engine):
    # refused where the worker lays the chunk out: the scheduler takes the size from the handshake only
    with pytest.raises(ValueError, match="chunk_tokens 200 is not a multiple of the hash block size 128: a chunk is "
                                         "keyed by the block hash"):
        preset_engine(make_engine, "llama3-8b", "ascend", extra_config={"chunk_tokens": 200})
