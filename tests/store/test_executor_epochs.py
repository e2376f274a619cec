"""A command of the node cache runs only against the mapping of the epoch it was issued for (issue 39, H2): the
executor refuses one of another epoch without touching the arena, and runs the rest of the same submit. A private
arena's commands (no epoch) run as before. The byte check on the arena is the evidence; its control is the same
store of the matching epoch, which does write the slot."""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np
import torch

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.routes.build import make_executor
from lmcache_npu.store.tier import OK

from .fakes import make_key


class WritingMover:
    """A device that stores a chunk by filling its slot with 0x5a (and loads by reading it)."""

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Any) -> None:
        for command, slot in zip(commands, objects):
            if isinstance(command, Store):
                slot.fill_(0x5A)
            report(command.cmd_id, OK)


def _executor(epoch: Any) -> StoreExecutor:
    executor = make_executor(0, HostArena(4, 4096, pinned=False), WritingMover(), io_threads=1)
    executor.epoch = epoch
    return executor


def test_a_command_of_another_epoch_is_refused_and_never_touches_the_arena() -> None:
    executor = _executor("E3/0")
    executor.submit([Store(1, make_key(1), 0, "r", 0, epoch="E2/0"), Load(2, make_key(2), 1, "q", 0, epoch="E2/0"),
                     Store(3, make_key(3), 2, "r", 1, epoch="E3/0"), Store(4, make_key(4), 3, "r", 2)])
    done = {c.cmd_id: c for c in executor.drain(30)}
    arena = executor.arena
    executor.close()
    assert {cmd_id: c.ok for cmd_id, c in done.items()} == {1: False, 2: False, 3: True, 4: False}
    assert "issued for node cache epoch E2/0, but this rank maps epoch E3/0" in done[1].reason
    assert not np.asarray(arena.slot_array(0)).any()  # E2's store left E3's slot as it was
    assert np.asarray(arena.slot_array(2)).all()  # the control: E3's own store wrote its slot


def test_use_arena_moves_the_executor_to_the_new_epochs_mapping() -> None:
    executor = _executor("E1/0")
    arena = HostArena(4, 4096, pinned=False)
    executor.use_arena(arena, "E2/0")
    executor.submit([Store(1, make_key(1), 1, "r", 0, epoch="E2/0"), Store(2, make_key(2), 2, "r", 0, epoch="E1/0")])
    done = {c.cmd_id: c.ok for c in executor.drain(30)}
    executor.close()
    assert done == {1: True, 2: False}
    assert np.asarray(arena.slot_array(1)).all() and not np.asarray(arena.slot_array(2)).any()


def test_a_private_arenas_commands_carry_no_epoch_and_run() -> None:
    executor = _executor(None)
    executor.submit([Store(1, make_key(1), 0, "r", 0), Load(2, make_key(1), 0, "q", 0)])
    assert all(c.ok for c in executor.drain(30))
    executor.close()
