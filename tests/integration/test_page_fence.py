"""The narrow page fence through vLLM 0.23's real Scheduler (issue 23, item 5) and the stores a step bound but never
queued (the last bullet).

`LaggingStores` makes every store as late as the fence allows: a store batch reads its pages only when a fence waits
for it, or `lag` steps after it was queued, i.e. after the forwards of the steps in between wrote their pages. A
write the scheduler failed to name would then reach a stored chunk, and the replay that loads the stored chunks back
(each page checked against the simulated model) fails: the negative control lets a named batch read only after the
step's forward, and fails so.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.integration.vllm.fence import tail_blocks
from lmcache_npu.integration.vllm.metadata import LMCacheNPUConnectorMetadata
from lmcache_npu.ops import Direction
from lmcache_npu.store.commands import Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.transfer import BlockWindow, DeviceMove, StorePlan

from .conftest import assert_quiescent, preset_engine, prompt
from .sim import SimModel, prefix_hashes

LAYOUTS = [("llama3-8b", "ascend"), ("gpt-oss-120b", "cuda"), ("deepseek-v4-flash", "ascend")]
IDS = ["one-group", "sliding+full", "deepseek-v4"]
TIGHT = {"one-group": {"num_blocks": 20}, "sliding+full": {"num_blocks": 200},
         "deepseek-v4": {"num_blocks": 80, "max_num_batched_tokens": 256}}


class LaggingStores:
    """Holds each store batch of every rank before its kernel until a fence waits for it or `lag` steps passed."""

    def __init__(self, engine: Any, lag: int = 3, unfenced: bool = False) -> None:
        self.engine, self.lag = engine, lag
        self.unfenced = unfenced  # the negative control: a named batch reads only after the step's forward
        self.after_forward: set[int] = set()
        self.cond = threading.Condition()
        self.closed = False
        self.queued_at: dict[int, int] = {}  # id(job) -> the engine step that queued it
        self.released: set[int] = set()
        self.fenced = 0  # batches released because a fence waited for them
        self.movers = [w.worker_half.mover for w in engine.workers]
        for mover in self.movers:
            self._install(mover)
        step = engine.step

        def stepped() -> Any:
            out = step()
            self.tick()
            return out

        engine.step = stepped

    def _install(self, mover: Any) -> None:
        run, execute, release = mover.run, mover._execute, mover.release_pages

        def lagged_run(moves, objects, report) -> None:
            run(moves, objects, report)
            if moves[0].is_store:
                with self.cond:
                    self.queued_at[id(mover._reading[-1])] = self.engine.steps

        def lagged_execute(lane, job) -> None:
            if job.direction == Direction.STORE:
                with self.cond:
                    assert self.cond.wait_for(lambda: self.closed or id(job) in self.released, 120), "a store was held"
            execute(lane, job)

        def fence(stores: Optional[Any] = None) -> int:
            wanted = None if stores is None else set(stores)
            waited = [j for j in mover._reading if not j.finished.is_set()
                      and (wanted is None or any(m.cmd_id in wanted for m in j.moves))]
            if waited:
                with self.cond:
                    last = max(mover._reading.index(j) for j in waited)
                    for job in mover._reading[:last + 1]:  # the lane runs its batches in order
                        if id(job) not in self.released:
                            (self.after_forward if self.unfenced else self.released).add(id(job))
                            self.fenced += 1
                    self.cond.notify_all()
            return release([] if self.unfenced else stores)

        mover.run, mover._execute, mover.release_pages = lagged_run, lagged_execute, fence

    def tick(self) -> None:
        with self.cond:
            self.released |= self.after_forward
            for job, step in self.queued_at.items():
                if step <= self.engine.steps - self.lag:
                    self.released.add(job)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


@pytest.fixture
def lagging():
    made: list[LaggingStores] = []

    def make(engine: Any, lag: int = 3, unfenced: bool = False) -> LaggingStores:
        made.append(LaggingStores(engine, lag, unfenced))
        return made[-1]

    yield make
    for harness in made:
        harness.close()  # before the engines close: a held lane would never join


def _fence_totals(engine: Any) -> tuple[int, int]:
    movers = [w.worker_half.mover for w in engine.workers]
    return sum(m.fence_waits for m in movers), sum(m.fence_skips for m in movers)


def _preempt_then_replay(engine: Any) -> list[str]:
    """Three long requests that outgrow the blocks (vLLM preempts and reuses blocks whose stores may be in flight),
    then every one again on an empty device cache: every chunk they stored is loaded and its pages checked."""
    chunk = engine.connector.scheduler_half.chunk_tokens
    shared = prompt(4 * chunk, seed=17)
    texts = [shared + prompt(200 + 30 * i, seed=30 + i) for i in range(3)]
    ids = [engine.add(t, max_tokens=chunk) for t in texts]
    engine.run(max_steps=5000)
    assert any(engine.requests[r].num_preemptions for r in ids), "the budget did not force a preemption"
    histories = [t + engine.output_tokens(r) for t, r in zip(texts, ids)]
    for history in histories:
        engine.evict_device_cache()
        replay = engine.add(history + [7], max_tokens=1)
        engine.run(max_steps=5000)
        assert engine.loaded_tokens.get(replay, 0) > 0, "the replay loaded nothing"
    return ids


@pytest.mark.parametrize("preset,family,layout", [(*p, i) for p, i in zip(LAYOUTS, IDS)], ids=IDS)
def test_stores_as_late_as_the_fence_allows_still_hold_the_models_bytes(make_engine, lagging, preset, family,
                                                                        layout):
    engine = preset_engine(make_engine, preset, family, **TIGHT[layout])
    lagging(engine)
    _preempt_then_replay(engine)
    _, skips = _fence_totals(engine)
    assert skips > 0, "no store was ever left to read beside a step"
    assert_quiescent(engine)


def test_a_step_that_writes_other_pages_adds_no_wait(make_engine, lagging):
    """A request's prompt chunks are stored while it decodes (its new tokens land in later blocks) and another request
    runs in blocks of its own: every step leaves the store reading beside it."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=200)
    lagging(engine, lag=6)
    chunk = engine.connector.scheduler_half.chunk_tokens
    engine.add(prompt(2 * chunk, seed=51), max_tokens=8, request_id="a")
    engine.add(prompt(chunk // 2, seed=52), max_tokens=8, request_id="b")
    engine.run()
    waits, skips = _fence_totals(engine)
    assert waits == 0 and skips > 0
    stats = engine.stats.data
    assert stats.get("fence_skips") == skips and "fence_waits" not in stats
    assert_quiescent(engine)


def _block_handed_over(engine: Any) -> None:
    """B (no full chunk in its prompt) and A (two chunks, stored at once and held) run; when B outgrows the seven
    blocks vLLM preempts A, the newest, and hands A's blocks to B, which writes them while A's stores may still read
    them. Then A's prompt again on an empty device cache: its two chunks load and every page is checked."""
    chunk = engine.connector.scheduler_half.chunk_tokens
    engine.add(prompt(130, seed=81), max_tokens=300, request_id="b")
    first = prompt(2 * chunk, seed=82)
    engine.add(first, max_tokens=200, request_id="a")
    engine.run(max_steps=3000)
    assert engine.requests["a"].num_preemptions, "B never took A's blocks"
    engine.evict_device_cache()
    engine.add(first + [7, 8], max_tokens=1, request_id="again")
    engine.run(max_steps=3000)
    assert engine.loaded_tokens["again"] == 2 * chunk


def test_a_fence_names_the_stores_of_a_block_handed_to_another_request(make_engine, lagging):
    """The step that hands A's chunk block to B waits for A's held store (counted); the chunk loads back exactly."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=8)
    harness = lagging(engine, lag=400)
    _block_handed_over(engine)
    waits, skips = _fence_totals(engine)
    assert waits > 0 and harness.fenced > 0 and skips > 0
    stats = engine.stats.data
    assert stats.get("fence_waits") == waits and stats.get("fenced_store_commands", 0) > 0
    assert "fence_unknown_steps" not in stats
    assert_quiescent(engine)


def test_without_the_fence_a_store_reads_the_block_after_another_request_wrote_it(make_engine, lagging):
    """Negative control: the same run where the named store reads only after the step's forward."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=8)
    lagging(engine, lag=400, unfenced=True)
    with pytest.raises(AssertionError, match="differ from the model's bytes"):
        _block_handed_over(engine)


# ---- the stores a step bound but never queued ---------------------------------------------------------------------

def _leftover_store(engine: Any, through_handle_preemptions: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step N binds a store of chunk 0 and the forward writes its pages, but N never reaches wait_for_save. Step N+1:
    the runner calls handle_preemptions (or not), vLLM's state update zeroes those blocks (they were handed to
    another request; the scheduler names the store), then start_load_kv. Returns (the leftover's stored bytes, a
    store of the forward's bytes made in order, a store of the zeroed pages)."""
    worker = engine.workers[0].worker_half
    layout, sim = worker.layout, engine.sims[0]
    chunk = layout.plan.chunk_tokens
    tokens_per_block = max(g.tokens_per_block for g in layout.groups)
    blocks = tuple(range(1, 1 + chunk // tokens_per_block))
    tables = [list(blocks)]
    window = BlockWindow((0,), (blocks,))
    hashes = prefix_hashes(prompt(chunk, seed=71))
    done: set[int] = set()

    def store(cmd_id: int, slot: int) -> LMCacheNPUConnectorMetadata:
        command = Store(cmd_id, ChunkKey("0" * 32, cmd_id.to_bytes(8, "little")), slot, "r", 0)
        return LMCacheNPUConnectorMetadata(stores=[StorePlan("r", (DeviceMove(command, window),), window)],
                                           fenced_stores=[])

    def zero_pages() -> None:
        for plane in layout.plan.planes:
            from lmcache_npu.ops.torch_backend import row_view

            row_view(plane)[list(blocks)] = 0

    def settle(cmd_id: int) -> None:
        for _ in range(6000):
            done.update(c.cmd_id for c in worker.executor.poll())
            if cmd_id in done:
                return
            threading.Event().wait(0.001)
        raise AssertionError(f"store {cmd_id} never completed")

    step_n = store(10_001, 0)
    worker.handle_preemptions(step_n)
    worker.start_load_kv(step_n)
    sim.forward(hashes, tables, 0, chunk)  # no wait_for_save: the step ended without one
    step_next = LMCacheNPUConnectorMetadata(fenced_stores=[10_001])
    if through_handle_preemptions:
        worker.handle_preemptions(step_next)
    zero_pages()  # vLLM's _update_states: new_block_ids_to_zero
    worker.start_load_kv(step_next)
    worker.wait_for_save()
    settle(10_001)
    for cmd_id, slot, write in ((10_002, 1, lambda: sim.forward(hashes, tables, 0, chunk)), (10_003, 2, zero_pages)):
        write()
        meta = store(cmd_id, slot)
        worker.handle_preemptions(meta)
        worker.start_load_kv(meta)
        worker.wait_for_save()
        settle(cmd_id)
    arena = worker.executor.arena
    return tuple(arena.slot(s).numpy().copy() for s in (0, 1, 2))  # type: ignore[return-value]


def test_stores_left_unqueued_by_a_step_read_that_steps_bytes(make_engine):
    engine = preset_engine(make_engine, "llama3-8b", "ascend")
    leftover, forward, zeros = _leftover_store(engine, through_handle_preemptions=True)
    assert not np.array_equal(forward, zeros)
    np.testing.assert_array_equal(leftover, forward)


def test_stores_left_unqueued_and_queued_after_vllms_state_update_read_its_writes(make_engine):
    """Negative control: a runner without handle_preemptions queues them in start_load_kv, after the zeroing."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend")
    leftover, forward, zeros = _leftover_store(engine, through_handle_preemptions=False)
    assert not np.array_equal(leftover, forward)
    np.testing.assert_array_equal(leftover, zeros)


# ---- what the scheduler counts as written -------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_row_the_model_writes_is_in_a_block_the_scheduler_counts(deepseek_v4_layout, data):
    """For random tables and steps, the blocks SimModel.forward (vLLM's write rule per group kind, the recurrent
    state in the last token's block) touches are among `_written_blocks`."""
    layout = deepseek_v4_layout
    block_tokens = _block_tokens(layout)
    num_sg = len(block_tokens)
    start = data.draw(st.integers(0, 4000))
    end = start + data.draw(st.integers(1, 600))
    tables = []
    for sg in range(num_sg):
        need = -(-end // max(block_tokens[sg], 1)) + data.draw(st.integers(0, 3))
        tables.append(data.draw(st.lists(st.integers(1, 10_000), min_size=need, max_size=need, unique=True)))
    counted = _counted((tables, start, block_tokens))
    touched = _touched(layout, tables, start, end)
    assert touched <= counted, f"written but not counted: {sorted(touched - counted)[:8]}"


def test_the_write_check_notices_a_rule_that_starts_one_block_late(deepseek_v4_layout):
    """Negative control of the check above: counting from the block after the first uncomputed token misses it."""
    layout = deepseek_v4_layout
    block_tokens = _block_tokens(layout)
    start = 3 * 128 + 5
    tables = [list(range(1000 * sg + 1, 1000 * sg + 200)) for sg in range(len(block_tokens))]
    late = [max(t // 2, 1) for t in block_tokens]  # a rule that thinks blocks are half as long skips written ones
    touched = _touched(layout, tables, start, start + 1)
    assert touched <= _counted((tables, start, block_tokens))
    assert not touched <= _counted((tables, start + max(block_tokens), block_tokens))
    assert not touched <= _counted((tables, start, late))


def _counted(args: tuple) -> set[int]:
    return {b for _, blocks in tail_blocks(*args) for b in blocks}


def _block_tokens(layout) -> list[int]:
    num_sg = max(g.scheduler_group for g in layout.groups) + 1
    block_tokens = [0] * num_sg
    for g in layout.groups:
        block_tokens[g.scheduler_group] = max(block_tokens[g.scheduler_group], g.tokens_per_block)
    return block_tokens


def _touched(layout, tables, start: int, end: int) -> set[int]:
    """Blocks SimModel.forward writes for tokens [start, end)."""
    touched: set[int] = set()
    for g in layout.groups:
        table = tables[g.scheduler_group]
        if g.recurrent:
            blocks, _, live = SimModel._locate(g, table, np.array([(end - 1) // g.tokens_per_block]))
        else:
            index = np.arange(start // g.compress_ratio, end // g.compress_ratio, dtype=np.int64)
            blocks, _, live = SimModel._locate(g, table, index)
        touched.update(int(b) for b in blocks[live])
    return touched


@pytest.fixture(scope="module")
def deepseek_v4_layout():
    from .engine import Engine, EngineSpec

    engine = Engine(EngineSpec(preset="deepseek-v4-flash", family="ascend", max_layers=6, num_blocks=600))
    try:
        yield engine.workers[0].worker_half.layout
    finally:
        engine.close()
