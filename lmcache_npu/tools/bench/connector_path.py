"""The worker half's hot path: chunks stored and loaded the way the connector moves them each step, next to the
bench's own transfer of the same chunks (issue 14: a transfer issued from the connector may cost no more).

The connector's path is the store executor (`StoreExecutor.submit`, on the model's thread) handing the step's
commands to the transfer lanes (`KVMover`), whose thread turns each command's block window into slot matrices,
builds the batch, and runs it through the backend, ordered after the model's stream by an event. The bench's path
is `backend.transfer` of a ChunkBatch built beforehand. Both move the same rows between the same pages and the same
arena slots, on backends of the same options, and the bytes they leave are compared. Per direction the best of
`repeats`: the transfer's device window (CUDA events on GPUs, else its wall time), the model thread's time in
`submit` (what the step pays), and the time until the last command reported (what a waiting request sees).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from ...layout.discovery import KVLayout, LayoutGroup
from ...layout.slots import layout_slots, stored_block_span
from ...layout.specs import SpecKind
from ...ops import ChunkBatch, Direction, TransferPlan, TransferStats, get_backend
from ...ops.torch_backend import TorchBackend
from ...store.arena import slot_bytes_for
from ...store.commands import Load, Store
from ...store.config import StoreConfig
from ...store.cost.timer import TransferTimer
from ...store.executor import StoreExecutor
from ...store.keys import ChunkKey
from ...store.tier import TierCounters
from ...transfer import BlockWindow, DeviceMove, KVMover
from ...transfer.pipeline import build_worker_pipeline
from .cuda_baselines import queue_gpu_work
from .geometry import Geometry, materialize
from .presets import materialize_preset
from .runner import default_family, device_for

REQUEST = "bench-request"


@dataclass(frozen=True)
class PathRow:
    """One direction: the bench's transfer and the connector's, best of the repeats each."""

    direction: str
    start: str  # idle: each transfer starts on an idle GPU; queued: behind 1 ms of the model's GPU work (CUDA)
    chunks: int
    payload_bytes: int
    bench_ms: float  # device window of backend.transfer (wall time where the backend has no device clock)
    connector_ms: float  # device window of the same transfer issued by the connector's worker path
    submit_us: float  # the model thread's time in StoreExecutor.submit (median)
    reported_ms: float  # from submit until every command reported (median)
    bench_wall_ms: float  # backend.transfer's own wall time (median), for the reported_ms above
    pinned_copy_ms: Optional[float] = None  # one copy of the same bytes to or from pinned memory (CUDA)

    @property
    def connector_over_bench(self) -> float:
        return self.connector_ms / self.bench_ms

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "connector_over_bench": self.connector_over_bench}


@dataclass(frozen=True)
class PathReport:
    source: str
    backend: str
    object_bytes: int
    rows: tuple[PathRow, ...]
    same_bytes: bool  # the connector's store left the bench's bytes, and its load restored the pages

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "backend": self.backend, "object_bytes": self.object_bytes,
                "same_bytes": self.same_bytes, "rows": [r.to_json() for r in self.rows]}


def layout_of_plan(plan: TransferPlan, name: str) -> KVLayout:
    """A geometry's plan as the layout the connector would discover: one scheduler group per plan group, full
    attention or sliding window, blocks of `tokens_per_block` tokens (a machine without vLLM has no presets)."""
    groups = []
    for index, spec in enumerate(plan.groups):
        rows = plan.rows_per_chunk[index]
        rows_per_block = plan.group_rows_per_block[index] or spec.tokens_per_block // spec.compress_ratio
        groups.append(LayoutGroup(
            index=index, scheduler_group=index, spec=name,
            kind=SpecKind.FULL_ATTENTION if spec.sliding_window is None else SpecKind.SLIDING_WINDOW,
            layers=(), block_size=spec.tokens_per_block // spec.compress_ratio, geometry=spec,
            rows_per_block=rows_per_block, sliding_window=spec.sliding_window,
            stored_tokens=rows * spec.compress_ratio, rows_per_chunk=rows, recurrent=False, note="", planes=(),
            chunk_tokens=plan.chunk_tokens))
    return KVLayout(plan, tuple(groups), hash_block_size=plan.chunk_tokens)


def _geometry_request(geometry: Geometry, chunks: int, device: torch.device,
                      seed: int) -> tuple[KVLayout, list[np.ndarray], list[torch.Tensor]]:
    """The geometry allocated with a block per `tokens_per_block` tokens of one request of `chunks` chunks (as vLLM
    gives a request: a windowed group's blocks hold its tails at their tokens), and that request's block tables."""
    tokens = chunks * geometry.chunk_tokens
    sized = replace(geometry, groups=tuple(
        replace(g, planes=tuple(replace(p, num_blocks=math.ceil(tokens / g.tokens_per_block) + 1) for p in g.planes))
        for g in geometry.groups))
    m = materialize(sized, chunks, device, seed)
    layout = layout_of_plan(m.plan, geometry.name)
    generator = torch.Generator().manual_seed(seed + 1)
    tables = []
    for g in sized.groups:
        blocks = g.planes[0].num_blocks
        tables.append((torch.randperm(blocks - 1, generator=generator) + 1).numpy())  # block 0: vLLM's null block
    return layout, tables, m.allocations


def _preset_request(name: str, chunks: int, device: torch.device, device_family: str,
                    seed: int) -> tuple[KVLayout, list[np.ndarray], list[torch.Tensor]]:
    m, layout, _ = materialize_preset(name, chunks, device, seed, device_family=device_family)
    return layout, m.block_tables, m.allocations


def _seconds(stats: TransferStats) -> float:
    return stats.device_seconds if stats.device_seconds is not None else stats.seconds


def run_connector_path(source: Union[Geometry, str], backend_name: str = "auto", chunks: int = 1, repeats: int = 10,
                       device_family: Optional[str] = None, seed: int = 0, starts: Sequence[str] = ("idle",),
                       timer: Optional[TransferTimer] = None, **backend_options: object) -> PathReport:
    """Stores then loads `chunks` chunks of one request `repeats` times through each path (see the module), per
    start in `starts`: idle, or queued behind GPU work as in serving (CUDA only). `timer`: the worker's transfer
    timer, attached to the connector path's executor as the worker half attaches it (the cost model's samples)."""
    if chunks < 1 or repeats < 1:
        raise ValueError(f"chunks ({chunks}) and repeats ({repeats}) must be >= 1")
    if not starts or set(starts) - {"idle", "queued"}:
        raise ValueError(f"starts must be idle and/or queued, got {list(starts)}")
    bench = get_backend(backend_name, **backend_options)
    device = device_for(bench)
    if isinstance(source, Geometry):
        layout, tables, allocations = _geometry_request(source, chunks, device, seed)
        name = source.name
    else:
        family = device_family or default_family(bench.name)
        layout, tables, allocations = _preset_request(source, chunks, device, family, seed)
        name = f"{source} ({family})"
    plan = layout.plan
    if "queued" in starts and plan.device.type != "cuda":
        raise ValueError(f"a queued start needs a CUDA device (the {bench.name} backend moves {plan.device} pages)")
    slots = layout_slots(layout, tables, np.arange(chunks))
    sync = torch.cuda.synchronize if plan.device.type == "cuda" else (lambda: None)
    rows = []
    with contextlib.ExitStack() as cleanup:  # whatever was built is closed, the arena's registration last
        counters = TierCounters()
        # the connector's worker side, as its worker half builds it, over an arena of 2 x chunks slots
        store = StoreConfig(cpu_bytes=2 * chunks * slot_bytes_for(plan.object_bytes), pinned=device.type != "cpu")
        pipeline = build_worker_pipeline(layout, store, 0, lambda: get_backend(backend_name, **backend_options),
                                         counters)
        cleanup.callback(pipeline.arena.close)
        cleanup.callback(pipeline.close)
        arena, mover, executor = pipeline.arena, pipeline.mover, pipeline.executor
        executor.timer = timer
        bench_objects = [arena.slot(i) for i in range(chunks)]  # the bench's transfer uses slots [0, chunks)
        # the connector's commands use slots [chunks, 2 chunks)
        bench.prepare(plan)
        step = _ConnectorStep(executor, mover, counters, _window(layout, tables, chunks), chunks, plan.chunk_tokens)
        same = True
        for direction, start in [(d, s) for d in (Direction.STORE, Direction.LOAD) for s in starts]:
            batch = ChunkBatch.build(plan, slots, bench_objects, direction)
            bench.transfer(batch)  # untimed warm-up of both paths: first allocations, lazy initialisation
            step.run(direction)
            sync()
            queue = queue_gpu_work if start == "queued" else (lambda: None)
            bench_runs, bench_walls, path_runs, submits, waits = [], [], [], [], []
            for _ in range(repeats):
                queue()
                started = time.perf_counter()
                bench_runs.append(_seconds(bench.transfer(batch)))
                bench_walls.append(time.perf_counter() - started)
                sync()
                queue()  # the model's stream is busy when the step submits: the lane's transfer waits behind it
                spent, submit, wait = step.run(direction)
                sync()
                path_runs.append(spent)
                submits.append(submit)
                waits.append(wait)
            if direction == Direction.STORE:  # both paths stored the same rows: the objects must agree
                same &= all(torch.equal(arena.slot(i), arena.slot(chunks + i)) for i in range(chunks))
            rows.append(PathRow(direction.name.lower(), start, chunks, batch.payload_bytes, min(bench_runs) * 1e3,
                                min(path_runs) * 1e3, statistics.median(submits) * 1e6,
                                statistics.median(waits) * 1e3, statistics.median(bench_walls) * 1e3,
                                _pinned_copy_ms(batch.payload_bytes, direction, plan.device, start == "queued")))
        same &= _load_restores_pages(plan, slots, [arena.slot(chunks + i) for i in range(chunks)], allocations,
                                     lambda: step.run(Direction.LOAD))
    return PathReport(name, bench.name, plan.object_bytes, tuple(rows), same)


class _ConnectorStep:
    """One step's stores or loads of the request's chunks as the worker half issues them: the device moves the
    scheduler sent, through `StoreExecutor.submit`."""

    def __init__(self, executor: StoreExecutor, mover: KVMover, counters: TierCounters, window: BlockWindow,
                 chunks: int, chunk_tokens: int) -> None:
        self.executor, self.mover, self.counters, self.window = executor, mover, counters, window
        self.chunks, self.chunk_tokens = chunks, chunk_tokens
        self._ids = iter(range(1, 1 << 40))

    def run(self, direction: Direction) -> tuple[float, float, float]:
        """(the transfer's device window, the model thread's time in submit, the time until every command
        reported), in seconds."""
        cmd_ids = [next(self._ids) for _ in range(self.chunks)]
        keys = [ChunkKey(REQUEST, c.to_bytes(8, "little")) for c in cmd_ids]
        arena_slots = [self.chunks + i for i in range(self.chunks)]
        if direction == Direction.STORE:
            commands = [DeviceMove(Store(c, k, s, REQUEST, i), self.window)
                        for i, (c, k, s) in enumerate(zip(cmd_ids, keys, arena_slots))]
        else:
            commands = [DeviceMove(Load(c, k, s, REQUEST, i), self.window, 0, self.chunks * self.chunk_tokens)
                        for i, (c, k, s) in enumerate(zip(cmd_ids, keys, arena_slots))]
        self.counters.drain()
        started = time.perf_counter()
        self.executor.submit(commands)
        submitted = time.perf_counter()
        if not self.executor.wait_idle(60):
            raise RuntimeError(f"the connector's {direction.name.lower()} did not report within 60 s")
        reported = time.perf_counter()
        failed = [c for c in self.executor.poll() if not c.ok]
        if failed:
            raise RuntimeError(f"the connector's {direction.name.lower()} failed: {failed[0].reason}")
        self.mover.release_pages()  # what the next step does before the model writes pages
        spent = self.counters.drain()[f"{'store' if direction == Direction.STORE else 'load'}_seconds"]
        return spent, submitted - started, reported - started


def _window(layout: KVLayout, tables: Sequence[np.ndarray], chunks: int) -> BlockWindow:
    """The request's block table per scheduler group, as the scheduler half sends it for chunks [0, chunks)."""
    firsts, ids = [], []
    for sg, table in enumerate(tables):
        spans = [stored_block_span(g, layout.plan.chunk_tokens, 0, chunks) for g in layout.groups
                 if g.scheduler_group == sg and not g.skipped]
        lo = min((s[0] for s in spans), default=0)
        hi = max((s[1] for s in spans), default=0)
        firsts.append(lo)
        ids.append(tuple(int(b) for b in table[lo:hi]))
    return BlockWindow(tuple(firsts), tuple(ids))


