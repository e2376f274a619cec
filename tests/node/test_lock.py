"""Nothing slow runs under the service's lock, the one every engine's verbs wait for: an engine's death is one
aggregated log line emitted once the lock is free (not a WARNING per abandoned command, each written with the lock
held: the review's R10, where a stalled stderr pipe froze the whole service), failed commands are logged per kind
and reason outside it, and /metrics is formatted outside it from a snapshot taken under it."""

from __future__ import annotations

import logging
import urllib.request
from typing import Iterator

import pytest

from lmcache_npu.node import exporter
from lmcache_npu.node.service import NodeCacheService

from .harness import answer, geometry, keys_of, store_config, sync, wait_released

ONE_RANK = geometry(world=1)


class LockWatch(logging.Handler):
    """Every record of lmcache_npu's loggers, with whether the emitting thread held the service's lock."""

    def __init__(self, service: NodeCacheService) -> None:
        super().__init__(logging.DEBUG)
        self.service = service
        self.records: list[tuple[logging.LogRecord, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record, self.service.lock._is_owned()))  # type: ignore[attr-defined]

    def under_lock(self) -> list[str]:
        return [record.getMessage() for record, held in self.records if held]

    def messages(self, level: int = logging.INFO) -> list[str]:
        return [record.getMessage() for record, _ in self.records if record.levelno >= level]


@pytest.fixture
def watch(start_node) -> Iterator[tuple[object, LockWatch]]:
    node = start_node(store_config(300, 1))
    handler = LockWatch(node.service)
    root = logging.getLogger("lmcache_npu")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield node, handler
    root.removeHandler(handler)
    root.setLevel(level)


def test_an_engines_death_is_one_line_written_outside_the_lock(watch):
    node, handler = watch
    node.engine("P", ONE_RANK).store("warm", keys_of(0, 50))
    doomed = node.engine("doomed", ONE_RANK)
    stores = doomed.client.prepare_store("w", list(enumerate(keys_of(100, 200))))
    assert doomed.client.lookup("r", keys_of(0, 50)).ready_chunks == 50
    loads = doomed.client.prepare_load("r", list(enumerate(keys_of(0, 50))))
    assert len(stores) == 200 and len(loads) == 50
    handler.records.clear()
    doomed.client.close()
    for worker in doomed.workers:
        worker.close()
    assert wait_released(node.service, "doomed", [c.cmd_id for c in stores + loads]) == []
    assert handler.under_lock() == []
    ended = [text for text in handler.messages() if "engine doomed left" in text]
    assert ended == ["node cache: engine doomed left; 1 request(s) released, 250 unanswered command(s) failed"]
    assert handler.messages(logging.WARNING) == ended  # nothing per command


def test_failed_answers_are_logged_by_kind_and_reason_outside_the_lock(watch):
    node, handler = watch
    engine = node.engine("A", ONE_RANK)
    stores = engine.client.prepare_store("w", list(enumerate(keys_of(0, 40))))
    engine.client.take_commands()
    handler.records.clear()
    answer(engine.client, stores, [0], ok=False)
    sync(engine.client)  # a round trip: the one-way answers were handled
    assert handler.under_lock() == []
    failed = [text for text in handler.messages(logging.WARNING) if "command(s) failed" in text]
    assert len(failed) == 1 and "40 Store command(s) failed" in failed[0] and "rank 0: device: test" in failed[0]


def test_metrics_are_formatted_outside_the_lock(start_node, monkeypatch):
    node = start_node(store_config(8, 2), metrics_port=0)
    node.engine("A").store("w", keys_of(0, 4))
    formatted: list[bool] = []
    original = exporter._sample

    def watched(name: str, labels: dict[str, str], value: float) -> str:
        formatted.append(node.service.lock._is_owned())  # type: ignore[attr-defined]
        return original(name, labels, value)

    monkeypatch.setattr(exporter, "_sample", watched)
    text = node.service.metrics_text()
    assert 'lmcache_npu:node_stores_total{engine="A"' in text
    assert len(formatted) > 20 and not any(formatted)
    taken: list[bool] = []
    original_snapshot = exporter.snapshot

    def snapshot(service: NodeCacheService) -> list:
        taken.append(service.lock._is_owned())  # type: ignore[attr-defined]
        return original_snapshot(service)

    monkeypatch.setattr(exporter, "snapshot", snapshot)
    formatted.clear()
    host, port = node.service.metrics_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:  # the scrape's thread
        assert response.read().decode() == text
    assert taken == [True] and len(formatted) > 20 and not any(formatted)


def test_the_remote_existence_check_is_asked_without_the_lock(start_node):
    node = start_node(store_config(8, 1))
    engine = node.engine("A", ONE_RANK)
    engine.store("w", keys_of(0, 2))
    asked: list[tuple[int, bool]] = []

    def exists(keys: list) -> list[bool]:  # the Mooncake batch_is_exist RPC (up to a second on a sick master)
        asked.append((len(keys), node.service.lock._is_owned()))  # type: ignore[attr-defined]
        return [False] * len(keys)

    node.pool.index._remote._exists = exists  # a remote tier for this pool (white box: no Mooncake master here)
    node.pool.index.remote_configured = True
    keys = keys_of(0, 6)
    assert engine.client.lookup("q", keys).hit_chunks == 2
    assert engine.client.presence(keys) == [True, True, False, False, False, False]
    assert engine.client.presence(keys, remote=False) == [True, True, False, False, False, False]
    assert asked == [(4, False), (4, False)]  # the 4 keys past the local prefix, once per verb, lock free
