"""Slice-pipelined synchronous loads (issue 41): how close a load cut into S slices (`plan_slices`,
`KVMover.run_sliced`) comes to hiding behind a forward that waits per layer on the device (`SlicedLoad`).

A synthetic forward of a geometry's L attention layers (per layer: `wait_for_layer`, then a chain of matmuls on the
model's stream) runs while the real load lane lands the slices. Per load size, compute size and S it reports the
achieved TTFT (model stream, before `run_sliced` to after the last layer) against the ideal
`max(T_load, T_compute) + T_slice0`, and the compute slowdown while slices land. It also runs the forward beside a
bare torch copy of the load's bytes (`BareCopy`: no plugin, no waits) and reports the achieved TTFT against
`max(T_load, T_copy) + T_slice0`, the overlap the hardware allows: a host-to-device copy slows the forward beside it
(17-22 % on the H200), so no load of those bytes can reach the first ideal near ratio 1. Each repeat runs the three
kinds back to back (alone, beside the copy, sliced) so that all see the same GPU clocks.

Stores (issue 41 item 6): the same chunks stored after the forward as one transfer against S plane-subset stores, each
queued once its window's layers ran, on a store lane like the mover's; it reports the store's tail after the forward
and the compute slowdown.

    python -m lmcache_npu.tools.bench.studies.layer_pipeline --json layer_pipeline.json \
        --geometry lmcache_npu/tools/bench/geometries/llama3-8b.json \
        lmcache_npu/tools/bench/geometries/cuda/deepseek-v3.json
    python -m lmcache_npu.tools.bench.studies.layer_pipeline --plot layer_pipeline.json --png layer_pipeline.png

Results and what they show: docs/performance.md, "Slice-pipelined loads: the layer_pipeline study (H200)".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from lmcache_npu.layout.discovery import KVLayout, PlaneInfo
from lmcache_npu.layout.slots import layout_slots
from lmcache_npu.ops import ChunkBatch, Direction, TransferPlan, get_backend
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.commands import DeviceMove, Load
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.tools.bench.connector_path import REQUEST, _geometry_request, _window
from lmcache_npu.tools.bench.cuda_baselines import queue_gpu_work
from lmcache_npu.tools.bench.geometry import Geometry, load_geometry
from lmcache_npu.transfer import KVMover, StreamKit
from lmcache_npu.transfer.pipeline import build_worker_pipeline
from lmcache_npu.transfer.slice_progress import SlicedLoad
from lmcache_npu.transfer.slices import SlicePlan, layer_key, plan_slices

RATIOS = (0.1, 0.3, 1.0, 3.0, 10.0)  # T_load / T_compute
COUNTS = ("1", "2", "4", "8", "L")  # slices per load; L: one per announced layer
TARGET = 0.05  # issue 41: TTFT within 5% of the ideal overlap, compute slowdown <= 5%
WAIT_SECONDS = 60.0  # a slice never launched within this is a failure, not a hang


# ---- timing on the model's stream (CUDA events) or the host's clock ------------------------------------------------

class Clock:
    """Marks on the current stream (CUDA timing events) or host time stamps (CPU: the host is the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin: Any, end: Any) -> float:
        return begin.elapsed_time(end) / 1e3 if self.cuda else end - begin

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def ideal_seconds(t_load: float, t_compute: float, t_slice0: float) -> float:
    """Issue 41's bound: the longer of load and compute, plus the first slice the forward cannot start without."""
    return max(t_load, t_compute) + t_slice0


def over_ideal(achieved: float, ideal: float) -> float:
    """achieved / ideal - 1 (0.05: 5% slower than the ideal overlap)."""
    return achieved / ideal - 1.0


def slowdown(loaded: Sequence[float], alone: Sequence[float]) -> float:
    """The forward's layer time while transfers run against alone (sums per run, medians over runs), minus one."""
    return statistics.median(loaded) / statistics.median(alone) - 1.0


# ---- the request: pages, arena objects, moves, announced layers ----------------------------------------------------

