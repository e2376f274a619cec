"""What a container orchestrator probes: `/healthz`, `/readyz` and `/version` answer while a verb holds the service's
lock (a scrape of `/metrics` waits for it: the control), `/healthz` turns 503 once the lock has been held past
WEDGED_AFTER_S and back once it is free, and `lmcache-npu node-ping` answers through the socket itself, also under
a held lock, and fails on a dead service's stale socket file where `test -S` passes."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from lmcache_npu.node import service as service_module
from lmcache_npu.node.probe import PingFailed, ping
from lmcache_npu.tools.cli import main

from .harness import Node, geometry, keys_of, store_config, wait_for


def get(node: Node, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    host, port = node.service.metrics_address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class HeldLock:
    """The service's lock held by a thread of its own (as a slow verb would), until `release()`."""

    def __init__(self, node: Node) -> None:
        self._held, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, args=(node,), daemon=True)
        self._thread.start()
        assert self._held.wait(10)

    def _hold(self, node: Node) -> None:
        with node.service.lock:
            self._held.set()
            self._done.wait(60)

    def release(self) -> None:
        self._done.set()
        self._thread.join(10)


@pytest.fixture
def served(start_node) -> Iterator[Node]:
    node = start_node(store_config(4, 1), metrics_port=0)
    node.engine("A", geometry(1)).store("w", keys_of(0, 2))  # a pool, whose pump turns
    yield node


def test_health_ready_and_version_answer_while_a_verb_holds_the_lock(served):
    held = HeldLock(served)
    try:
        assert get(served, "/healthz") == (200, "ok\n")
        assert get(served, "/readyz") == (200, "ok\n")
        status, text = get(served, "/version")
        about = json.loads(text)
        assert status == 200 and about["epoch"] == served.service.instance and about["serving"] is True
        assert about["version"] and about["pid"] == os.getpid()
        with pytest.raises((TimeoutError, urllib.error.URLError, socket.timeout)):  # control: /metrics waits
            get(served, "/metrics", timeout_s=0.5)
    finally:
        held.release()
    assert get(served, "/metrics")[0] == 200


def test_healthz_says_when_the_lock_has_been_held_too_long(served, monkeypatch):
    monkeypatch.setattr(service_module, "WEDGED_AFTER_S", 0.3)
    held = HeldLock(served)
    try:
        wait_for(lambda: get(served, "/healthz")[0] == 503, "/healthz to see the held lock")
        status, text = get(served, "/healthz")
        assert status == 503 and "the service's lock has been held for" in text
        assert get(served, "/readyz")[0] == 200  # still accepting: readiness is not liveness
    finally:
        held.release()
    wait_for(lambda: get(served, "/healthz") == (200, "ok\n"), "/healthz to recover once the lock is free")


def test_readiness_follows_the_accept_loop(served):
    assert served.service.serving and get(served, "/readyz")[0] == 200
    served.service.close()
    assert not served.service.serving and served.service.about()["serving"] is False


def test_node_ping_answers_under_a_held_lock_and_fails_on_a_stale_socket(served, capsys, node_dir):
    held = HeldLock(served)
    try:
        assert ping(served.path, timeout_s=5)["epoch"] == served.service.instance
        assert main(["node-ping", "--socket", served.path]) == 0
        assert json.loads(capsys.readouterr().out)["serving"] is True
    finally:
        held.release()
    stale = os.path.join(node_dir, "stale")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(stale)  # a dead service's socket file: no process listens on it
    dead.close()
    assert stat.S_ISSOCK(os.stat(stale).st_mode)  # control: what `test -S` checks passes
    with pytest.raises(PingFailed, match="no node cache answered"):
        ping(stale, timeout_s=2)
    assert main(["node-ping", "--socket", stale, "--timeout", "2"]) == 1
    assert "no node cache answered" in capsys.readouterr().err
