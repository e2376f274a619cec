"""Plane-subset plans (a sliced load's slices, per-slice stores) through the CUDA backend: a subset store writes its
planes' segments and no byte of another plane, and subset loads launched back to back (each returning once enqueued,
none finished before the last is launched) land what the whole plan's load would, touching no other plane."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction, get_backend

from ..ops.strategies import Case, cases
from .cuda_marks import CUDA_KERNELS
from .test_cuda import to_cuda

pytestmark = CUDA_KERNELS


def _segments(plan, indices):
    return [(plan.object_offsets[i], plan.rows_per_chunk[p.group] * p.row_bytes)
            for i, p in enumerate(plan.moved_planes) if i in indices]


def _random_objects(count: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).pin_memory() for _ in range(count)]


@settings(max_examples=40, deadline=None)
@given(case=cases(soc="a2"), path=st.sampled_from(["staging", "mapped"]), pipeline=st.booleans())
def test_subset_stores_and_back_to_back_subset_loads_are_byte_exact(case: Case, path: str, pipeline: bool) -> None:
    case = to_cuda(case)
    plan = case.geometry.plan()
    n = len(plan.moved_planes)
    if n < 2:
        return
    backend = get_backend("cuda", path=path, pipeline=pipeline, load_tail_bytes=100, load_tail_share=3)
    backend.prepare(plan)
    nbytes = plan.object_bytes
    whole = _random_objects(case.num_chunks, nbytes, case.seed)
    backend.transfer(ChunkBatch.build(plan, case.slots, whole, Direction.STORE))
    chosen = [i for i in range(n) if i % 2 == 0]
    subset = plan.plane_subset(chosen)
    backend.prepare(subset)
    partial = _random_objects(case.num_chunks, nbytes, case.seed + 1)
    before = [o.clone() for o in partial]
    backend.transfer(ChunkBatch.build(subset, case.slots, partial, Direction.STORE))
    for c in range(case.num_chunks):
        for offset, length in _segments(plan, chosen):
            assert torch.equal(partial[c][offset: offset + length], whole[c][offset: offset + length])
        for offset, length in _segments(plan, [i for i in range(n) if i not in chosen]):
            assert torch.equal(partial[c][offset: offset + length], before[c][offset: offset + length]), \
                "a subset store wrote bytes of a plane outside the subset"
    for raw in case.geometry.raw_planes:  # scrub the pages: the loads must write every row back
        raw.raw.copy_(torch.randint(0, 256, raw.raw.shape, dtype=torch.uint8, device=raw.raw.device))
    full_batch = ChunkBatch.build(plan, case.slots, whole, Direction.LOAD)
    singles = [plan.plane_subset([i]) for i in range(n)]
    for single in singles:
        backend.prepare(single)
    pending = [backend.launch(full_batch.for_plan(single)) for single in singles]
    assert all(p.asynchronous for p in pending)
    for p in pending:
        p.finish()
    again = _random_objects(case.num_chunks, nbytes, case.seed + 2)
    backend.transfer(ChunkBatch.build(plan, case.slots, again, Direction.STORE))
    for c in range(case.num_chunks):
        for offset, length in _segments(plan, range(n)):
            assert torch.equal(again[c][offset: offset + length], whole[c][offset: offset + length]), \
                "back-to-back subset loads did not land the whole plan's bytes"


def _store_planes(plan, planes, slots, nbytes: int, count: int, seed: int) -> list[torch.Tensor]:
    """The pages' bytes of `planes` as a fresh backend stores them (its own staging: a load may still be in flight
    on the first backend's)."""
    checker = get_backend("cuda")
    subset = plan.plane_subset(sorted(planes))
    checker.prepare(subset)
    out = _random_objects(count, nbytes, seed)
    checker.transfer(ChunkBatch.build(subset, slots, out, Direction.STORE))
    return out


