"""A worker's mapping across epochs (`WorkerNodeMapping`): a new epoch is mapped and registered off the step (the step
is told "not mapped" at once, never held up by a slow registration); a mapping whose service is gone is unmapped once
the commands in flight on it have settled, and not before; a mapping whose service lives is kept while the
scheduler names no epoch (a slow call is not a dead service)."""

from __future__ import annotations

import gc
import time
from typing import Any

from lmcache_npu.node.worker_mapping import WorkerNodeMapping
from lmcache_npu.store.metrics import Metric
from lmcache_npu.store.tier import TierCounters

from .harness import WAIT_S, WEIGHTS, geometry, hold_registration, memfd_mapped, store_config, wait_for


def mapping(node: Any, counters: TierCounters) -> WorkerNodeMapping:
    mapped = WorkerNodeMapping(node.path, "A", geometry(1), 0, counters, weights=WEIGHTS, pinned=False,
                               retry_s=0.05)
    mapped.start(WAIT_S)
    return mapped


def test_a_dead_epoch_is_unmapped_once_its_commands_settle(start_node):
    node = start_node(store_config(4, 1))
    counters = TierCounters()
    mapped = mapping(node, counters)
    base, span = mapped.arena.base_address, mapped.arena.total_bytes
    assert mapped.current is not None
    lease = mapped.current.sock  # the connection that holds this engine's lease on the pool
    assert mapped.epoch == node.pool.epoch and memfd_mapped(base, span)
    node.service.close()  # the service dies: its connection to this worker closes
    assert mapped.follow("", in_flight={7, 8}) is False  # the scheduler lost it too
    assert mapped.epoch is None and mapped.arena.num_slots == 0
    mapped.settle([7])
    gc.collect()
    assert memfd_mapped(base, span)  # command 8 may still move bytes in that mapping
    mapped.settle([8])
    wait_for(lambda: gc.collect() is not None and not memfd_mapped(base, span), "the dead epoch's mapping to go")
    wait_for(lambda: lease.fileno() == -1, "the dead epoch's connection to be closed")
    assert counters[Metric.NODE_EPOCH_RELEASES] == 1
    mapped.close()


def test_a_live_epoch_is_kept_while_the_scheduler_names_none(start_node):
    node = start_node(store_config(4, 1))
    mapped = mapping(node, TierCounters())
    epoch = mapped.epoch
    assert mapped.follow("", in_flight=()) is False  # the scheduler's call timed out: the service still holds us
    assert mapped.epoch == epoch and not mapped.retired
    assert mapped.follow(epoch, in_flight=()) is True  # its reconnect to the same epoch finds the mapping there
    mapped.close()


def test_a_new_epoch_is_mapped_off_the_step_and_its_commands_run_once_it_is(start_node, monkeypatch):
    node = start_node(store_config(4, 1), socket_name="s")
    counters = TierCounters()
    mapped = mapping(node, counters)
    node.service.close()
    successor = start_node(store_config(4, 1), socket_name="s")
    release = hold_registration(monkeypatch)
    successor.client("scheduler", geometry(1))  # the pool exists
    epoch = successor.pool.epoch
    try:
        began = time.monotonic()
        for _ in range(3):
            assert mapped.follow(epoch, in_flight=()) is False  # the step's commands fail: never waited for
        assert time.monotonic() - began < WAIT_S / 4 and not release.is_set()
        assert mapped.epoch is None  # the dead epoch is given back meanwhile
    finally:
        release.set()
    wait_for(lambda: mapped.follow(epoch, in_flight=()), "the new epoch to be mapped")
    assert mapped.epoch == epoch and mapped.arena.num_slots == 4
    assert counters[Metric.EPOCH_CHANGES] == 1
    mapped.close()