def with_plane_layers(layout: KVLayout) -> KVLayout:
    """A geometry's layout with each plane's consuming layer (`model.layers.<n>...` from the plane's label), which
    `plan_slices` needs; connector_path's layout leaves the plane infos out."""
    groups = []
    for group in layout.groups:
        infos = [PlaneInfo(p.name, (p.name.split(":")[0],), 0, str(p.dtype), p.row_bytes, p.block_stride_bytes,
                           str(p.layout)) for p in layout.plan.moved_planes if p.group == group.index]
        layers = tuple(dict.fromkeys(info.layers[0] for info in infos))
        groups.append(dataclasses.replace(group, planes=tuple(infos), layers=layers))
    return dataclasses.replace(layout, groups=tuple(groups))


def announced_layers(layout: KVLayout) -> tuple[str, ...]:
    """The attention layers in forward order (layer number), one name each, as they would call the hook."""
    names = {layer_key(info.layers[0]): info.layers[0] for g in layout.groups for info in g.planes}
    numbered = sorted(k for k in names if isinstance(k, int))
    return tuple(names[k] for k in numbered) + tuple(names[k] for k in names if not isinstance(k, int))


@dataclass
class Case:
    """One request of `chunks` chunks of a geometry on a worker's pipeline: loads from arena slots [0, chunks),
    stores into [chunks, 2 chunks)."""

    layout: KVLayout
    slots: list[Optional[np.ndarray]]
    allocations: list[torch.Tensor]
    mover: KVMover
    loads: list[DeviceMove]
    load_objects: list[torch.Tensor]
    store_objects: list[torch.Tensor]
    announced: tuple[str, ...]

    @property
    def chunks(self) -> int:
        return len(self.loads)


class OneLaunchPerSlice:
    """A backend without `launch_sliced`: the mover then launches a sliced load one slice at a time (the study's
    `--launch per-slice`, what every backend but CUDA does)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name

    def prepare(self, plan: TransferPlan) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: ChunkBatch, after_kernel: Any = None) -> Any:
        return self.inner.transfer(batch, after_kernel)

    def launch(self, batch: ChunkBatch, after_kernel: Any = None) -> Any:
        return self.inner.launch(batch, after_kernel)


@contextlib.contextmanager
def open_case(geometry: Geometry, chunks: int, backend_name: str, seed: int = 0,
              options: Optional[dict[str, Any]] = None, per_slice: bool = False) -> Iterator[Case]:
    """The worker's pipeline (lanes, registered arena) built as the connector builds it, around one request;
    `per_slice`: its load lane launches a sliced load one slice at a time."""
    device = torch.device("cuda" if backend_name == "cuda" else "cpu")
    layout, tables, allocations = _geometry_request(geometry, chunks, device, seed)
    layout = with_plane_layers(layout)
    plan = layout.plan
    store = StoreConfig(cpu_bytes=2 * chunks * slot_bytes_for(plan.object_bytes), pinned=device.type != "cpu")
    pipeline = build_worker_pipeline(layout, store, 0, lambda: get_backend(backend_name, **(options or {})),
                                     TierCounters())
    if per_slice:
        pipeline.mover.set_backend(Direction.LOAD, OneLaunchPerSlice(pipeline.mover.backends[Direction.LOAD]))
    try:
        arena = pipeline.arena
        generator = torch.Generator().manual_seed(seed + 2)
        for i in range(chunks):  # the stored chunks the load reads: random bytes
            arena.slot(i).copy_(torch.randint(0, 256, (plan.object_bytes,), dtype=torch.uint8, generator=generator))
        window = _window(layout, tables, chunks)
        loads = [DeviceMove(Load(1 + i, ChunkKey(REQUEST, i.to_bytes(8, "little")), i, REQUEST, i), window, 0,
                            chunks * plan.chunk_tokens) for i in range(chunks)]
        yield Case(layout, layout_slots(layout, tables, np.arange(chunks)), allocations, pipeline.mover, loads,
                   [arena.slot(i) for i in range(chunks)], [arena.slot(chunks + i) for i in range(chunks)],
                   announced_layers(layout))
    finally:
        pipeline.close()
        pipeline.arena.close()


# ---- the synthetic forward -----------------------------------------------------------------------------------------

class Work:
    """One layer's compute: `reps` matmuls (m x k) @ (k x k) on the current stream."""

    def __init__(self, device: torch.device, m: int, k: int, reps: int) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(m, k, device=device, dtype=dtype)
        self.w = torch.randn(k, k, device=device, dtype=dtype) / math.sqrt(k)
        self.out = torch.empty(m, k, device=device, dtype=dtype)
        self.m, self.k, self.reps = m, k, reps

    def __call__(self) -> None:
        for _ in range(self.reps):
            torch.matmul(self.a, self.w, out=self.out)


