"""Store configuration: sizes with units, every rule checked with the key named, unknown keys listed."""

import pytest

from lmcache_npu.config import load_config
from lmcache_npu.store.config import StoreConfig, parse_bytes


@pytest.mark.parametrize("text,size", [(4096, 4096), ("64GiB", 64 << 30), ("512MB", 512 * 10**6), ("1.5KiB", 1536),
                                       (" 2 tib ", 2 << 40), ("100", 100), ("7b", 7)])
def test_sizes_take_units(text, size):
    assert parse_bytes("cpu_bytes", text) == size


@pytest.mark.parametrize("bad", ["lots", "64 GiBs", "-1GiB", True, 1.5, None, [1]])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ValueError, match="cpu_bytes: "):
        parse_bytes("cpu_bytes", bad)


def test_defaults_and_a_full_config():
    assert StoreConfig().cpu_bytes == 8 << 30 and StoreConfig().disk_path is None
    config = StoreConfig.from_dict({"cpu_bytes": "64GiB", "numa_node": 1, "pinned": True, "disk_path": "/mnt/kv",
                                    "disk_bytes": "2TiB", "disk_max_pending_bytes": "1GiB", "disk_writer_threads": 4,
                                    "put_to_remote": False, "io_threads": 8})
    assert (config.cpu_bytes, config.disk_bytes, config.disk_max_pending_bytes) == (64 << 30, 2 << 40, 1 << 30)


def test_unknown_keys_are_listed_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown store config key\(s\) 'cpu_byte', 'disk'; valid keys: cpu_bytes, "):
        StoreConfig.from_dict({"cpu_byte": 1, "disk": "/x"})


@pytest.mark.parametrize("values,message", [
    ({"cpu_bytes": 0}, "cpu_bytes must be positive"),
    ({"numa_node": -1}, "numa_node must be an integer >= 0"),
    ({"numa_node": "0"}, "numa_node must be an integer >= 0"),
    ({"pinned": "yes"}, "pinned must be true, false or null"),
    ({"disk_path": "/mnt/kv"}, r"disk_bytes must be set \(> 0\) when disk_path is \('/mnt/kv'\)"),
    ({"disk_bytes": "1GiB"}, "disk_bytes is set but disk_path is not"),
    ({"disk_path": ""}, "disk_path must be a directory path"),
    ({"io_threads": 0}, "io_threads must be an integer from 1 to 64"),
    ({"disk_writer_threads": 100}, "disk_writer_threads must be an integer from 1 to 64"),
    ({"put_to_remote": 1}, "put_to_remote must be true or false"),
    ({"disk_write_through": "no"}, "disk_write_through must be true or false, got 'no'"),
    ({"mooncake": "10.0.0.5:50051"}, "mooncake must be an object of Mooncake settings"),
])
def test_each_rule_names_its_key(values, message):
    with pytest.raises(ValueError, match=message):
        StoreConfig.from_dict(values)


def test_disk_write_through_is_on_by_default():
    assert StoreConfig().disk_write_through is True
    assert StoreConfig.from_dict({"disk_write_through": False}).disk_write_through is False


@pytest.mark.parametrize("text,value", [("false", False), ("0", False), ("true", True), ("on", True)])
def test_the_environment_turns_write_through_off_and_on(text, value):
    environ = {"LMCACHE_NPU_DISK_WRITE_THROUGH": text}
    assert load_config({}, environ=environ).store.disk_write_through is value
    assert load_config({"disk_write_through": not value}, environ={}).store.disk_write_through is (not value)
    assert load_config({"disk_write_through": not value}, environ=environ).store.disk_write_through is value


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="LMCACHE_NPU_DISK_WRITE_THROUGH: expected true or false, got 'maybe'"):
        load_config({}, environ={"LMCACHE_NPU_DISK_WRITE_THROUGH": "maybe"})
