"""The executor dispatches by route (source, destination): every kind of byte move has one, the device mover sees
each run of consecutive same-route commands as one batch, and a run is cut where the route changes."""

from __future__ import annotations

import pytest

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import (ARENA_TO_DEVICE, ARENA_TO_DISK, ARENA_TO_REMOTE, DEVICE_TO_ARENA,
                                        DISK_DROP, DISK_TO_ARENA, REMOTE_DROP, REMOTE_TO_ARENA, Drop, Load, Persist,
                                        Promote, Put, Spill, Store, Tier)
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.routes.context import RouteContext
from lmcache_npu.store.routes.guard import EnvelopeGuard
from lmcache_npu.store.routes.build import make_executor
from lmcache_npu.store.tier import OK

from .fakes import make_key


class RecordingMover:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def run(self, commands, objects, report) -> None:
        self.batches.append([c.cmd_id for c in commands])
        for command in commands:
            report(command.cmd_id, OK)


@pytest.mark.parametrize("command, route", [
    (Store(1, make_key(1), 0, "r", 0), DEVICE_TO_ARENA),
    (Load(1, make_key(1), 0, "r", 0), ARENA_TO_DEVICE),
    (Spill(1, make_key(1), 0), ARENA_TO_DISK),
    (Persist(1, make_key(1), 0), ARENA_TO_DISK),
    (Promote(1, make_key(1), 0, Tier.DISK), DISK_TO_ARENA),
    (Promote(1, make_key(1), 0, Tier.REMOTE), REMOTE_TO_ARENA),
    (Put(1, make_key(1), 0), ARENA_TO_REMOTE),
    (Drop(1, make_key(1), Tier.DISK), DISK_DROP),
    (Drop(1, make_key(1), Tier.REMOTE), REMOTE_DROP),
])
def test_every_byte_move_has_its_route(command, route):
    assert command.route == route


def test_consecutive_device_moves_of_one_route_are_one_batch_and_a_route_change_cuts_it():
    mover = RecordingMover()
    executor = make_executor(0, HostArena(8, 4096, pinned=False), mover, io_threads=1)
    commands = [Store(1, make_key(1), 0, "r", 0), Store(2, make_key(2), 1, "r", 1), Load(3, make_key(3), 2, "q", 0),
                Load(4, make_key(4), 3, "q", 1), Store(5, make_key(5), 4, "r", 2)]
    executor.submit(commands)
    done = executor.drain(30)
    executor.close()
    assert mover.batches == [[1, 2], [3, 4], [5]]
    assert sorted((c.cmd_id, c.ok) for c in done) == [(i, True) for i in range(1, 6)]


def test_a_route_without_its_tier_answers_every_command_with_the_reason():
    executor = make_executor(0, HostArena(4, 4096, pinned=False), RecordingMover(), io_threads=1)
    executor.submit([Promote(1, make_key(1), 0, Tier.DISK), Put(2, make_key(2), 1), Spill(3, make_key(3), 2)])
    done = {c.cmd_id: c for c in executor.drain(30)}
    executor.close()
    assert {cmd_id: (c.ok, c.reason) for cmd_id, c in done.items()} == {
        1: (False, "no disk tier"), 2: (False, "no remote tier"), 3: (False, "no disk tier")}


class StubHandler:
    """A handler that records its batches and answers each command ok."""

    def __init__(self, context: RouteContext, routes, batched: bool) -> None:
        self.context, self.routes, self.batched, self.tier = context, frozenset(routes), batched, None
        self.batches: list[list[int]] = []

    def submit(self, batch) -> None:
        self.batches.append([c.cmd_id for c in batch])
        for command in batch:
            self.context.report(command.cmd_id, OK)

    def close(self) -> None:
        pass


def test_the_executor_only_dispatches_to_the_handler_of_each_route():
    context = RouteContext(0, HostArena(4, 4096, pinned=False), io_threads=1)
    batched = StubHandler(context, [ARENA_TO_REMOTE], batched=True)
    single = StubHandler(context, [DISK_DROP, ARENA_TO_DISK], batched=False)
    executor = StoreExecutor(context, EnvelopeGuard(context), [batched, single])
    executor.submit([Put(1, make_key(1), 0), Put(2, make_key(2), 1), Drop(3, make_key(3), Tier.DISK),
                     Drop(4, make_key(4), Tier.DISK), Spill(5, make_key(5), 2), Put(6, make_key(6), 3),
                     Load(7, make_key(7), 0, "r", 0)])
    done = {c.cmd_id: (c.ok, c.reason) for c in executor.drain(30)}
    executor.close()
    assert batched.batches == [[1, 2], [6]] and single.batches == [[3], [4], [5]]
    assert done[7][0] is False and "no handler" in done[7][1]  # a route no handler serves fails, the rest run
    assert all(done[i] == (True, "") for i in range(1, 7))


def test_two_handlers_of_one_route_are_refused():
    context = RouteContext(0, HostArena(4, 4096, pinned=False), io_threads=1)
    with pytest.raises(ValueError, match="two handlers"):
        StoreExecutor(context, EnvelopeGuard(context), [StubHandler(context, [DISK_DROP], False),
                                                        StubHandler(context, [DISK_DROP, REMOTE_DROP], False)])
    context.shutdown()