def unit_seconds(device: torch.device, m: int, k: int, clock: Clock, count: int = 40) -> float:
    """One matmul's time on an otherwise idle stream (best of three runs of `count`)."""
    work = Work(device, m, k, count)
    work()
    best = math.inf
    for _ in range(3):
        clock.sync()
        begin = clock.mark()
        work()
        end = clock.mark()
        clock.sync()
        best = min(best, clock.seconds(begin, end) / count)
    return best


def work_for(device: torch.device, layer_seconds: float, clock: Clock, k: int, sizes: Sequence[int]) -> Work:
    """The layer work closest to `layer_seconds`: the largest matmul that still fits twice (fewer launches, so the
    host stays ahead of the GPU), repeated."""
    units = {m: unit_seconds(device, m, k, clock) for m in sizes}
    fitting = [m for m in sizes if 2 * units[m] <= layer_seconds] or [min(sizes)]
    m = max(fitting)
    return Work(device, m, k, max(1, round(layer_seconds / units[m])))


LayerHook = Callable[[int, str], None]


def forward(layers: Sequence[str], work: Callable[[], None], clock: Clock, progress: Optional[SlicedLoad] = None,
            wait: bool = True, reads: Optional[LayerHook] = None, ran: Optional[LayerHook] = None) -> list[float]:
    """The forward: per layer its slice's wait (unless `wait` is False: the negative control), `reads(i, name)`
    where attention would read the pages, the work between two marks, then `ran(i, name)`. Returns the marks'
    pairs flat (begin, end per layer); read them after a sync."""
    marks: list[Any] = []
    for index, name in enumerate(layers):
        if progress is not None and wait and not progress.wait_for_layer(name, WAIT_SECONDS):
            raise RuntimeError(f"layer {name}: its slice never landed ({progress.failure or 'timeout'})")
        if reads is not None:
            reads(index, name)
        marks.append(clock.mark())
        work()
        marks.append(clock.mark())
        if ran is not None:
            ran(index, name)
    return marks


def layer_seconds(clock: Clock, marks: Sequence[Any]) -> float:
    """The forward's compute time: the sum of its layers' work spans."""
    return sum(clock.seconds(marks[i], marks[i + 1]) for i in range(0, len(marks), 2))


# ---- one run of each kind ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    ttft: float  # model stream: the start mark to the end of the last layer (seconds)
    compute: float  # the layers' work spans, summed
    lane: float = 0.0  # host: run_sliced to the last slice's launch mark (CUDA: enqueued, not landed)
    lane_first: float = 0.0  # host: run_sliced to slice 0's mark


def _answers(expected: int) -> tuple[Callable[[int, Any], None], threading.Event, list[Any]]:
    done, results = threading.Event(), []

    def report(cmd_id: int, result: Any) -> None:
        results.append(result)
        if len(results) == expected:
            done.set()

    return report, done, results


def forward_alone(case: Case, work: Work, clock: Clock, copy: Optional[BareCopy] = None) -> Run:
    """T_compute: the forward with no load; beside `copy` (started with it, no layer waiting for it): T_copy."""
    clock.sync()
    begin = clock.mark()
    if copy is not None:
        copy.start()
    marks = forward(case.announced, work, clock)
    end = clock.mark()
    if copy is not None:
        copy.finish()
    clock.sync()
    return Run(clock.seconds(begin, end), layer_seconds(clock, marks))


