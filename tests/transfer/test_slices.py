"""Sliced loads (issue 41 item 2): the planner cuts a load into slices in forward order across every plan group, and
`KVMover.run_sliced` lands the same bytes as one unsliced load, each slice complete when it is marked; a planner that
puts a plane after the layer consuming it is caught before any launch."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.layout.discovery import KVLayout
from lmcache_npu.layout.slots import layout_slots
from lmcache_npu.layout.specs import SpecKind
from lmcache_npu.ops import Direction, PendingTransfer, get_backend
from lmcache_npu.ops.torch_backend import row_view
from lmcache_npu.store.commands import BlockWindow, DeviceMove, Load, Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.tools.bench.presets import block_tables, blocks_for
from lmcache_npu.tools.presets import get_model, preset_layout
from lmcache_npu.transfer import KVMover, StreamKit
from lmcache_npu.transfer.slices import SlicePlan, check_slice_order, layer_key, plan_slices, plane_consumers, window_ends

# hybrid and plain layouts: full attention, sliding window, MLA, DSA indexer, DeepSeek-V4 (compressed, SWA,
# compressor state), Gated DeltaNet states
PRESETS = [("llama3-8b", "ascend"), ("gemma3-27b", "ascend"), ("gpt-oss-120b", "cuda"), ("gpt-oss-120b", "ascend"), ("deepseek-v3", "cpu"),
           ("deepseek-v3.2-c8", "ascend"), ("deepseek-v4-flash", "ascend"), ("qwen3-next-80b", "ascend")]
MAX_LAYERS = 8  # the first layers keep each model's mix of layer kinds


class Case:
    """A preset trimmed to its first layers, pages for `chunks` chunks of one request, and random chunk objects."""

    def __init__(self, name: str, family: str, chunks: int, seed: int, chunk_tokens: Optional[int] = None) -> None:
        model = get_model(name, family, max_layers=MAX_LAYERS)
        probe, preset = preset_layout(model, family, chunk_tokens, num_blocks=2)
        needed = blocks_for(probe, preset.kv_cache_config, chunks)
        num_blocks = 1 + sum(needed)
        self.layout, self.preset = preset_layout(model, family, chunk_tokens, num_blocks=num_blocks, seed=seed)
        tables = block_tables(needed, num_blocks, torch.Generator().manual_seed(seed))
        self.slots = layout_slots(self.layout, tables, np.arange(chunks))
        self.window = BlockWindow(tuple(0 for _ in tables), tuple(tuple(int(b) for b in t) for t in tables))
        self.chunks, self.seed = chunks, seed
        generator = torch.Generator().manual_seed(seed + 1)
        self.objects = [torch.randint(0, 256, (self.layout.plan.object_bytes,), dtype=torch.uint8,
                                      generator=generator) for _ in range(chunks)]

    def scrub(self) -> None:
        """The pages before the load: the same random bytes each time."""
        generator = torch.Generator().manual_seed(self.seed + 2)
        for raw in self.preset.allocations:
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=generator).view(raw.dtype))

    def moves(self, first_token: int) -> list[DeviceMove]:
        end = self.chunks * self.layout.plan.chunk_tokens
        return [DeviceMove(Load(100 + c, ChunkKey("0" * 32, bytes([c]) * 8), c, "r", c), self.window, first_token,
                           end) for c in range(self.chunks)]

    def pages(self) -> list[torch.Tensor]:
        return [raw.clone() for raw in self.preset.allocations]

    def plane_rows(self) -> list[torch.Tensor]:
        """Each moved plane's rows at the request's chunk slots (planes of several groups may share one tensor, each
        in its own blocks: only its rows are its own)."""
        out = []
        for plane in self.layout.plan.moved_planes:
            flat = self.slots[plane.group].reshape(-1)
            flat = torch.from_numpy(flat[flat >= 0])
            out.append(row_view(plane)[flat // plane.rows_per_block, flat % plane.rows_per_block].clone())
        return out


def announced_layers(layout: KVLayout, dropped: Sequence[int] = ()) -> list[str]:
    """The layers whose attention calls the hooks, in forward order: every layer number with a plane outside a
    recurrent (mamba / Gated DeltaNet) group, as `model.layers.<n>.attn` (numbers in `dropped` never call them)."""
    numbers = {layer_key(layer) for g in layout.groups if g.kind != SpecKind.MAMBA for info in g.planes
               for layer in info.layers}
    kept = sorted(n for n in numbers if isinstance(n, int) and n not in dropped)
    return [f"model.layers.{n}.attn" for n in kept]


def mover_of(layout: KVLayout, backend: str) -> KVMover:
    return KVMover(layout, lambda: get_backend(backend), StreamKit, 0, 0, TierCounters())


def answers(expected: int) -> tuple[Any, threading.Event, list[Any]]:
    """A mover's `report`, an event set once `expected` commands were answered, and the answers."""
    done = threading.Event()
    results: list[Any] = []

    def report(cmd_id: int, result: Any) -> None:
        results.append(result)
        if len(results) == expected:
            done.set()

    return report, done, results


