"""The transfer lanes on the host (the CPU attention backend): the page fence makes the next step wait until a
queued store has read its pages; without it the next step's writes reach the store first. The same scenarios run
on CUDA (tests/cuda) and NPU (tests/npu) with streams and events."""

from __future__ import annotations

import pytest
import torch

from lmcache_npu.ops import Direction
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.transfer import DeviceMove

from . import ordering

CPU = torch.device("cpu")


def test_the_page_fence_holds_the_next_step_until_the_store_read_its_pages():
    assert ordering.fence_orders_the_next_forward(CPU) == {5.0}


def test_without_the_fence_the_next_steps_writes_reach_the_store_first():
    assert ordering.fence_orders_the_next_forward(CPU, fence=False) == {9.0}


def test_a_load_lands_in_the_pages():
    assert ordering.load_after_the_models_earlier_writes(CPU) == {3.0}


def test_a_command_without_its_device_end_is_refused_before_anything_is_queued():
    setup = ordering.Setup(CPU)
    results = setup.run(Direction.STORE)
    setup.pending.wait(60)
    assert results[0][1].ok
    bare = Store(99, ChunkKey("0" * 32, b"bare...."), 1, "r", 0)
    done = []
    with pytest.raises(TypeError, match="DeviceMove"):
        setup.mover.run([bare], [setup.arena.slot(1)], lambda cmd_id, result: done.append(result))
    mixed = [DeviceMove(bare, setup.window), DeviceMove(Load(98, bare.key, 2, "r", 0), setup.window, 0, 1)]
    with pytest.raises(ValueError, match="all stores or all loads"):
        setup.mover.run(mixed, [setup.arena.slot(1), setup.arena.slot(2)], lambda cmd_id, result: done.append(result))
    setup.mover.release_pages()
    assert done == []
    setup.mover.close()
