"""`StoreExecutor.wait_for_any` (what an empty engine step waits on) returns once one of the named commands has
completed (its completion still waiting for `poll`), and not for any other command's completion; `wait_for_all`
(what a host step waits on for its own loads) only once every named one has."""

from __future__ import annotations

import threading

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.routes.build import make_executor
from lmcache_npu.store.tier import OK

from .fakes import make_key


class HeldMover:
    """Loads wait until `release` is set (on their own thread, as a transfer lane runs them); stores answer at once."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, commands, objects, report) -> None:
        if isinstance(commands[0], Store):
            for command in commands:
                report(command.cmd_id, OK)
            return

        def later() -> None:
            self.release.wait(30)
            for command in commands:
                report(command.cmd_id, OK)

        threading.Thread(target=later, daemon=True).start()


def _executor() -> tuple[StoreExecutor, HeldMover]:
    mover = HeldMover()
    return make_executor(0, HostArena(4, 4096, pinned=False), mover, io_threads=1), mover


def test_waits_for_a_named_load_and_leaves_its_completion_for_poll():
    executor, mover = _executor()
    executor.submit([Load(1, make_key(1), 0, "r", 0)])
    assert not executor.wait_for_any({1}, 0.05)  # negative control: the load is held, the wait times out
    threading.Timer(0.01, mover.release.set).start()
    assert executor.wait_for_any({1}, 30)
    assert [c.cmd_id for c in executor.poll()] == [1]
    executor.close()


def test_another_commands_completion_does_not_end_the_wait():
    executor, mover = _executor()
    executor.submit([Load(1, make_key(1), 0, "r", 0)])
    executor.submit([Store(2, make_key(2), 1, "s", 0)])  # completes at once
    assert not executor.wait_for_any({1}, 0.05)
    assert executor.wait_for_any({2}, 0.05)  # already completed: no wait
    assert not executor.wait_for_any(set(), 30)  # nothing named: nothing to wait for, returns at once
    mover.release.set()
    assert executor.wait_for_any({1}, 30)
    assert sorted(c.cmd_id for c in executor.poll()) == [1, 2]
    executor.close()


def test_wait_for_all_needs_every_named_command():
    executor, mover = _executor()
    executor.submit([Store(2, make_key(2), 1, "s", 0)])  # completes at once
    executor.submit([Load(1, make_key(1), 0, "r", 0)])
    assert executor.wait_for_all({2}, 0.05)  # already completed: no wait
    assert not executor.wait_for_all({1, 2}, 0.05)  # negative control: one of them is held
    assert executor.wait_for_all(set(), 0.0)  # nothing named: nothing outstanding
    threading.Timer(0.01, mover.release.set).start()
    assert executor.wait_for_all({1, 2}, 30)
    assert sorted(c.cmd_id for c in executor.poll()) == [1, 2]
    executor.close()