def _load_restores_pages(plan: TransferPlan, slots: list, objects: list[torch.Tensor],
                         allocations: list[torch.Tensor], load: Callable[[], object]) -> bool:
    """Scrubbed pages loaded through the connector hold what the torch oracle loads into scrubbed pages."""
    for a in allocations:
        a.zero_()
    load()
    loaded = [a.clone() for a in allocations]
    for a in allocations:
        a.zero_()
    TorchBackend().transfer(ChunkBatch.build(plan, slots, objects, Direction.LOAD))
    return all(torch.equal(a, b) for a, b in zip(loaded, allocations))


def _pinned_copy_ms(nbytes: int, direction: Direction, device: torch.device, queued: bool) -> Optional[float]:
    if device.type != "cuda":
        return None
    from .cuda_baselines import pinned_copy_gbps

    return nbytes / pinned_copy_gbps(nbytes, direction, device, repeats=10, queued=queued) / 1e6


def render_connector_path(report: PathReport) -> "object":
    from rich.table import Table

    table = Table(title=f"{report.source}, {report.backend}: the connector's worker path vs the bench's transfer "
                        f"(bytes {'identical' if report.same_bytes else 'DIFFER'})", title_justify="left")
    for column in ("direction", "start", "chunks", "MB", "bench ms", "connector ms", "connector / bench",
                   "pinned copy ms", "submit µs", "reported ms", "bench wall ms"):
        table.add_column(column, justify="right")
    for r in report.rows:
        table.add_row(r.direction, r.start, str(r.chunks), f"{r.payload_bytes / 1e6:.1f}", f"{r.bench_ms:.3f}",
                      f"{r.connector_ms:.3f}", f"{r.connector_over_bench:.3f}",
                      "" if r.pinned_copy_ms is None else f"{r.pinned_copy_ms:.3f}", f"{r.submit_us:.0f}",
                      f"{r.reported_ms:.3f}", f"{r.bench_wall_ms:.3f}")
    return table
