"""The transfer lanes on the host (the CPU attention backend): the page fence makes the next step wait until a
queued store has read its pages; without it the next step's writes reach the store first. The same scenarios run
on CUDA (tests/cuda) and NPU (tests/npu) with streams and events."""

from __future__ import annotations

import torch

from lmcache_npu.ops import Direction
from lmcache_npu.store.commands import Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.transfer import StorePlan

from . import ordering

CPU = torch.device("cpu")


def test_the_page_fence_holds_the_next_step_until_the_store_read_its_pages():
    assert ordering.fence_orders_the_next_forward(CPU) == {5.0}


def test_without_the_fence_the_next_steps_writes_reach_the_store_first():
    assert ordering.fence_orders_the_next_forward(CPU, fence=False) == {9.0}


def test_a_load_lands_in_the_pages():
    assert ordering.load_after_the_models_earlier_writes(CPU) == {3.0}


def test_plans_live_for_one_step_a_command_from_an_older_step_is_refused():
    setup = ordering.Setup(CPU)
    results = setup.run(Direction.STORE)
    setup.pending.wait(60)
    assert results[0][1].ok
    stale = Store(99, ChunkKey("0" * 32, b"stale..."), 1, "r", 0)
    setup.mover.expect([StorePlan("r", (99,), setup.window)])
    setup.mover.expect([])  # the next step: command 99 never reached the mover in its own step
    done = []
    setup.mover.run([stale], [setup.arena.slot(1)], lambda cmd_id, result: done.append(result))
    setup.mover.release_pages()
    assert len(done) == 1 and not done[0].ok and "no block window" in done[0].reason
    setup.mover.close()