def unsliced(case: Case, mover: KVMover, first_token: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pages and each moved plane's pages after one plain load."""
    case.scrub()
    report, done, results = answers(case.chunks)
    mover.run(case.moves(first_token), case.objects, report)
    assert done.wait(120) and all(r.ok for r in results)
    return case.pages(), case.plane_rows()


def sliced_run(case: Case, mover: KVMover, slices: SlicePlan, first_token: int,
               expected_planes: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, list[str]]]]:
    """The pages after a sliced load, and per slice mark the planes that were wrong when it was marked: those of
    its own and earlier slices not yet equal to the plain load's, or those of later slices already changed."""
    case.scrub()
    scrubbed = case.plane_rows()
    owner = {i: piece.index for piece in slices.slices for i in piece.planes}
    planes = case.layout.plan.moved_planes
    marks: list[tuple[int, list[str]]] = []

    def on_slice_done(index: int, event: Optional[Any]) -> None:
        assert event is None  # the host: the slice's bytes are in the pages now
        now = case.plane_rows()
        wrong = [plane.label for i, plane in enumerate(planes)
                 if not torch.equal(now[i], expected_planes[i] if owner[i] <= index else scrubbed[i])]
        marks.append((index, wrong))

    report, done, results = answers(case.chunks)

    progress = mover.run_sliced(case.moves(first_token), case.objects, report, slices, on_slice_done)
    assert done.wait(120) and all(r.ok for r in results), [r.reason for r in results]
    assert progress.finished and not progress.failure
    for layer in slices.announced:
        assert progress.wait_for_layer(layer, timeout=0)  # marked: the host does not wait
    return case.pages(), marks