class BareCopy:
    """The load's bytes copied host to device by torch alone, in one copy: on CUDA from pinned memory on a
    high-priority side stream behind the model's work, on the host on a thread. What any transfer of those bytes does
    to the forward beside it."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.source = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1]) if self.cuda else None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.target.copy_(self.source, non_blocking=True)
            return
        self._thread = threading.Thread(target=self.target.copy_, args=(self.source,), daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """The host copy's end (on CUDA the caller's device sync waits for it)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def busy_host(seconds: float) -> None:
    """The model's thread busy for `seconds` (an engine prepares the step's inputs right before its first hook): a
    spin that touches almost no memory, so it keeps the core awake without warming the planner's caches."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pipelined(case: Case, slices: SlicePlan, work: Callable[[], None], clock: Clock, wait: bool = True,
              reads: Optional[LayerHook] = None, prelude: float = 0.0) -> Run:
    """A sliced load through the mover while the forward runs, each layer behind its slice's event; `prelude`:
    seconds the thread is busy between the sync and the load (`busy_host`)."""
    clock.sync()
    busy_host(prelude)
    report, done, results = _answers(case.chunks)
    begin = clock.mark()
    started, marked = time.perf_counter(), [0.0, 0.0]
    progress = case.mover.run_sliced(case.loads, case.load_objects, report, slices,
                                     lambda index, event: marked.__setitem__(min(index, 1), time.perf_counter()))
    marks = forward(case.announced, work, clock, progress, wait, reads)
    end = clock.mark()
    if not done.wait(WAIT_SECONDS) or not all(r.ok for r in results):
        raise RuntimeError(f"the sliced load failed: {progress.failure or [r for r in results if not r.ok][:1]}")
    clock.sync()
    return Run(clock.seconds(begin, end), layer_seconds(clock, marks), max(marked) - started, marked[0] - started)


def stored_like_loaded(case: Case) -> bool:
    """Every moved plane's segment of every stored object equals the loaded object's (the pages hold the loaded
    bytes, so a store of them writes the same segments): a store that wrote other planes' bytes is caught."""
    plan = case.layout.plan
    for index, plane in enumerate(plan.moved_planes):
        begin = plan.object_offsets[index]
        end = begin + plan.rows_per_chunk[plane.group] * plane.row_bytes
        if not all(torch.equal(s[begin:end], o[begin:end]) for s, o in zip(case.store_objects, case.load_objects)):
            return False
    return True


def device_seconds(backend: Any, plan: TransferPlan, case: Case, clock: Clock, repeats: int) -> float:
    """A load of `plan` (the whole plan or one slice's subset) alone, as one transfer behind queued GPU work (CUDA:
    the device window without the host's enqueue latency); median of `repeats`."""
    backend.prepare(plan)
    batch = ChunkBatch.build(plan, case.slots, case.load_objects, Direction.LOAD)
    backend.transfer(batch)
    seconds = []
    for _ in range(repeats):
        clock.sync()
        if clock.cuda:
            queue_gpu_work()
        stats = backend.transfer(batch)
        seconds.append(stats.device_seconds if stats.device_seconds is not None else stats.seconds)
    return statistics.median(seconds)


# ---- stores: one transfer after the forward, or one per slice as its window's layers ran ----------------------------

class StoreLane:
    """A store lane like the mover's (its own thread, backend and, on CUDA, high-priority side stream) that runs any
    plan's batch: `KVMover.run` stores the whole plan only, so per-slice stores are measured here."""

    def __init__(self, case: Case, backend: Any, plans: Sequence[TransferPlan], clock: Clock) -> None:
        self.case, self.clock = case, clock
        self.model_kit = StreamKit.for_device(case.layout.plan.device)
        self._kit = StreamKit.for_device(case.layout.plan.device)
        self._backend = backend
        self._jobs: "queue.Queue[Optional[tuple[TransferPlan, Any]]]" = queue.Queue()
        self._ends: "queue.Queue[Any]" = queue.Queue()
        self._plans = list(plans)
        self._thread = threading.Thread(target=self._loop, name="layer-pipeline-store", daemon=True)
        self._thread.start()

    def put(self, plan: TransferPlan) -> None:
        """Store `plan`'s planes of every chunk once the model's stream reaches its present position."""
        self._jobs.put((plan, self.model_kit.record()))

    def ends(self, count: int) -> list[Any]:
        """The end marks of the next `count` stores, in order (waits for them on the host)."""
        return [self._ends.get(timeout=WAIT_SECONDS) for _ in range(count)]

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        self._kit.bind_thread()
        for plan in self._plans:
            self._backend.prepare(plan)
        with self._kit.side_stream():
            while (job := self._jobs.get()) is not None:
                plan, ready = job
                self._kit.wait(ready)
                try:
                    self._backend.transfer(ChunkBatch.build(plan, self.case.slots, self.case.store_objects,
                                                            Direction.STORE))
                    self._ends.put(self.clock.mark())
                except Exception as exc:  # the model's thread must see it, not wait out the timeout
                    self._ends.put(exc)


