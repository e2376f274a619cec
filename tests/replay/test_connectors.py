"""replay.connectors: each configuration's kv_transfer_config, services started only when a configuration needs them,
and a peer that cannot start refused with its reason (the other configurations still run)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.tools.replay.configs import (BASELINE, PEER, PLUGIN, RunConfig, default_configs, named_configs,
                                              peer_config)
from lmcache_npu.tools.replay.connectors import (ConnectorServices, connector_services, peer_client_config,
                                                 release_peer, transfer_config, transfer_config_json)

PEER_SERVICES = ConnectorServices(mooncake_master="127.0.0.1:5", mooncake_config_path="/tmp/mooncake.json")


def test_vllm_alone_has_no_transfer_config():
    assert transfer_config(RunConfig(BASELINE), ConnectorServices()) is None
    assert transfer_config_json(RunConfig(BASELINE), ConnectorServices()) is None


@given(st.dictionaries(st.sampled_from(["chunk_tokens", "cpu_bytes", "disk_path"]),
                       st.one_of(st.integers(1, 4096), st.text(max_size=12)), max_size=3))
@settings(max_examples=30, deadline=None)
def test_the_plugins_transfer_config_carries_its_extra_config(extra):
    config = RunConfig(PLUGIN, "lmcache-npu", extra)
    values = transfer_config(config, ConnectorServices())
    assert values == {"kv_connector": "LMCacheNPUConnector", "kv_role": "kv_both",
                      "kv_connector_module_path": "lmcache_npu.integration.vllm", "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": extra}
    assert json.loads(transfer_config_json(config, ConnectorServices()) or "") == values
    values["kv_connector_extra_config"]["chunk_tokens"] = -1  # the dict is a copy: the configuration is untouched
    assert config.extra_config.get("chunk_tokens") != -1


def test_the_peers_transfer_config_is_vllms_mooncake_store_connector():
    values = transfer_config(peer_config({"cache_prefix": "run-1"}), PEER_SERVICES)
    assert values is not None
    assert values["kv_connector"] == "MooncakeStoreConnector" and "kv_connector_module_path" not in values
    extra = values["kv_connector_extra_config"]
    assert extra["cache_prefix"] == "run-1" and isinstance(extra["lookup_rpc_port"], int)
    # each engine its own lookup channel (an ipc path named by it): two engines never share one
    again = transfer_config(peer_config(), PEER_SERVICES)
    assert again is not None and again["kv_connector_extra_config"]["lookup_rpc_port"] != extra["lookup_rpc_port"]
    # a channel the user chose is kept
    chosen = transfer_config(peer_config({"lookup_rpc_port": 7}), PEER_SERVICES)
    assert chosen is not None and chosen["kv_connector_extra_config"]["lookup_rpc_port"] == 7


def test_the_peer_needs_its_master():
    with pytest.raises(ValueError, match="needs a Mooncake master"):
        transfer_config(peer_config(), ConnectorServices())
    with pytest.raises(ValueError, match="needs the Mooncake master's address"):
        peer_client_config("")
    client = peer_client_config("127.0.0.1:9")
    assert client["master_server_address"] == "127.0.0.1:9" and client["protocol"] == "tcp"


def test_an_unknown_connector_is_refused_by_name():
    with pytest.raises(ValueError, match="'odd'.*unknown connector 'nixl'"):
        transfer_config(RunConfig("odd", "nixl"), ConnectorServices())
    with pytest.raises(ValueError, match="unknown connector"):
        with connector_services([RunConfig("odd", "nixl")]):
            pass


def test_no_peer_no_services():
    with connector_services(default_configs({})) as services:
        assert services == ConnectorServices()  # nothing started, nothing refused
        assert "MOONCAKE_CONFIG_PATH" not in services.env


def test_a_peer_that_cannot_start_is_refused_with_its_reason_and_the_rest_runs():
    configs = named_configs(["baseline", "plugin", "peer"], {"chunk_tokens": 128})
    with connector_services(configs, probe_peer=lambda: "this vLLM (0.23.0) has no MooncakeStoreConnector") as services:
        assert services.unavailable == {PEER: "this vLLM (0.23.0) has no MooncakeStoreConnector"}
        assert [c.name for c in services.runnable(configs)] == [BASELINE, PLUGIN]
        with pytest.raises(ValueError, match="cannot run here: this vLLM"):
            transfer_config(configs[2], services)
        assert transfer_config(configs[1], services) is not None  # negative control: the plugin is not refused
    path = ""
    with connector_services(configs, probe_peer=lambda: "") as services:  # a peer that can start: nothing refused
        if services.unavailable:  # the master itself did not come up on this machine: said so, by configuration
            assert list(services.unavailable) == [PEER] and "mooncake_master" in services.unavailable[PEER]
        else:
            assert [c.name for c in services.runnable(configs)] == [BASELINE, PLUGIN, PEER]
            path = services.env["MOONCAKE_CONFIG_PATH"]
            assert os.environ["MOONCAKE_CONFIG_PATH"] == path  # in-process engines read it
            assert json.loads(open(path).read())["master_server_address"] == services.mooncake_master
    assert "MOONCAKE_CONFIG_PATH" not in os.environ or os.environ["MOONCAKE_CONFIG_PATH"] != path


def test_named_configs_keep_the_baseline_first():
    configs = named_configs(["peer", "baseline"], {})
    assert [c.name for c in configs] == [BASELINE, PEER] and configs[1].peer and not configs[1].plugin
    assert not configs[0].peer and not RunConfig(PLUGIN, "lmcache-npu").peer
    with pytest.raises(ValueError, match="must include baseline"):
        named_configs(["plugin", "peer"], {})
    with pytest.raises(ValueError, match=r"unknown configuration\(s\) \['nixl'\]"):
        named_configs(["baseline", "nixl"], {})


class _Socket:
    def __init__(self, server):
        self.server, self.sent, self.closed, self.options = server, [], False, {}

    def setsockopt(self, option, value):
        self.options[option] = value

    def send_multipart(self, frames):
        self.sent.append(frames)

    def recv(self):
        self.server.answered = not self.server.running  # the server answers after it was told to stop
        return b"err"

    def close(self, linger=0):
        self.closed = True


class _Context:
    def __init__(self):
        self.terminated = False

    def term(self):
        self.terminated = True


def test_release_peer_stops_the_lookup_server_before_closing_its_context():
    server = SimpleNamespace(running=True, answered=False, ctx=_Context(), closed=False,
                             thread=SimpleNamespace(join=lambda timeout: None))
    server.close = lambda: setattr(server, "closed", True)
    client = SimpleNamespace(ctx=_Context(), socket=_Socket(server))
    client.close = lambda: client.socket.close()
    release_peer(SimpleNamespace(connector_scheduler=SimpleNamespace(client=client)),
                 SimpleNamespace(connector_worker=SimpleNamespace(lookup_server=server)))
    assert server.answered and client.socket.sent == [[b"stop"]]
    assert server.closed and client.socket.closed and server.ctx.terminated and client.ctx.terminated
    with pytest.raises(ValueError, match="MooncakeStoreConnector's scheduler and worker halves"):
        release_peer(SimpleNamespace(), SimpleNamespace(connector_worker=SimpleNamespace(lookup_server=server)))
