"""The per-load-mode configurations of `replay` and `bench-serve` (issue 41), and the tools' core options."""

from __future__ import annotations

import os

import pytest

from lmcache_npu.config import load_config
from lmcache_npu.tools.cores import check_apart, parse_cpus, server_env
from lmcache_npu.tools.replay.configs import BASELINE, PLUGIN, load_mode_of, named_configs, run_order


def test_each_mode_is_the_plugin_with_its_load_mode_over_the_same_config() -> None:
    configs = named_configs(["plugin", "plugin-sliced", "baseline", "plugin-async"], {"cpu_bytes": "1GiB"})
    assert [c.name for c in configs] == [BASELINE, f"{PLUGIN} (async)", f"{PLUGIN} (sliced)", PLUGIN]
    assert [load_mode_of(c) for c in configs] == ["", "async", "sliced", "auto"]
    assert all(c.extra_config["cpu_bytes"] == "1GiB" for c in configs[1:])
    assert "load_mode" not in configs[3].extra_config  # plugin keeps what its config says
    for config in configs[1:]:  # every one is a config the plugin accepts
        load_config(dict(config.extra_config))


def test_plugin_keeps_a_load_mode_its_config_gives() -> None:
    (_, plugin) = named_configs(["baseline", "plugin"], {"load_mode": "sliced"})
    assert load_mode_of(plugin) == "sliced"


def test_a_mode_config_still_needs_the_baseline_and_known_names() -> None:
    with pytest.raises(ValueError, match="baseline"):
        named_configs(["plugin-async", "plugin-sliced"], {})
    with pytest.raises(ValueError, match="plugin-layerwise"):
        named_configs(["baseline", "plugin-layerwise"], {})


def test_the_modes_rotate_like_any_configurations() -> None:
    configs = named_configs(["baseline", "plugin-async", "plugin-sliced"], {})
    order = run_order(configs, 2)
    assert [c.name for _, c in order][:3] != [c.name for _, c in order][3:]


@pytest.mark.parametrize("text,cpus", [("0", (0,)), ("0,1", (0, 1)), ("2-3", (2, 3)), ("", None), (None, None)])
def test_cpu_options_parse(text, cpus) -> None:
    assert parse_cpus("--x", text) == cpus


@pytest.mark.parametrize("text", ["a", "1,1", "3-2", "-1", "0,,1"])
def test_bad_cpu_options_are_refused_naming_the_option(text) -> None:
    with pytest.raises(ValueError, match="--engine-cpus"):
        parse_cpus("--engine-cpus", text)


def test_engine_and_lanes_must_not_share_cores() -> None:
    cpu = min(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="share"):
        check_apart((cpu,), (cpu,))
    with pytest.raises(ValueError, match="not available"):
        check_apart((max(os.sched_getaffinity(0)) + 1000,), None)
    check_apart((cpu,), None)


def test_a_server_binds_its_model_threads_through_vllms_variable() -> None:
    from lmcache_npu.tools.servebench.server import ServerSettings

    assert server_env(None) == {}
    env = ServerSettings("m", engine_cpus=(0,)).env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ServerSettings("m").env()
