"""Where a CUDA transfer's time goes: the GPU timeline of one store and one load (table upload, zeroing, copies,
kernel, status read-back) from torch.profiler, next to a plain pinned copy of the same bytes. Prints a table per
(preset, chunks, direction) and can write JSON.

    python benchmarks/cuda_timeline.py --presets llama3-8b deepseek-v3 deepseek-v4-flash --chunks 1 8 --json t.json

A preset needs vLLM; where it is absent, pass `--geometry` files (benchmarks/export_geometry.py writes them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from lmcache_npu.bench.geometry import load_geometry
from lmcache_npu.bench.runner import materialize_source
from lmcache_npu.ops import ChunkBatch, Direction, get_backend


def _gpu_events(prof: "profile") -> list[dict]:
    """GPU-side activities (kernels, memcpys, memsets) in start order, times in µs."""
    events = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            events.append({"name": e.name, "start_us": e.time_range.start, "us": e.time_range.elapsed_us()})
    events.sort(key=lambda e: e["start_us"])
    return events


def timeline(backend: object, batch: ChunkBatch, repeats: int) -> dict:
    """Best-of-`repeats` host wall time, and the GPU timeline of one more run under the profiler."""
    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = backend.transfer(batch)  # type: ignore[attr-defined]
        walls.append((time.perf_counter() - start, stats.device_seconds))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.transfer(batch)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    events = _gpu_events(prof)
    origin = events[0]["start_us"] if events else 0.0
    for e in events:
        e["start_us"] -= origin
    wall, device = min(walls)
    return {"wall_ms": wall * 1e3, "device_ms": (device or 0.0) * 1e3, "events": events}


def pinned_copy_ms(nbytes: int, direction: Direction, repeats: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        (host.copy_(dev, non_blocking=True) if direction == Direction.STORE else dev.copy_(host, non_blocking=True))
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="*", default=["llama3-8b", "deepseek-v3", "deepseek-v4-flash"])
    parser.add_argument("--geometry", nargs="*", type=Path, default=[], help="geometry files instead of presets")
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device-family", default="ascend", choices=["ascend", "cuda"])
    parser.add_argument("--path", default="staging", choices=["auto", "mapped", "staging"])
    parser.add_argument("--pipeline", choices=["on", "off"], default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    pipeline = None if args.pipeline is None else args.pipeline == "on"
    backend = get_backend("cuda", path=args.path, pipeline=pipeline)
    results = []
    sources = [load_geometry(g) for g in args.geometry] if args.geometry else args.presets
    for preset in sources:
        for chunks in args.chunks:
            m, name = materialize_source(preset, chunks, torch.device("cuda"), device_family=args.device_family)
            objects = torch.zeros((chunks, m.plan.object_bytes), dtype=torch.uint8, pin_memory=True)
            backend.prepare(m.plan)
            for direction in (Direction.STORE, Direction.LOAD):
                batch = ChunkBatch.build(m.plan, m.slots, objects, direction)
                backend.transfer(batch)  # warm-up
                result = timeline(backend, batch, args.repeats)
                copy_ms = pinned_copy_ms(batch.payload_bytes, direction, args.repeats)
                result.update(preset=name, chunks=chunks, direction=direction.name.lower(),
                              payload_bytes=batch.payload_bytes, pinned_copy_ms=copy_ms)
                results.append(result)
                table = Table(title=f"{name}, {chunks} chunk(s), {direction.name.lower()}: "
                                    f"{batch.payload_bytes / 1e6:.1f} MB; device {result['device_ms']:.3f} ms, "
                                    f"host wall {result['wall_ms']:.3f} ms, pinned copy {copy_ms:.3f} ms "
                                    f"(x{copy_ms / result['device_ms']:.3f})")
                for column in ("start (µs)", "duration (µs)", "GPU activity"):
                    table.add_column(column)
                for e in result["events"]:
                    table.add_row(f"{e['start_us']:.1f}", f"{e['us']:.1f}", e["name"][:90])
                console.print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
