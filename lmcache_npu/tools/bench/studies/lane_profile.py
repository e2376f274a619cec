"""Where the load lane's host time goes in a sliced load (issue 41): cProfile of `KVMover._execute` (slots, checks, launches, the finish) on the
lane's thread over repeated `run_sliced` loads of one geometry, with the layer_pipeline study's forward running
beside it (`--ratio`) or not. Prints the top functions by own and cumulative time."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lmcache_npu.ops import get_backend
from lmcache_npu.tools.bench.geometry import load_geometry
from lmcache_npu.tools.bench.studies.layer_pipeline import (Clock, Work, chunks_for, device_seconds, open_case,
                                                            pipelined, work_for)
from lmcache_npu.transfer.mover import KVMover
from lmcache_npu.transfer.slices import plan_slices


def profiled(function: Any, profile: cProfile.Profile) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        profile.enable()
        try:
            return function(*args, **kwargs)
        finally:
            profile.disable()
    return wrapper


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=Path, required=True)
    parser.add_argument("--load-mb", type=float, default=256.0)
    parser.add_argument("--slices", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.0, help="T_load / T_compute of the forward (0: none)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    backend = "cuda" if torch.cuda.is_available() else "host"
    geometry = load_geometry(args.geometry)
    with open_case(geometry, chunks_for(geometry, args.load_mb), backend) as case:
        device, clock = case.layout.plan.device, Clock(case.layout.plan.device)
        sliced = plan_slices(case.layout, case.announced, args.slices)
        work: Any = Work(device, 64, 4096 if backend == "cuda" else 64, 0)
        if args.ratio > 0:
            t_load = device_seconds(get_backend(backend), case.layout.plan, case, clock, 3)
            work = work_for(device, t_load / args.ratio / len(case.announced), clock, 4096, (64, 256, 1024, 4096))
        for _ in range(2):
            pipelined(case, sliced, work, clock)  # cold: prepare, spare records
        profile = cProfile.Profile()
        original = KVMover._execute
        KVMover._execute = profiled(original, profile)  # type: ignore[method-assign]
        try:
            runs = [pipelined(case, sliced, work, clock) for _ in range(args.runs)]
        finally:
            KVMover._execute = original  # type: ignore[method-assign]
        lane_ms = sorted(r.lane * 1e3 for r in runs)[len(runs) // 2]
        ttft_ms = sorted(r.ttft * 1e3 for r in runs)[len(runs) // 2]
        print(f"S={args.slices} ratio={args.ratio}: lane (run_sliced to last mark) {lane_ms:.2f} ms, TTFT "
              f"{ttft_ms:.2f} ms over {args.runs} runs")
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
