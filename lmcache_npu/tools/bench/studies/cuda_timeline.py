"""Where a CUDA transfer's time goes: the GPU timeline of one store and one load (table upload, zeroing, copies,
kernel, status read-back) from torch.profiler, next to a plain pinned copy of the same bytes. Prints a table per
(preset, chunks, direction) and can write JSON.

    python -m lmcache_npu.tools.bench.studies.cuda_timeline --presets llama3-8b deepseek-v3 deepseek-v4-flash \
        --chunks 1 8 --json t.json
    python -m lmcache_npu.tools.bench.studies.cuda_timeline --geometry lmcache_npu/tools/bench/geometries/*.json \
        --pipeline on off --no-timeline

A preset needs vLLM; where it is absent, pass `--geometry` files (the export_geometry study writes them).
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

from lmcache_npu.tools.bench.cuda_baselines import pinned_copy_gbps, queue_gpu_work
from lmcache_npu.tools.bench.geometry import load_geometry
from lmcache_npu.tools.bench.runner import materialize_source
from lmcache_npu.ops import ChunkBatch, Direction, get_backend


def _gpu_events(prof: "profile") -> list[dict]:
    """GPU-side activities (kernels, memcpys, memsets) in start order, times in µs."""
    events = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            events.append({"name": e.name, "start_us": e.time_range.start, "us": e.time_range.elapsed_us()})
    events.sort(key=lambda e: e["start_us"])
    return events


def timeline(backend: object, batch: ChunkBatch, repeats: int, profiled: bool = True, queued: bool = False) -> dict:
    """Best-of-`repeats` device window and host wall time, the phases of the best run, and the GPU timeline of one
    more run under the profiler. `queued`: each transfer is enqueued behind GPU work, as in serving, so the window
    holds GPU time only, not the host's enqueue latency."""
    walls, devices, phases = [], [], {}
    for _ in range(repeats):
        torch.cuda.synchronize()
        if queued:
            queue_gpu_work()
        start = time.perf_counter()
        stats = backend.transfer(batch)  # type: ignore[attr-defined]
        walls.append(time.perf_counter() - start)
        devices.append(stats.device_seconds or 0.0)
        if devices[-1] == min(devices):
            phases = backend.last_phases_ms()  # type: ignore[attr-defined]
    summary = {"wall_ms": min(walls) * 1e3, "device_ms": min(devices) * 1e3,
               "median_device_ms": sorted(devices)[len(devices) // 2] * 1e3, "phases_ms": phases, "events": []}
    if not profiled:
        return summary
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.transfer(batch)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    events = _gpu_events(prof)
    origin = events[0]["start_us"] if events else 0.0
    for e in events:
        e["start_us"] -= origin
    summary["events"] = events
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="*", default=["llama3-8b", "deepseek-v3", "deepseek-v4-flash"])
    parser.add_argument("--geometry", nargs="*", type=Path, default=[], help="geometry files instead of presets")
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device-family", default="ascend", choices=["ascend", "cuda"])
    parser.add_argument("--path", default="staging", choices=["auto", "mapped", "staging"])
    parser.add_argument("--pipeline", nargs="+", choices=["on", "off", "auto"], default=["auto"],
                        help="one row per choice (auto: the backend's own rule)")
    parser.add_argument("--piece-bytes", type=int)
    parser.add_argument("--store-first-slice-bytes", type=int)
    parser.add_argument("--store-slice-growth", type=int)
    parser.add_argument("--load-tail-bytes", type=int)
    parser.add_argument("--load-tail-share", type=int)
    parser.add_argument("--pipelined-blocks", type=int)
    parser.add_argument("--store-mapped-prefix-share", type=int, help="0: no mapped prefix")
    parser.add_argument("--load-mapped-prefix-share", type=int, help="0: no mapped prefix")
    parser.add_argument("--blocks", type=int, help="thread blocks per launch (default: the backend's per path)")
    parser.add_argument("--threads", type=int, help="threads per block")
    parser.add_argument("--no-timeline", action="store_true", help="ratios only, no profiler run per transfer")
    parser.add_argument("--queued", nargs="+", choices=["idle", "queued"], default=["idle"],
                        help="idle: each transfer starts on an idle GPU (the window holds the host's enqueue "
                             "latency); queued: behind 1 ms of GPU work, as in serving (GPU time only)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    slicing = {k: getattr(args, k) for k in ("piece_bytes", "store_first_slice_bytes", "store_slice_growth",
                                              "load_tail_bytes", "load_tail_share", "pipelined_blocks", "blocks",
                                              "threads", "store_mapped_prefix_share",
                                              "load_mapped_prefix_share")
               if getattr(args, k) is not None}
    backends = {choice: get_backend("cuda", path=args.path, pipeline=None if choice == "auto" else choice == "on",
                                    **slicing) for choice in args.pipeline}
    results = []
    summary = Table(title="x pinned copy (best of --repeats, same run)")
    for column in ("preset", "chunks", "direction", "start", "pipeline", "MB", "device ms", "to kernel / kernel / "
                   "after (µs)", "host wall ms", "pinned copy ms", "x pinned"):
        summary.add_column(column, justify="right")
    sources = [load_geometry(g) for g in args.geometry] if args.geometry else args.presets
    for preset in sources:
        for chunks in args.chunks:
            m, name = materialize_source(preset, chunks, torch.device("cuda"), device_family=args.device_family)
            objects = torch.zeros((chunks, m.plan.object_bytes), dtype=torch.uint8, pin_memory=True)
            for backend in backends.values():
                backend.prepare(m.plan)
            for direction in (Direction.STORE, Direction.LOAD):
                batch = ChunkBatch.build(m.plan, m.slots, objects, direction)
                for start in args.queued:
                    queued = start == "queued"
                    copy_ms = batch.payload_bytes / pinned_copy_gbps(batch.payload_bytes, direction, m.plan.device,
                                                                     args.repeats, queued) / 1e6
                    for choice, backend in backends.items():
                        backend.transfer(batch)  # warm-up
                        result = timeline(backend, batch, args.repeats, profiled=not args.no_timeline and not queued,
                                          queued=queued)
                        result.update(preset=name, chunks=chunks, direction=direction.name.lower(), pipeline=choice,
                                      start=start, pipelined=backend.pipelined(batch),
                                      mapped_prefix=backend.last_mapped_prefix,
                                      payload_bytes=batch.payload_bytes, pinned_copy_ms=copy_ms,
                                      ratio=copy_ms / result["device_ms"])
                        results.append(result)
                        phases = result["phases_ms"]
                        summary.add_row(name, str(chunks), direction.name.lower(), start,
                                        f"{choice} ({'on' if result['pipelined'] else 'off'})",
                                        f"{batch.payload_bytes / 1e6:.1f}", f"{result['device_ms']:.3f}",
                                        " / ".join(f"{phases.get(k, 0) * 1e3:.0f}"
                                                   for k in ("to_kernel", "kernel", "after_kernel")),
                                        f"{result['wall_ms']:.3f}", f"{copy_ms:.3f}", f"{result['ratio']:.3f}")
                        if not result["events"]:
                            continue
                        table = Table(title=f"{name}, {chunks} chunk(s), {direction.name.lower()}, pipeline "
                                            f"{choice}: {batch.payload_bytes / 1e6:.1f} MB; device "
                                            f"{result['device_ms']:.3f} ms, host wall {result['wall_ms']:.3f} ms, "
                                            f"pinned copy {copy_ms:.3f} ms (x{result['ratio']:.3f})")
                        for column in ("start (µs)", "duration (µs)", "GPU activity"):
                            table.add_column(column)
                        for e in result["events"]:
                            table.add_row(f"{e['start_us']:.1f}", f"{e['us']:.1f}", e["name"][:90])
                        console.print(table)
    console.print(summary)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