@dataclass(frozen=True)
class StoreRun:
    tail: float  # the forward's end to the last store's end (seconds)
    compute: float


def store_after(case: Case, lane: StoreLane, slices: SlicePlan, work: Work, clock: Clock) -> StoreRun:
    """The forward, storing slice k's planes once window k's layers ran (one slice: today's single store once the
    forward ended)."""
    last_of_window = {piece.layers[-1]: piece for piece in slices.slices if piece.layers}
    queued = []

    def ran(index: int, name: str) -> None:
        piece = last_of_window.get(name)
        if piece is not None and not piece.empty:
            lane.put(piece.plan)
            queued.append(piece.index)

    clock.sync()
    marks = forward(case.announced, work, clock, ran=ran)
    end = marks[-1]
    stores = lane.ends(len(queued))
    failed = [e for e in stores if isinstance(e, Exception)]
    if failed:
        raise RuntimeError(f"a store failed: {failed[0]}")
    clock.sync()
    return StoreRun(clock.seconds(end, stores[-1]), layer_seconds(clock, marks))


# ---- the sweep -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One (geometry, load, compute, S): times in ms."""

    geometry: str
    launch: str  # "at-once" or "per-slice"
    chunks: int
    load_mb: float
    target_ratio: float
    ratio: float  # measured T_load / T_compute
    slices: int
    layers: int
    t_load: float  # the whole load as one transfer, device window
    t_load_path: float  # the same through run_sliced (S=1), model stream, no compute: what the host adds
    t_compute: float  # the forward alone
    t_slice0: float  # slice 0 alone, device window
    ideal: float
    achieved: float  # median TTFT
    cold: Optional[float]  # the first run with this slice plan (the lane prepares each slice's tables)
    lane_host: float  # host ms from run_sliced until the lane marked the last slice
    lane_first: float  # host ms from run_sliced until the lane marked slice 0
    over_ideal: float
    slowdown: float  # the layers' compute while slices land against alone
    serial: float  # T_load + T_compute: the load, then the forward
    t_copy: float  # the forward beside a bare copy of the load's bytes (`BareCopy`)
    ideal_copy: float  # max(T_load, T_copy) + T_slice0: the overlap the hardware allows
    over_copy: float


@dataclass(frozen=True)
class StoreRow:
    geometry: str
    chunks: int
    target_ratio: float
    slices: int  # 1: today's one store after the forward
    t_compute: float
    tail: float  # the forward's end to the store's end, median (ms)
    slowdown: float
    same_bytes: bool  # the stored objects hold the loaded planes' bytes (S stores of plane subsets included)


def slice_counts(counts: Sequence[str], layers: int) -> list[int]:
    """The sweep's S values over `layers` announced layers ("L": one slice per layer), each at most `layers`."""
    return sorted({layers if c == "L" else min(int(c), layers) for c in counts})


def chunks_for(geometry: Geometry, load_mb: float) -> int:
    """Chunks of `geometry` whose load moves about `load_mb` MB (at least one)."""
    layout, _, _ = _geometry_request(geometry, 1, torch.device("cpu"), 0)
    return max(1, round(load_mb * 1e6 / layout.plan.object_bytes))


@dataclass(frozen=True)
class Settings:
    backend: str = "cuda"
    ratios: Sequence[float] = RATIOS
    counts: Sequence[str] = COUNTS
    repeats: int = 7
    k: int = 4096  # the matmuls' inner size (llama3-8b's hidden size)
    sizes: Sequence[int] = (64, 256, 1024, 4096)  # the matmuls' token rows to choose from
    stores: bool = True
    options: Optional[dict[str, Any]] = None  # backend options (e.g. path=mapped)
    launch: str = "at-once"  # how the lane launches a sliced load: "at-once" (backend's launch_sliced) or "per-slice"