@settings(max_examples=40, deadline=None)
@given(case=cases(soc="a2"), path=st.sampled_from(["staging", "mapped"]), ahead=st.booleans(), data=st.data())
def test_a_sliced_load_in_one_call_lands_each_slice_by_its_event(case: Case, path: str, ahead: bool, data) -> None:
    case = to_cuda(case)
    plan = case.geometry.plan()
    n = len(plan.moved_planes)
    count = data.draw(st.integers(1, 5), label="slices")
    plane_slice = np.array(data.draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n), label="planes"))
    backend = get_backend("cuda", path=path)
    backend.prepare(plan)
    nbytes = plan.object_bytes
    whole = _random_objects(case.num_chunks, nbytes, case.seed)
    backend.transfer(ChunkBatch.build(plan, case.slots, whole, Direction.STORE))
    # staging then holds other bytes: a slice whose copies were skipped but never made would land those
    other = _random_objects(case.num_chunks, nbytes, case.seed + 5)
    backend.transfer(ChunkBatch.build(plan, case.slots, other, Direction.LOAD))
    for raw in case.geometry.raw_planes:  # scrub the pages: the load must write every row back
        raw.raw.copy_(torch.randint(0, 256, raw.raw.shape, dtype=torch.uint8, device=raw.raw.device))
    verdicts = _spied_fits(backend)
    copied = backend.copy_ahead(plan, plane_slice, whole) if ahead else None  # slice 0's copies before its plan
    if ahead:
        assert (copied is not None) == (path == "staging" and any(
            length for offset, length in _segments(plan, [i for i in range(n) if plane_slice[i] == 0]))), \
            "slice 0 was copied ahead off the staging path, or not copied ahead on it"
    launched = backend.launch_sliced(ChunkBatch.build(plan, case.slots, whole, Direction.LOAD), plane_slice, count,
                                     ahead=copied)
    assert verdicts == ([True] if copied is not None else []), "a copy ahead that fits was not used"
    if copied is not None:
        copied.release()  # taken by the launch: a no-op
    assert len(launched.events) == count
    for k in range(count):
        launched.events[k].synchronize()
        assert all(launched.events[j].query() for j in range(k)), "a slice's event completed before an earlier one"
        landed = [i for i in range(n) if plane_slice[i] <= k]
        if not landed:
            continue
        got = _store_planes(plan, landed, case.slots, nbytes, case.num_chunks, case.seed + 10 + k)
        for c in range(case.num_chunks):
            for offset, length in _segments(plan, landed):
                assert torch.equal(got[c][offset: offset + length], whole[c][offset: offset + length]), \
                    f"slice {k}'s event completed before the bytes of its planes were in the pages"
    stats = launched.pending.finish()
    assert stats.payload_bytes == ChunkBatch.build(plan, case.slots, whole, Direction.LOAD).payload_bytes
    again = _store_planes(plan, range(n), case.slots, nbytes, case.num_chunks, case.seed + 2)
    segments = _segments(plan, range(n))
    mismatch = lambda objs: any(  # noqa: E731
        not torch.equal(objs[c][o: o + m], whole[c][o: o + m]) for c in range(case.num_chunks) for o, m in segments)
    assert not mismatch(again), "the sliced load did not land the whole plan's bytes"
    if segments and any(m for _, m in segments):  # negative control: the comparison notices one wrong byte
        offset, length = next((o, m) for o, m in segments if m)
        again[0][offset + length // 2] ^= 0xFF
        assert mismatch(again)


def test_a_sliced_load_refuses_a_plane_outside_its_slices_before_any_launch() -> None:
    from hypothesis import find

    case = to_cuda(find(cases(soc="a2"), lambda c: len(c.geometry.plan().moved_planes) >= 2))
    plan = case.geometry.plan()
    backend = get_backend("cuda")
    backend.prepare(plan)
    objects = _random_objects(case.num_chunks, plan.object_bytes, 3)
    before = [raw.raw.clone() for raw in case.geometry.raw_planes]
    bad = np.zeros(len(plan.moved_planes), dtype=np.int64)
    bad[-1] = 2
    try:
        backend.launch_sliced(ChunkBatch.build(plan, case.slots, objects, Direction.LOAD), bad, 2)
    except ValueError as exc:
        assert "outside the load's 2 slices" in str(exc) and plan.moved_planes[-1].label in str(exc)
    else:
        raise AssertionError("a plane in slice 2 of 2 was accepted")
    torch.cuda.synchronize()
    assert all(torch.equal(a, raw.raw) for a, raw in zip(before, case.geometry.raw_planes)), "pages were touched"


def _spied_fits(backend) -> list[bool]:
    """Every verdict the backend's `_ahead_fits` gives from now on (whether a launch skips slice 0's copies)."""
    verdicts: list[bool] = []
    fits = backend._ahead_fits

    def spied(*args) -> bool:
        verdicts.append(fits(*args))
        return verdicts[-1]

    backend._ahead_fits = spied
    return verdicts


class _CopiesNothingAhead:
    """The CUDA module with a copy ahead that records its events but enqueues no copy."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def copy_ahead(self, stream, first, copied, staging, object_bytes, addresses, segments) -> None:
        self._inner.copy_ahead(stream, first, copied, staging, object_bytes, addresses, [])

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _sliced_load_with_a_copy_ahead(overtaken: bool, trust_every_ahead: bool = False, copy_nothing: bool = False,
                                   launch_stream: Optional[torch.cuda.Stream] = None) -> tuple[list[bool], str]:
    """Objects B loaded plainly (staging then holds B), slice 0 copied ahead for objects A, where `overtaken` another
    plain load of B (it claims staging and fills it with B again), then A's sliced load with A's copy ahead. Returns
    the launch's verdicts on the copy ahead and the chunk planes whose pages do not hold A's bytes afterwards.
    `trust_every_ahead`: every copy ahead is taken to fit; `copy_nothing`: the copy ahead enqueues no copy (both
    negative controls); `launch_stream`: the sliced load is launched there, not on the copy ahead's stream."""
    from hypothesis import find

    case = to_cuda(find(cases(soc="a2"), lambda c: len(c.geometry.plan().moved_planes) >= 2 and c.num_chunks >= 1))
    plan = case.geometry.plan()
    n = len(plan.moved_planes)
    plane_slice = np.array([0] + [1] * (n - 1))
    # the plain loads stage every byte of B (no mapped share the kernel would read from B's objects instead)
    backend = get_backend("cuda", path="staging", pipeline=False, load_mapped_prefix_share=0)
    backend.prepare(plan)
    first = _random_objects(case.num_chunks, plan.object_bytes, 31)
    other = _random_objects(case.num_chunks, plan.object_bytes, 32)
    backend.transfer(ChunkBatch.build(plan, case.slots, other, Direction.LOAD))
    if copy_nothing:
        backend._cuda = _CopiesNothingAhead(backend._cuda)
    verdicts = _spied_fits(backend)
    if trust_every_ahead:
        backend._ahead_fits = lambda *args: verdicts.append(True) or True
    copied = backend.copy_ahead(plan, plane_slice, first)
    assert copied is not None
    if overtaken:
        backend.transfer(ChunkBatch.build(plan, case.slots, other, Direction.LOAD))
    with torch.cuda.stream(launch_stream or torch.cuda.current_stream()):
        launched = backend.launch_sliced(ChunkBatch.build(plan, case.slots, first, Direction.LOAD), plane_slice, 2,
                                         ahead=copied)
        launched.pending.finish()
    copied.release()
    got = _store_planes(plan, range(n), case.slots, plan.object_bytes, case.num_chunks, 33)
    wrong = [f"chunk {c} plane {plan.moved_planes[i].label}" for c in range(case.num_chunks)
             for i, (offset, length) in enumerate(_segments(plan, range(n)))
             if not torch.equal(got[c][offset: offset + length], first[c][offset: offset + length])]
    return verdicts, ", ".join(wrong)


@pytest.mark.parametrize("overtaken,control", [(False, {"copy_nothing": True}), (True, {"trust_every_ahead": True})],
                         ids=["a fitting copy ahead is used", "an overtaken copy ahead is copied again"])
def test_a_copy_ahead_is_used_only_while_staging_holds_it(overtaken: bool, control: dict) -> None:
    verdicts, wrong = _sliced_load_with_a_copy_ahead(overtaken=overtaken)
    assert verdicts == [not overtaken], "a fitting copy ahead was copied again, or an overtaken one was trusted"
    assert not wrong, f"slice 0 landed bytes other than its own: {wrong}"
    # negative control: a copy ahead that copied nothing, or an overtaken one trusted, serves the other load's slice 0
    verdicts, wrong = _sliced_load_with_a_copy_ahead(overtaken=overtaken, **control)
    assert verdicts == [True] and "plane" in wrong


def test_a_copy_ahead_on_another_stream_is_not_trusted() -> None:
    verdicts, wrong = _sliced_load_with_a_copy_ahead(overtaken=False, launch_stream=torch.cuda.Stream())
    assert verdicts == [], "a copy ahead on another stream was weighed as if it were ordered before the launch"
    assert not wrong, f"slice 0 did not land: {wrong}"


def _sleep_ms(cycles: int) -> float:
    """How long `torch.cuda._sleep(cycles)` keeps the current stream busy."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _ahead_case(seed: int) -> tuple[Case, object, list[torch.Tensor]]:
    """A small case with two planes or more, a staging-path backend prepared for its plan, and random objects."""
    from hypothesis import find

    case = to_cuda(find(cases(soc="a2"), lambda c: len(c.geometry.plan().moved_planes) >= 2))
    backend = get_backend("cuda", path="staging")
    backend.prepare(case.geometry.plan())
    return case, backend, _random_objects(case.num_chunks, case.geometry.plan().object_bytes, seed)


def test_a_copied_ahead_load_reports_the_move_alone() -> None:
    from lmcache_npu.ops.cuda.native import TransferEvent

    case, backend, objects = _ahead_case(51)
    plan = case.geometry.plan()
    plane_slice = np.array([0] + [1] * (len(plan.moved_planes) - 1))
    cycles = 100_000_000
    slept = _sleep_ms(cycles)
    copied = backend.copy_ahead(plan, plane_slice, objects)
    torch.cuda._sleep(cycles)  # the load's turn comes this much after its copies ahead (a busy model stream)
    launched = backend.launch_sliced(ChunkBatch.build(plan, case.slots, objects, Direction.LOAD), plane_slice, 2,
                                     ahead=copied)
    stats = launched.pending.finish()
    copied.release()
    window = backend._last_state.elapsed_ms(TransferEvent.FIRST, TransferEvent.LAST)
    assert window > 0.8 * slept, "the sleep was not inside the load's window: the check below could not fail"
    assert stats.device_seconds * 1e3 < window - 0.8 * slept, "the wait for the load's turn was counted as moving"


def test_a_copy_ahead_no_launch_took_is_waited_for_before_its_record_is_reused() -> None:
    case, backend, objects = _ahead_case(41)
    plan = case.geometry.plan()
    plane_slice = np.zeros(len(plan.moved_planes), dtype=np.int64)
    from lmcache_npu.ops.cuda.native import TransferEvent

    backend.copy_ahead(plan, plane_slice, objects).release()  # staging sized: the next claim synchronizes nothing
    spares = len(backend._spares)
    torch.cuda._sleep(100_000_000)  # the stream is busy for tens of ms: the copies ahead are still queued behind it
    copied = backend.copy_ahead(plan, plane_slice, objects)
    assert copied is not None and len(backend._spares) == spares - 1, "the copy ahead did not hold a record"
    copies_done = copied._state.events[TransferEvent.COPIES_DONE]
    assert not backend._cuda.event_query(copies_done), "the copies ahead already ran: the check below could not fail"
    copied.release()
    assert len(backend._spares) == spares, "a copy ahead no launch took kept its record"
    assert backend._cuda.event_query(copies_done), \
        "the record went back while its copies ahead could still read the objects"
    copied.release()  # idempotent
    assert len(backend._spares) == spares
    assert backend.copy_ahead(plan, plane_slice, [o[:-1] for o in objects]) is None, "short objects were read"
