"""The configurations a replay compares, and the order their runs go in.

A configuration is one engine setup over the same workload: vLLM alone, vLLM with this plugin, and (a later change)
vLLM with a peer connector such as its own MooncakeStoreConnector. The first is the reference every other run's
tokens are checked against and the baseline its gains are measured from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class RunConfig:
    """One configuration: its name in tables, and the connector it runs (none: vLLM alone)."""

    name: str
    connector: str = ""  # "" for vLLM alone, "lmcache-npu" for this plugin
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # the connector's kv_connector_extra_config

    @property
    def plugin(self) -> bool:
        return self.connector == "lmcache-npu"


BASELINE = "vLLM alone"
PLUGIN = "vLLM + lmcache-npu"


def default_configs(plugin_config: Mapping[str, Any]) -> list[RunConfig]:
    """vLLM alone (the baseline) and vLLM with this plugin (`plugin_config`: its connector config)."""
    return [RunConfig(BASELINE), RunConfig(PLUGIN, "lmcache-npu", dict(plugin_config))]


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