def study_load(geometry: Geometry, chunks: int, settings: Settings) -> tuple[list[Row], list[StoreRow]]:
    """Every ratio and S for one load of `chunks` chunks of `geometry`."""
    rows: list[Row] = []
    store_rows: list[StoreRow] = []
    with open_case(geometry, chunks, settings.backend, options=settings.options,
                   per_slice=settings.launch == "per-slice") as case:
        device, clock = case.layout.plan.device, Clock(case.layout.plan.device)
        layers = len(case.announced)
        plans = {s: plan_slices(case.layout, case.announced, s) for s in slice_counts(settings.counts, layers)}
        probe = get_backend(settings.backend, **(settings.options or {}))
        t_load = device_seconds(probe, case.layout.plan, case, clock, settings.repeats)
        t_slice0 = {s: device_seconds(probe, p.slices[0].plan, case, clock, settings.repeats) for s, p in plans.items()}
        idle = Work(device, settings.sizes[0], settings.k, 0)
        whole = plans[1] if 1 in plans else plan_slices(case.layout, case.announced, 1)  # `path`: S = 1 at any sweep
        path = statistics.median(pipelined(case, whole, idle, clock).ttft for _ in range(settings.repeats + 1))
        cold: dict[int, Optional[float]] = {s: None for s in plans}
        pieces = [piece.plan for p in plans.values() for piece in p.slices]
        lane = StoreLane(case, get_backend(settings.backend, **(settings.options or {})), pieces, clock) \
            if settings.stores else None
        copy = BareCopy(chunks * case.layout.plan.object_bytes, device)
        try:
            for ratio in settings.ratios:
                work = work_for(device, t_load / ratio / layers, clock, settings.k, settings.sizes)
                work()
                for s, sliced in plans.items():
                    if cold[s] is None:
                        cold[s] = pipelined(case, sliced, work, clock).ttft * 1e3
                    alone, beside, runs = [], [], []
                    for _ in range(settings.repeats):  # interleaved: the GPU's clocks drift between runs
                        alone.append(forward_alone(case, work, clock))
                        beside.append(forward_alone(case, work, clock, copy))
                        runs.append(pipelined(case, sliced, work, clock))
                    t_compute = statistics.median(r.ttft for r in alone)
                    t_copy = statistics.median(r.ttft for r in beside)
                    achieved = statistics.median(r.ttft for r in runs)
                    ideal = ideal_seconds(t_load, t_compute, t_slice0[s])
                    ideal_copy = ideal_seconds(t_load, t_copy, t_slice0[s])
                    load_mb = chunks * case.layout.plan.object_bytes / 1e6
                    rows.append(Row(geometry.name, settings.launch, chunks, load_mb, ratio, t_load / t_compute, s,
                                    layers, t_load * 1e3, path * 1e3, t_compute * 1e3,
                                    t_slice0[s] * 1e3, ideal * 1e3, achieved * 1e3, cold[s],
                                    statistics.median(r.lane for r in runs) * 1e3,
                                    statistics.median(r.lane_first for r in runs) * 1e3,
                                    over_ideal(achieved, ideal), slowdown([r.compute for r in runs],
                                                                          [r.compute for r in alone]),
                                    (t_load + t_compute) * 1e3, t_copy * 1e3, ideal_copy * 1e3,
                                    over_ideal(achieved, ideal_copy)))
                    if lane is not None:
                        for obj in case.store_objects:
                            obj.zero_()
                        store_after(case, lane, sliced, work, clock)  # warm: the lane's first batch of this plan
                        same = stored_like_loaded(case)
                        stored = [store_after(case, lane, sliced, work, clock) for _ in range(settings.repeats)]
                        store_rows.append(StoreRow(geometry.name, chunks, ratio, s, t_compute * 1e3,
                                                   statistics.median(r.tail for r in stored) * 1e3,
                                                   slowdown([r.compute for r in stored], [r.compute for r in alone]),
                                                   same))
        finally:
            if lane is not None:
                lane.close()
    return rows, store_rows


# ---- output --------------------------------------------------------------------------------------------------------

