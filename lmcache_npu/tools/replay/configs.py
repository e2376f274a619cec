"""The configurations a replay compares, and the order their runs go in.

A configuration is one engine setup over the same workload: vLLM alone, vLLM with this plugin, and vLLM with a peer
connector, its own MooncakeStoreConnector (tools/replay/connectors.py builds each one's kv_transfer_config). The
first is the reference every other run's tokens are checked against and the baseline its gains are measured from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence


@dataclass(frozen=True)
class RunConfig:
    """One configuration: its name in tables, and the connector it runs (none: vLLM alone)."""

    name: str
    connector: str = ""  # "" for vLLM alone, "lmcache-npu" for this plugin, "mooncake-store" for the peer
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # the connector's kv_connector_extra_config

    @property
    def plugin(self) -> bool:
        return self.connector == PLUGIN_CONNECTOR

    @property
    def peer(self) -> bool:
        """A connector other than this plugin: its hits are vLLM's external hits, never the plugin's."""
        return bool(self.connector) and not self.plugin


PLUGIN_CONNECTOR = "lmcache-npu"
MOONCAKE_STORE = "mooncake-store"  # vLLM's own MooncakeStoreConnector
BASELINE = "vLLM alone"
PLUGIN = "vLLM + lmcache-npu"
PEER = "vLLM + MooncakeStoreConnector"
# the plugin with each hit loaded one way (issue 41's load_mode); "plugin" keeps the mode its config gives (auto)
PLUGIN_MODES = {"plugin-async": "async", "plugin-sliced": "sliced"}
CONFIG_KEYS = {"baseline": BASELINE, "plugin-async": f"{PLUGIN} (async)", "plugin-sliced": f"{PLUGIN} (sliced)",
               "plugin": PLUGIN, "peer": PEER}  # `lmcache-npu replay --configs` names, in the order they run


def peer_config(extra_config: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """vLLM's own MooncakeStoreConnector with its defaults (`extra_config`: its kv_connector_extra_config)."""
    return RunConfig(PEER, MOONCAKE_STORE, dict(extra_config or {}))


def named_configs(names: Sequence[str], plugin_config: Mapping[str, Any]) -> list[RunConfig]:
    """The configurations `names` (CONFIG_KEYS) pick, in CONFIG_KEYS' order; the baseline always first (every other
    run's tokens are checked against it). "plugin-async" and "plugin-sliced" are the plugin over `plugin_config`
    with `load_mode` set so; "plugin" is the plugin over `plugin_config` as given (load_mode auto unless it says)."""
    unknown = [n for n in names if n not in CONFIG_KEYS]
    if unknown:
        raise ValueError(f"--configs: unknown configuration(s) {unknown}; known: {', '.join(CONFIG_KEYS)}")
    if "baseline" not in names:
        raise ValueError(f"--configs must include baseline (the reference for tokens and gains), got {list(names)}")
    chosen = []
    for key in CONFIG_KEYS:
        if key in names:
            chosen.append(_named(key, plugin_config))
    return chosen


def _named(key: str, plugin_config: Mapping[str, Any]) -> RunConfig:
    if key == "baseline":
        return RunConfig(BASELINE)
    if key == "peer":
        return peer_config()
    extra = dict(plugin_config)
    if key in PLUGIN_MODES:
        extra["load_mode"] = PLUGIN_MODES[key]
    return RunConfig(CONFIG_KEYS[key], PLUGIN_CONNECTOR, extra)


def load_mode_of(config: RunConfig) -> str:
    """How the plugin configuration loads its hits ("" for vLLM alone or a peer): its load_mode, auto by default."""
    return str(config.extra_config.get("load_mode", "auto")) if config.plugin else ""


def default_configs(plugin_config: Mapping[str, Any]) -> list[RunConfig]:
    """vLLM alone (the baseline) and vLLM with this plugin (`plugin_config`: its connector config)."""
    return [RunConfig(BASELINE), RunConfig(PLUGIN, PLUGIN_CONNECTOR, dict(plugin_config))]


def run_order(configs: Sequence[RunConfig], repeats: int) -> list[tuple[int, RunConfig]]:
    """(repeat, configuration) in the order they run: each repeat rotates the configurations by one, so each goes
    first equally often (with two: A B, B A, A B ...), and no configuration always inherits a warmer machine."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not configs:
        raise ValueError("a replay needs at least one configuration")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must be unique, got {names}")
    order = []
    for repeat in range(repeats):
        shift = repeat % len(configs)
        order += [(repeat, c) for c in [*configs[shift:], *configs[:shift]]]
    return order
