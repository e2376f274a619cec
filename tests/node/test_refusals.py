"""Engines the service will not take, whatever their geometry, and what each side is told (issue 39, C1 and H6):

- an engine whose model identity names its weights by nothing: the node keeps and shares chunks beyond any engine,
  so two models of one config would share a namespace (the engine refuses itself first, engine_identity.py; the
  service refuses too, for an engine that does not, or says nothing);
- an engine or a service of another protocol version (a DaemonSet upgraded apart from its engines): refused at
  attach, naming both versions, and a running engine serves misses until a service of its version is back.
"""

from __future__ import annotations

import dataclasses

import re

import logging
from typing import Any

import pytest

from lmcache_npu.node import service as service_module
from lmcache_npu.node.client import NodeCacheClient, NodeCacheRefused
from lmcache_npu.node.messages import (PROTOCOL_VERSION, WEIGHTS_CONTENT, WEIGHTS_NAMED, WEIGHTS_UNNAMED, Attach,
                                       Attached, Refused)
from lmcache_npu.node.pool import NodePool
from lmcache_npu.store.index.contract import LookupResult
from lmcache_npu.store.metrics import Metric

from .harness import WEIGHTS, geometry, keys_of, store_config, wait_for
from .test_bad_input import RawPeer

WORLD = 1


def _legacy(attach: Attach, *fields: str) -> Attach:
    """`attach` as an engine that predates `fields` sends it: unpickled, the fields are not its own."""
    for name in fields:
        del vars(attach)[name]
    return attach


@pytest.mark.parametrize("attach", [
    Attach("e", geometry(WORLD), weights=WEIGHTS_UNNAMED),
    Attach("e", geometry(WORLD), 0, weights=WEIGHTS_UNNAMED),  # a worker, too
    Attach("e", geometry(WORLD)),  # an engine that does not say how its weights are named
    _legacy(Attach("e", geometry(WORLD), weights=WEIGHTS_CONTENT), "weights"),
    Attach("e", geometry(WORLD), weights="sha1"),
], ids=["unnamed", "unnamed-worker", "unsaid", "field-missing", "unknown"])
def test_an_engine_whose_weights_nothing_names_is_refused_naming_the_fix(start_node, attach: Attach) -> None:
    node = start_node(store_config(4, WORLD))
    peer = RawPeer(node.path, attach)
    peer.close()
    assert isinstance(peer.reply, Refused), peer.reply
    assert "names its weights by nothing" in peer.reply.reason and "model_fingerprint" in peer.reply.reason
    assert node.service.pools == {}  # refused before any pool is made for it


def test_the_client_of_an_engine_with_unnamed_weights_is_refused_and_named_ones_attach(start_node) -> None:
    node = start_node(store_config(4, WORLD))
    unnamed = NodeCacheClient(node.path, "unnamed", geometry(WORLD), weights=WEIGHTS_UNNAMED, connect_timeout_s=5.0)
    assert unnamed.epoch is None and unnamed.counters[Metric.NODE_CACHE_REFUSED] >= 1  # starts, serves misses
    assert re.search("refused this engine: .*names its weights by nothing", unnamed._refusal), unnamed._refusal
    unnamed.close()
    for weights in (WEIGHTS_CONTENT, WEIGHTS_NAMED):  # the control: weights named by content or by the operator
        client = NodeCacheClient(node.path, weights, geometry(WORLD), weights=weights, connect_timeout_s=5.0)
        assert client.epoch is not None
        client.close()


@pytest.mark.parametrize("attach", [
    Attach("e", geometry(WORLD), weights=WEIGHTS, protocol=PROTOCOL_VERSION - 1),
    Attach("e", geometry(WORLD), weights=WEIGHTS, protocol=PROTOCOL_VERSION + 1),
], ids=["older", "newer"])  # an engine from before versions sends pickles: refused as such (test_security)
def test_an_engine_of_another_protocol_version_is_refused_naming_both(start_node, attach: Attach) -> None:
    node = start_node(store_config(4, WORLD))
    peer = RawPeer(node.path, attach)
    peer.close()
    theirs = vars(attach).get("protocol", 1)
    assert isinstance(peer.reply, Refused), peer.reply
    assert f"speaks node cache protocol {theirs} and the service {PROTOCOL_VERSION}" in peer.reply.reason
    control = RawPeer(node.path, Attach("e", geometry(WORLD), weights=WEIGHTS))  # this version's engine attaches
    control.close()
    assert isinstance(control.reply, Attached)


def test_an_engine_refuses_a_service_of_another_protocol_version(start_node, monkeypatch) -> None:
    node = start_node(store_config(4, WORLD))
    attached = NodePool.attached
    monkeypatch.setattr(NodePool, "attached", lambda pool: dataclasses.replace(attached(pool), protocol=1))  # older
    client = node.client("A", geometry(WORLD))  # the engine starts and serves misses, the reason said once
    assert client.epoch is None and f"speaks protocol 1 and this engine {PROTOCOL_VERSION}" in client._refusal
    with pytest.raises(NodeCacheRefused, match="speaks protocol 1"):
        node.worker("A", 0, geometry(WORLD))


def test_a_successor_of_another_version_leaves_the_engine_serving_misses_until_one_of_its_own(
        start_node, monkeypatch, caplog: Any) -> None:
    """The DaemonSet's service is upgraded apart from the engines: a running engine is refused at reattach and serves
    misses (said once, as a warning naming both versions); when a service of its version is back it attaches."""
    caplog.set_level(logging.DEBUG, logger="lmcache_npu.node.client")
    node = start_node(store_config(4, WORLD), socket_name="s")
    engine = node.engine("A", geometry(WORLD))
    engine.store("w", keys_of(0, 1))
    client = engine.client
    client.retry_s = 0.01
    node.service.close()
    monkeypatch.setattr(service_module, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    newer = start_node(store_config(4, WORLD), socket_name="s")
    wait_for(lambda: client.lookup("q", keys_of(0, 1)) == LookupResult(0, 0) and caplog.text.count("protocol") >= 1,
             "the engine to be refused by the newer service")
    for _ in range(3):  # still refused at every try: misses, never an exception
        wait_for(lambda: client._retrying is None, "the attempt to end")
        assert client.lookup("q", keys_of(0, 1)) == LookupResult(0, 0)
        assert client.prepare_store("s", [(1, keys_of(1, 1)[0])]) == []
    assert client.epoch is None and client.counters[Metric.NODE_CACHE_RECONNECTS] == 0
    warned = [r for r in caplog.records if r.name == "lmcache_npu.node.client" and r.levelno == logging.WARNING
              and "protocol" in r.getMessage()]
    assert len(warned) == 1 and (f"speaks node cache protocol {PROTOCOL_VERSION} and the service "
                                 f"{PROTOCOL_VERSION + 1}") in warned[0].getMessage()
    with pytest.raises(NodeCacheRefused):  # its workers are refused too: they keep their mapping, moving nothing new
        newer.worker("A", 0, geometry(WORLD))
    newer.service.close()
    monkeypatch.undo()  # the control: a service of the engine's own version is taken up
    start_node(store_config(4, WORLD), socket_name="s")
    wait_for(lambda: client.lookup("q", keys_of(0, 1)) is not None and client.epoch is not None,
             "the engine to attach to a service of its version")
    assert client.counters[Metric.NODE_CACHE_RECONNECTS] == 1
