"""`lmcache-npu bench`: store and load N chunks of a model's geometry, report bandwidth, verify bytes."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch

from ...ops import ChunkBatch, Direction, TransferBackend, TransferStats, get_backend
from ...ops.torch_backend import TorchBackend, row_view
from .geometry import Geometry, Materialized, materialize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRow:
    direction: str
    chunks: int
    payload_bytes: int
    seconds: float  # device time where the backend measures it (CUDA events), else wall time
    launches: int
    dma_ops: Optional[int]
    path: Optional[str] = None  # cuda: mapped | staging | device
    kernel_ms: Optional[float] = None
    pinned_gb_per_s: Optional[float] = None  # plain pinned copy of the same bytes, same run
    naive_gb_per_s: Optional[float] = None  # per-plane torch gather + one copy, same run

    @property
    def gb_per_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class BenchReport:
    preset: str
    backend: str
    chunk_tokens: int
    chunks: int
    groups: int
    planes: int
    moved_planes: int
    object_bytes: int
    naive_object_bytes: int
    rows: tuple[BenchRow, ...]
    check: Optional[str]  # None: not checked; "ok" or the first mismatch

    def to_json(self) -> dict:
        data = asdict(self)
        for row, src in zip(data["rows"], self.rows):
            row["gb_per_s"] = src.gb_per_s
        return data


def device_for(backend: TransferBackend) -> torch.device:
    """The device whose memory `backend` moves."""
    if backend.name == "npu":
        return torch.device("npu")
    if backend.name == "cuda":
        return torch.device("cuda")
    return torch.device("cpu")


def _live_rows(m: Materialized) -> list[tuple[int, torch.Tensor]]:
    """(plane index, row bytes of every live slot in batch order) for the round-trip check."""
    rows = []
    for i, plane in enumerate(m.plan.moved_planes):
        slots = m.slots[plane.group].reshape(-1)
        view = row_view(plane)
        rows.append((i, view[slots // plane.rows_per_block, slots % plane.rows_per_block].reshape(slots.numel(), -1)
                     .cpu().clone()))
    return rows


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(torch.nonzero(a.reshape(-1) != b.reshape(-1))[0])


def materialize_source(source: Union[Geometry, str], chunks: int, device: torch.device, seed: int = 0,
                       chunk_tokens: Optional[int] = None, device_family: str = "ascend") -> tuple[Materialized, str]:
    """A --geometry file or a preset name, allocated for `chunks` chunks; returns it and its display name."""
    if isinstance(source, Geometry):
        return materialize(source, chunks, device, seed, chunk_tokens), source.name
    from .presets import materialize_preset

    m, _, _ = materialize_preset(source, chunks, device, seed, chunk_tokens, device_family)
    return m, f"{source} ({device_family})"


def default_family(backend_name: str) -> str:
    """Presets are shaped like the device the backend serves: vLLM's CUDA tensors for cuda, Ascend's otherwise."""
    return "cuda" if backend_name == "cuda" else "ascend"


def run_bench(source: Union[Geometry, str], backend_name: str, chunks: int = 4, chunk_tokens: Optional[int] = None,
              check: bool = False, repeats: int = 1, seed: int = 0, progress: bool = True,
              device_family: Optional[str] = None, **backend_options: object) -> BenchReport:
    """Stores `chunks` chunks, scrubs the pages, loads them back; `check` verifies every byte."""
    backend = get_backend(backend_name, **backend_options)
    m, name = materialize_source(source, chunks, device_for(backend), seed, chunk_tokens,
                                 device_family or default_family(backend.name))
    plan = m.plan
    pin = backend.name in ("npu", "cuda")
    objects = torch.zeros((chunks, plan.object_bytes), dtype=torch.uint8, pin_memory=pin)
    originals = _live_rows(m) if check else []
    store_batch = ChunkBatch.build(plan, m.slots, objects, Direction.STORE)
    load_batch = ChunkBatch.build(plan, m.slots, objects, Direction.LOAD)

    from rich.progress import Progress

    stats: dict[str, list[TransferStats]] = {"store": [], "load": []}
    kernel_ms: dict[str, float] = {"store": float("inf"), "load": float("inf")}
    if backend.name in ("cuda", "npu"):  # untimed warm-up: first-touch allocations, streams, lazy init
        backend.transfer(store_batch)
        backend.transfer(load_batch)
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"{backend.name}: {name}", total=2 * repeats)
        for _ in range(repeats):
            stats["store"].append(backend.transfer(store_batch))
            kernel_ms["store"] = min(kernel_ms["store"], getattr(backend, "last_kernel_ms", None) or float("inf"))
            bar.advance(task)
            for p in m.allocations:
                p.zero_()
            stats["load"].append(backend.transfer(load_batch))
            kernel_ms["load"] = min(kernel_ms["load"], getattr(backend, "last_kernel_ms", None) or float("inf"))
            bar.advance(task)

    verdict: Optional[str] = None
    if check:
        verdict = "ok"
        reference = torch.zeros_like(objects)
        restored = _live_rows(m)
        for (i, before), (_, after) in zip(originals, restored):
            if not torch.equal(before, after):
                where = _first_difference(before, after)
                verdict = f"plane {plan.moved_planes[i].label}: restored byte {where} differs"
                break
        if verdict == "ok" and backend.name != "torch":
            # The pages now hold the restored rows; the torch oracle stores them again for comparison.
            TorchBackend().transfer(ChunkBatch.build(plan, m.slots, reference, Direction.STORE))
            if not torch.equal(reference, objects):
                c = _first_difference(reference, objects)
                verdict = f"chunk object byte {c} (chunk {c // plan.object_bytes}) differs from the torch oracle"

    def seconds(s: TransferStats) -> float:
        return s.device_seconds if s.device_seconds is not None else s.seconds

    def best(direction: str, batch: ChunkBatch) -> BenchRow:
        fastest = min(stats[direction], key=seconds)
        extra: dict = {}
        if backend.name == "cuda":
            from .cuda_baselines import naive_torch_gbps, pinned_copy_gbps

            extra = dict(path=backend.path_for(batch), kernel_ms=kernel_ms[direction],
                         pinned_gb_per_s=pinned_copy_gbps(fastest.payload_bytes, batch.direction, plan.device),
                         naive_gb_per_s=naive_torch_gbps(batch))
        return BenchRow(direction, fastest.chunks, fastest.payload_bytes, seconds(fastest), fastest.launches,
                        fastest.dma_ops, **extra)

    return BenchReport(
        preset=name, backend=backend.name, chunk_tokens=plan.chunk_tokens, chunks=chunks,
        groups=len(plan.groups), planes=len(plan.planes), moved_planes=len(plan.moved_planes),
        object_bytes=plan.object_bytes, naive_object_bytes=plan.object_bytes_naive(),
        rows=(best("store", store_batch), best("load", load_batch)), check=verdict,
    )


def render(report: BenchReport) -> "object":
    from rich.table import Table

    table = Table(title=f"{report.preset} on {report.backend}: {report.chunks} chunks x {report.chunk_tokens} tokens, "
                        f"{report.moved_planes}/{report.planes} planes in {report.groups} groups")
    cuda = any(row.pinned_gb_per_s is not None for row in report.rows)
    columns = ["direction", "bytes", "time (ms)", "GB/s", "launches"]
    columns += ["path", "kernel (ms)", "x pinned copy", "x naive torch"] if cuda else ["DMA ops", "DMA ops/chunk"]
    for col in columns:
        table.add_column(col, justify="right")
    for row in report.rows:
        cells = [row.direction, f"{row.payload_bytes:,}", f"{row.seconds * 1e3:.3f}", f"{row.gb_per_s:.2f}",
                 str(row.launches)]
        if cuda:
            cells += [str(row.path), f"{row.kernel_ms:.3f}", f"{row.gb_per_s / row.pinned_gb_per_s:.3f}",
                      f"{row.gb_per_s / row.naive_gb_per_s:.2f}"]
        else:
            cells += ["-" if row.dma_ops is None else str(row.dma_ops),
                      "-" if row.dma_ops is None else f"{row.dma_ops / row.chunks:.0f}"]
        table.add_row(*cells)
    table.caption = (f"chunk object {report.object_bytes:,} B (a naive copier: {report.naive_object_bytes:,} B)"
                     + ("" if report.check is None else f"; check: {report.check}")
                     + ("; emu times are emulator times, not hardware" if report.backend == "emu" else ""))
    return table