def render(rows: Sequence[Row], store_rows: Sequence[StoreRow]) -> list[Any]:
    """The load table and the store table (rich)."""
    from rich.table import Table

    loads = Table(title=f"sliced loads under a per-layer forward: achieved TTFT against max(T_load, T_compute) + "
                        f"T_slice0 (target within {TARGET:.0%} for T_load/T_compute in [0.3, 3])", title_justify="left")
    for name in ("geometry", "launch", "MB", "ratio", "S", "T_load", "path", "T_compute", "T_slice0", "ideal",
                 "achieved", "cold", "lane0", "lane", "over ideal", "slowdown", "serial", "T_copy", "over copy"):
        loads.add_column(name, justify="left" if name == "geometry" else "right")
    for r in rows:
        mark = "" if abs(r.over_ideal) <= TARGET else " !"
        loads.add_row(r.geometry, r.launch, f"{r.load_mb:.1f}", f"{r.ratio:.2f}", str(r.slices), f"{r.t_load:.2f}",
                      f"{r.t_load_path:.2f}", f"{r.t_compute:.2f}", f"{r.t_slice0:.3f}", f"{r.ideal:.2f}",
                      f"{r.achieved:.2f}", "" if r.cold is None else f"{r.cold:.1f}", f"{r.lane_first:.2f}",
                      f"{r.lane_host:.2f}",
                      f"{r.over_ideal:+.1%}{mark}",
                      f"{r.slowdown:+.1%}", f"{r.serial:.2f}", f"{r.t_copy:.2f}",
                      f"{r.over_copy:+.1%}" + ("" if abs(r.over_copy) <= TARGET else " !"))
    stores = Table(title="stores: the forward's end to the store's end (ms), one store (S=1) or one per slice",
                   title_justify="left")
    for name in ("geometry", "chunks", "target ratio", "S", "T_compute", "tail", "slowdown", "bytes"):
        stores.add_column(name, justify="left" if name == "geometry" else "right")
    for s in store_rows:
        stores.add_row(s.geometry, str(s.chunks), f"{s.target_ratio:g}", str(s.slices), f"{s.t_compute:.2f}",
                       f"{s.tail:.3f}", f"{s.slowdown:+.1%}", "same" if s.same_bytes else "DIFFER")
    return [loads, stores] if store_rows else [loads]


def environment() -> dict[str, str]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=Path, nargs="*", default=[])
    parser.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "host")
    parser.add_argument("--load-mb", type=float, nargs="+", default=[256.0], help="load sizes (MB) per geometry")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--slices", nargs="+", default=list(COUNTS), help="S values; L: one slice per layer")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-stores", action="store_true")
    parser.add_argument("--path", choices=["auto", "mapped", "staging"], help="the CUDA backend's path option")
    parser.add_argument("--blocks", type=int, help="the CUDA backend's blocks option (grid size of every launch)")
    parser.add_argument("--launch", nargs="+", choices=["at-once", "per-slice"], default=["at-once"],
                        help="how the load lane launches a sliced load (per-slice: one launch per slice)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="a JSON this study wrote: plot it (--png) and exit")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    import json

    from lmcache_npu.tools.bench.studies.plot_layer_pipeline import plot

    if args.plot:
        plot(json.loads(args.plot.read_text()), args.png or args.plot.with_suffix(".png"))
        return 0
    if not args.geometry:
        raise SystemExit("name at least one --geometry file")
    from rich.console import Console

    small = args.backend != "cuda"  # a CPU run: tiny matmuls
    rows, store_rows = [], []
    for launch in args.launch:
        settings = Settings(args.backend, args.ratios, args.slices, args.repeats, 64 if small else 4096,
                            (8, 32) if small else Settings.sizes, not args.no_stores,
                            {k: v for k, v in (("path", args.path), ("blocks", args.blocks)) if v} or None,
                            launch)
        for path in args.geometry:
            geometry = load_geometry(path)
            for mb in args.load_mb:
                got = study_load(geometry, chunks_for(geometry, mb), settings)
                rows += got[0]
                store_rows += got[1]
    console = Console(width=200)
    for table in render(rows, store_rows):
        console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(), "settings": asdict(settings),
                                         "rows": [asdict(r) for r in rows],
                                         "stores": [asdict(s) for s in store_rows]}, indent=1))
        if args.png:
            plot(json.loads(args.json.read_text()), args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