@settings(max_examples=25, deadline=None)
@given(preset=st.sampled_from(PRESETS), data=st.data(), chunks=st.integers(1, 3), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["host", "torch"]))
def test_sliced_load_lands_the_bytes_of_the_plain_load(preset: tuple[str, str], data: st.DataObject, chunks: int,
                                                       seed: int, backend: str) -> None:
    case = Case(*preset, chunks, seed)
    everyone = announced_layers(case.layout)
    dropped = data.draw(st.sets(st.sampled_from([layer_key(n) for n in everyone]), max_size=2), label="unannounced")
    announced = announced_layers(case.layout, tuple(dropped))
    count = data.draw(st.integers(1, max(1, min(8, len(announced)))), label="slices")
    chunk = case.layout.plan.chunk_tokens
    first_token = data.draw(st.sampled_from([0, chunk // 2, chunk]), label="first_token") if chunks > 1 else 0
    slices = plan_slices(case.layout, announced, count)
    mover = mover_of(case.layout, backend)
    launches: list[Any] = []
    try:
        expected, expected_planes = unsliced(case, mover, first_token)
        mover.set_backend(Direction.LOAD, _Counting(mover.backends[Direction.LOAD], launches))
        got, marks = sliced_run(case, mover, slices, first_token, expected_planes)
    finally:
        mover.close()
    assert [index for index, _ in marks] == list(range(len(slices)))
    assert len(launches) == sum(not piece.empty for piece in slices.slices)  # one launch per slice, not per layer
    assert all(not wrong for _, wrong in marks), marks
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the sliced load's bytes differ from the plain one's"
    flipped = [t.clone() for t in got]  # negative control: the comparison sees one wrong byte
    flipped[-1].view(torch.uint8).view(-1)[0] ^= 1
    assert not all(torch.equal(a, b) for a, b in zip(flipped, expected))


@pytest.mark.parametrize("name,family", [("deepseek-v4-flash", "ascend"), ("qwen3-next-80b", "ascend")])
def test_sliced_load_through_the_emulated_ascend_kernel(name: str, family: str) -> None:
    case = Case(name, family, 2, seed=5)
    announced = announced_layers(case.layout)
    slices = plan_slices(case.layout, announced, min(3, len(announced)))
    mover = KVMover(case.layout, lambda: get_backend("emu", soc="a2"), StreamKit, 0, 0, TierCounters())
    try:
        expected, expected_planes = unsliced(case, mover, 0)
        got, marks = sliced_run(case, mover, slices, 0, expected_planes)
    finally:
        mover.close()
    assert all(not wrong for _, wrong in marks), marks
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_deepseek_v4_layer_moves_every_cache_it_reads_in_one_slice() -> None:
    case = Case("deepseek-v4-flash", "ascend", 1, seed=1)
    announced = announced_layers(case.layout)
    slices = plan_slices(case.layout, announced, 4)
    planes = case.layout.plan.moved_planes
    by_layer: dict[Any, set[int]] = {}
    for piece in slices.slices:
        for i in piece.planes:
            by_layer.setdefault(layer_key(planes[i].name.split(":")[0]), set()).add(piece.index)
    assert all(len(found) == 1 for found in by_layer.values()), by_layer
    kinds = {piece.index: {planes[i].name.split(":")[0].rsplit(".", 1)[-1] for i in piece.planes}
             for piece in slices.slices}
    assert {"swa_cache", "state_cache", "k_cache"} <= set().union(*kinds.values())  # SWA, compressor, indexer
    assert slices.slices[0].layers == tuple(announced[:len(slices.slices[0].layers)])


def test_gated_deltanet_states_go_to_slice_zero() -> None:
    case = Case("qwen3-next-80b", "ascend", 1, seed=2)
    announced = announced_layers(case.layout)  # the full-attention layers only
    slices = plan_slices(case.layout, announced, 2)
    planes = case.layout.plan.moved_planes
    states = {i for i, p in enumerate(planes) if "linear_attn" in p.name}
    assert states and states <= set(slices.slices[0].planes)
    attention = [i for i in range(len(planes)) if i not in states]
    assert {i for i in attention if i not in slices.slices[0].planes}  # later attention layers ride later slices


def test_a_sliding_window_layer_moves_only_its_tail() -> None:
    case = Case("gpt-oss-120b", "cuda", 1, seed=3, chunk_tokens=256)  # a window of 128 tokens: half a chunk
    slices = plan_slices(case.layout, announced_layers(case.layout), 2)
    window_groups = [g for g in case.layout.groups if g.kind == SpecKind.SLIDING_WINDOW]
    assert window_groups and all(g.rows_per_chunk < case.layout.plan.chunk_tokens for g in window_groups)
    for piece in slices.slices:  # a slice's batch moves a windowed group's stored tail, never more rows
        for g in window_groups:
            assert piece.plan.rows_per_chunk[g.index] == g.rows_per_chunk


def test_window_ends_are_equal_windows_that_cover_every_layer() -> None:
    assert window_ends(61, 4) == [15, 30, 45, 61]
    assert window_ends(8, 8) == list(range(1, 9))
    assert window_ends(0, 1) == [0]
    for layers in range(1, 40):
        for count in range(1, min(layers, 8) + 1):
            ends = window_ends(layers, count)
            sizes = np.diff([0, *ends])
            assert ends[-1] == layers and (sizes >= 1).all() and sizes[0] == sizes.min()
            assert sizes.max() - sizes.min() <= 1, f"{layers} layers in {count}: windows {sizes} are not equal"
    with pytest.raises(ValueError, match="at least 1 slice"):
        window_ends(8, 0)
    with pytest.raises(ValueError, match="at least one layer's window"):
        window_ends(3, 4)


def _misplaced(slices: SlicePlan, layout: KVLayout) -> tuple[SlicePlan, str]:
    """The negative control: one plane a slice-0 layer consumes, moved to the last slice."""
    consumers = plane_consumers(layout, slices.announced)
    moved = next(i for i in slices.slices[0].planes if consumers[i] is not None)
    return dataclasses.replace(slices, slices=_moved_plane(slices.slices, layout, moved, 0, len(slices) - 1)), \
        layout.plan.moved_planes[moved].label


def _moved_plane(pieces: Sequence[Any], layout: KVLayout, plane: int, source: int, target: int) -> tuple[Any, ...]:
    """The slices with `plane` taken from slice `source` into slice `target` (their batch plans rebuilt to match)."""
    out = list(pieces)
    for index, planes in ((source, [i for i in pieces[source].planes if i != plane]),
                          (target, sorted((*pieces[target].planes, plane)))):
        out[index] = dataclasses.replace(pieces[index], planes=tuple(planes), plan=layout.plan.plane_subset(planes))
    return tuple(out)


@pytest.mark.parametrize("name,family", PRESETS)
def test_a_plane_sliced_after_its_layer_is_caught_before_any_launch(name: str, family: str) -> None:
    case = Case(name, family, 1, seed=4)
    announced = announced_layers(case.layout)
    slices = plan_slices(case.layout, announced, min(3, len(announced)))
    check_slice_order(slices, case.layout)  # the planner's own slices pass
    bad, label = _misplaced(slices, case.layout)
    with pytest.raises(ValueError, match="at or before that layer's window") as caught:
        check_slice_order(bad, case.layout)
    assert label in str(caught.value)
    launches: list[Any] = []
    mover = mover_of(case.layout, "host")
    mover.set_backend(Direction.LOAD, _Counting(mover.backends[Direction.LOAD], launches))
    try:
        with pytest.raises(ValueError, match="at or before that layer's window"):
            mover.run_sliced(case.moves(0), case.objects, lambda *a: launches.append(a), bad)
    finally:
        mover.close()
    assert launches == []  # nothing launched, nothing reported


def test_unannounced_plane_outside_slice_zero_and_lost_planes_are_caught() -> None:
    case = Case("qwen3-next-80b", "ascend", 1, seed=6)
    slices = plan_slices(case.layout, announced_layers(case.layout), 2)
    consumers = plane_consumers(case.layout, slices.announced)
    state = next(i for i in slices.slices[0].planes if consumers[i] is None)
    pieces = _moved_plane(slices.slices, case.layout, state, 0, 1)
    with pytest.raises(ValueError, match="must land before the forward"):
        check_slice_order(dataclasses.replace(slices, slices=pieces), case.layout)
    with pytest.raises(ValueError, match="in no slice"):
        check_slice_order(dataclasses.replace(slices, slices=(pieces[0], slices.slices[1])), case.layout)
    stale_plan = dataclasses.replace(pieces[0], plan=slices.slices[0].plan)  # names one plane, its batch moves it
    with pytest.raises(ValueError, match="other planes than the slice names"):
        check_slice_order(dataclasses.replace(slices, slices=(stale_plan, pieces[1])), case.layout)


class _Counting:
    """A backend that records every launch."""

    def __init__(self, inner: Any, launches: list[Any]) -> None:
        self.inner, self.launches, self.name = inner, launches, inner.name

    def prepare(self, plan: Any) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: Any, after_kernel: Any = None) -> Any:
        self.launches.append(batch)
        return self.inner.transfer(batch, after_kernel)


class _FailingSecondLaunch(_Counting):
    """A device fault on the second launch of every load."""

    def transfer(self, batch: Any, after_kernel: Any = None) -> Any:
        self.launches.append(batch)
        if len(self.launches) == 2:
            raise RuntimeError("device fault in slice 1")
        return self.inner.transfer(batch, after_kernel)


def test_a_failed_slice_fails_the_load_and_releases_every_waiter() -> None:
    case = Case("llama3-8b", "ascend", 1, seed=8)
    slices = plan_slices(case.layout, announced_layers(case.layout), 3)
    launches: list[Any] = []
    mover = mover_of(case.layout, "host")
    mover.set_backend(Direction.LOAD, _FailingSecondLaunch(mover.backends[Direction.LOAD], launches))
    done, results = threading.Event(), []

    def report(cmd_id: int, result: Any) -> None:
        results.append(result)
        done.set()

    try:
        progress = mover.run_sliced(case.moves(0), case.objects, report, slices)
        assert done.wait(60)
        assert progress.finished and "device fault" in progress.failure
        assert not progress.wait_for_slice(0, timeout=0) and not progress.wait_for_layer("model.layers.9.attn", 0)
        assert len(results) == 1 and not results[0].ok and "device fault" in results[0].reason
        with pytest.raises(ValueError, match="loads only"):
            store = DeviceMove(Store(7, ChunkKey("0" * 32, bytes(8)), 0, "r", 0), case.window)
            mover.run_sliced([store], case.objects, report, slices)
        with pytest.raises(ValueError, match="does not exist"):
            progress.wait_for_slice(len(slices))
    finally:
        mover.close()
    assert len(launches) == 2  # slice 2 never launched after slice 1 failed


class _AllSlicesInOneCall(_Counting):
    """A host backend with `launch_sliced`, as the CUDA backend's: every slice of the call lands before it returns."""

    def __init__(self, inner: Any, launches: list[Any], calls: list[tuple[Any, list[int], int]]) -> None:
        super().__init__(inner, launches)
        self.calls = calls
        self.threads: list[threading.Thread] = []

    def launch_sliced(self, batch: Any, plane_slices: Any, count: int, after_kernel: Any = None) -> Any:
        self.calls.append((batch.plan, [int(k) for k in plane_slices], count))
        self.threads.append(threading.current_thread())
        stats = [self.inner.transfer(batch.for_plan(batch.plan.plane_subset(
            [i for i, k in enumerate(plane_slices) if k == s])), after_kernel) for s in range(count)
            if any(k == s for k in plane_slices)]
        merged = dataclasses.replace(stats[0], payload_bytes=sum(s.payload_bytes for s in stats))
        return SimpleNamespace(pending=PendingTransfer(lambda: merged, asynchronous=False), events=(None,) * count)


@pytest.mark.parametrize("name,family,count", [("llama3-8b", "ascend", 4), ("deepseek-v4-flash", "ascend", 3),
                                               ("qwen3-next-80b", "ascend", 2), ("llama3-8b", "ascend", 1)])
def test_a_backend_that_launches_every_slice_in_one_call_gets_the_whole_load(name: str, family: str,
                                                                             count: int) -> None:
    case = Case(name, family, 2, seed=11)
    slices = plan_slices(case.layout, announced_layers(case.layout), count)
    mover = mover_of(case.layout, "host")
    calls: list[tuple[Any, list[int], int]] = []
    try:
        expected, _ = unsliced(case, mover, 0)
        one_call = _AllSlicesInOneCall(mover.backends[Direction.LOAD], [], calls)
        mover.set_backend(Direction.LOAD, one_call)
        case.scrub()
        marked: list[int] = []
        report, done, results = answers(case.chunks)
        mover.run_sliced(case.moves(0), case.objects, report, slices, lambda index, event: marked.append(index))
        assert marked == list(range(count)), "run_sliced returned before every slice was enqueued"
        assert one_call.threads == [threading.current_thread()], "the one call was made on another thread"
        assert done.wait(120) and all(r.ok for r in results), [r.reason for r in results]
        got = case.pages()
    finally:
        mover.close()
    assert marked == list(range(count))
    owner = {i: piece.index for piece in slices.slices for i in piece.planes}
    assert len(calls) == 1 and calls[0][0] is case.layout.plan and calls[0][2] == count
    assert calls[0][1] == [owner[i] for i in range(len(case.layout.plan.moved_planes))], "a plane in another slice"
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the one call's bytes differ from the plain load's"
    flipped = [t.clone() for t in got]  # negative control: the comparison sees one wrong byte
    flipped[0].view(torch.uint8).view(-1)[0] ^= 1
    assert not all(torch.equal(a, b) for a, b in zip(flipped, expected))


class _OneCallThatFails(_AllSlicesInOneCall):
    def launch_sliced(self, batch: Any, plane_slices: Any, count: int, after_kernel: Any = None) -> Any:
        self.calls.append((batch.plan, [int(k) for k in plane_slices], count))
        raise RuntimeError("device fault while enqueueing")


def test_a_one_call_launch_that_fails_on_the_callers_thread_is_reported_never_raised() -> None:
    case = Case("llama3-8b", "ascend", 2, seed=12)
    slices = plan_slices(case.layout, announced_layers(case.layout), 3)
    mover = mover_of(case.layout, "host")
    calls: list[tuple[Any, list[int], int]] = []
    try:
        mover.set_backend(Direction.LOAD, _OneCallThatFails(mover.backends[Direction.LOAD], [], calls))
        report, done, results = answers(case.chunks)
        progress = mover.run_sliced(case.moves(0), case.objects, report, slices)
        assert done.wait(120) and results and not any(r.ok for r in results), "a failed launch was reported loaded"
        assert "device fault" in progress.failure
        assert not progress.wait_for_slice(0, 1.0), "a waiter was let through a failed load"
        assert len(calls) == 1 + mover.load_retries, "a failed launch is retried like any load"
    finally:
        mover.close()


def test_a_slice_callback_that_raises_fails_the_load_and_finishes_what_launched() -> None:
    case = Case("llama3-8b", "ascend", 2, seed=13)
    slices = plan_slices(case.layout, announced_layers(case.layout), 3)
    mover = mover_of(case.layout, "host")
    calls: list[tuple[Any, list[int], int]] = []
    finished: list[int] = []
    try:
        one_call = _AllSlicesInOneCall(mover.backends[Direction.LOAD], [], calls)
        inner = one_call.launch_sliced

        def counted(*args: Any, **kwargs: Any) -> Any:
            launched = inner(*args, **kwargs)
            finish = launched.pending.finish
            launched.pending = PendingTransfer(lambda: (finished.append(1), finish())[1], asynchronous=False)
            return launched

        one_call.launch_sliced = counted  # type: ignore[method-assign]
        mover.set_backend(Direction.LOAD, one_call)

        def broken(index: int, event: Any) -> None:
            raise RuntimeError("a slice callback bug")

        report, done, results = answers(case.chunks)
        progress = mover.run_sliced(case.moves(0), case.objects, report, slices, broken)
        assert done.wait(120) and results and not any(r.ok for r in results), "a load whose marking broke was served"
        assert "slice callback bug" in progress.failure
        assert finished, "the launched load was never finished: its buffers would stay taken"
    finally:
        mover.close()
