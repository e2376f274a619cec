"""The GPU timeline of one sliced load under the layer_pipeline study's forward (issue 41): when each slice's copies
and kernel ran on the load lane's stream, and where the forward's stream stood idle between two kernels. It tells a
load that lands late (the lane's stream) from a forward whose launches stall on the host (gaps on the model's stream).

    python -m lmcache_npu.tools.bench.studies.sliced_timeline \
        --geometry lmcache_npu/tools/bench/geometries/cuda/deepseek-v3.json --ratio 0.8 1.5 --slices 4 --json t.json

Per ratio it prints the TTFT of a few unprofiled runs beside the forward alone, then one profiled run: per stream its
busy time and span, the load's copies and kernels in order, and every gap longer than `--gap-us` on the stream that
ran the most kernels (the forward's). Results: docs/performance.md, "Round 4".
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class DeviceSpan:
    """One kernel or copy on the GPU, in µs from the profiled run's first one."""

    start_us: float
    duration_us: float
    name: str
    stream: int

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclass(frozen=True)
class StreamSummary:
    stream: int
    spans: int
    busy_us: float
    first_us: float
    last_us: float
    names: dict[str, int]  # span names (cut to 40 characters) and how often each ran


def stream_summaries(spans: Sequence[DeviceSpan]) -> list[StreamSummary]:
    """Per stream: how many spans, their summed time, the first start and last end, and what ran."""
    out = []
    for stream in sorted({s.stream for s in spans}):
        mine = [s for s in spans if s.stream == stream]
        out.append(StreamSummary(stream, len(mine), sum(s.duration_us for s in mine), min(s.start_us for s in mine),
                                 max(s.end_us for s in mine), dict(Counter(s.name[:40] for s in mine))))
    return out


def idle_gaps(spans: Sequence[DeviceSpan], stream: int, gap_us: float) -> list[tuple[float, float]]:
    """(start, length) of every stretch longer than `gap_us` in which `stream` ran nothing, between its first span's
    start and its last span's end."""
    mine = sorted((s for s in spans if s.stream == stream), key=lambda s: s.start_us)
    gaps, busy_until = [], None
    for span in mine:
        if busy_until is not None and span.start_us - busy_until > gap_us:
            gaps.append((busy_until, span.start_us - busy_until))
        busy_until = span.end_us if busy_until is None else max(busy_until, span.end_us)
    return gaps


def profiled_spans(run: Any) -> list[DeviceSpan]:
    """The GPU spans of `run()` (kernels and copies, from torch.profiler), from its first span on."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    raw = [(e.time_range.start, e.time_range.end - e.time_range.start, e.name,
            int(getattr(e, "device_resource_id", -1))) for e in prof.events() if e.device_type.name == "CUDA"]
    if not raw:
        return []
    first = min(start for start, *_ in raw)
    spans = [DeviceSpan(float(start - first), float(length), name, stream) for start, length, name, stream in raw]
    return sorted(spans, key=lambda span: (span.start_us, span.stream))


def timeline(geometry_path: Path, ratio: float, slices: int, load_mb: float, runs: int,
             gap_us: float) -> dict[str, Any]:
    """One ratio's unprofiled TTFTs, the forward alone, and the profiled run's spans, summaries and gaps."""
    from lmcache_npu.ops import get_backend
    from lmcache_npu.tools.bench.geometry import load_geometry
    from lmcache_npu.tools.bench.studies.layer_pipeline import (Clock, chunks_for, device_seconds, forward_alone,
                                                                open_case, pipelined, work_for)
    from lmcache_npu.transfer.slices import plan_slices

    geometry = load_geometry(geometry_path)
    with open_case(geometry, chunks_for(geometry, load_mb), "cuda") as case:
        clock = Clock(case.layout.plan.device)
        sliced = plan_slices(case.layout, case.announced, slices)
        t_load = device_seconds(get_backend("cuda"), case.layout.plan, case, clock, 3)
        work = work_for(case.layout.plan.device, t_load / ratio / len(case.announced), clock, 4096,
                        (64, 256, 1024, 4096))
        for _ in range(3):
            pipelined(case, sliced, work, clock)  # cold: prepare, spare records
        alone_ms = [forward_alone(case, work, clock).ttft * 1e3 for _ in range(3)]
        ttft_ms = [pipelined(case, sliced, work, clock).ttft * 1e3 for _ in range(runs)]
        spans = profiled_spans(lambda: pipelined(case, sliced, work, clock))
    summaries = stream_summaries(spans)
    forward_stream = max(summaries, key=lambda s: s.spans).stream if summaries else -1
    return {"geometry": geometry_path.stem, "ratio": ratio, "slices": slices, "t_load_ms": t_load * 1e3,
            "matmul_rows": work.m, "matmuls_per_layer": work.reps, "forward_alone_ms": alone_ms, "ttft_ms": ttft_ms,
            "streams": [asdict(s) for s in summaries], "forward_stream": forward_stream,
            "forward_gaps_us": idle_gaps(spans, forward_stream, gap_us),
            "load_spans": [asdict(s) for s in spans if s.stream != forward_stream], "spans": [asdict(s) for s in spans]}


def render(result: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    head = Table(title=f"{result['geometry']} ratio {result['ratio']:g}, S = {result['slices']}: T_load "
                       f"{result['t_load_ms']:.2f} ms, {result['matmuls_per_layer']} matmuls of "
                       f"{result['matmul_rows']} rows per layer")
    for column in ("forward alone (ms)", "TTFT, unprofiled runs (ms)", "forward's idle gaps (at µs: µs)"):
        head.add_column(column)
    head.add_row(", ".join(f"{t:.2f}" for t in result["forward_alone_ms"]),
                 ", ".join(f"{t:.2f}" for t in result["ttft_ms"]),
                 ", ".join(f"{at:.0f}: {length:.0f}" for at, length in result["forward_gaps_us"]) or "none")
    load = Table(title="the load lane's stream, in order")
    for column in ("start (µs)", "duration (µs)", "what"):
        load.add_column(column)
    for span in result["load_spans"]:
        load.add_row(f"{span['start_us']:.0f}", f"{span['duration_us']:.1f}", span["name"][:70])
    return [head, load]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=Path, required=True)
    parser.add_argument("--ratio", type=float, nargs="+", default=[1.0], help="T_load / T_compute targets")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--load-mb", type=float, default=256.0)
    parser.add_argument("--runs", type=int, default=5, help="unprofiled runs beside the profiled one")
    parser.add_argument("--gap-us", type=float, default=20.0, help="idle stretches of the forward's stream to list")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("sliced_timeline profiles a CUDA device")
    results = [timeline(args.geometry, ratio, args.slices, args.load_mb, args.runs, args.gap_us)
               for ratio in args.ratio]
    console = Console()
    for result in results:
        for table in render(result):
            console.print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
