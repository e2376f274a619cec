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
CONFIG_KEYS = {"baseline": BASELINE, "plugin": PLUGIN, "peer": PEER}  # `lmcache-npu replay --configs` names


def peer_config(extra_config: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """vLLM's own MooncakeStoreConnector with its defaults (`extra_config`: its kv_connector_extra_config)."""
    return RunConfig(PEER, MOONCAKE_STORE, dict(extra_config or {}))


def named_configs(names: Sequence[str], plugin_config: Mapping[str, Any]) -> list[RunConfig]:
    """The configurations `names` ("baseline", "plugin", "peer") pick, in that order; the baseline always first
    (every other run's tokens are checked against it)."""
    unknown = [n for n in names if n not in CONFIG_KEYS]
    if unknown:
        raise ValueError(f"--configs: unknown configuration(s) {unknown}; known: {', '.join(CONFIG_KEYS)}")
    if "baseline" not in names:
        raise ValueError(f"--configs must include baseline (the reference for tokens and gains), got {list(names)}")
    chosen = []
    for key in CONFIG_KEYS:
        if key in names:
            chosen.append({"baseline": lambda: RunConfig(BASELINE),
                           "plugin": lambda: RunConfig(PLUGIN, PLUGIN_CONNECTOR, dict(plugin_config)),
                           "peer": peer_config}[key]())
    return chosen


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
