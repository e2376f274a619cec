"""Where a sliced load's host time goes (issue 41): cProfile of `run_sliced` on the caller's thread and of
`KVMover._execute` (slots, checks, launches, the finish) on the lane's thread over repeated loads of one geometry,
with the layer_pipeline study's forward running beside it (`--ratio`) or not. Prints the top functions by own and
cumulative time.

`--steps` times the load's steps with the wall clock instead (no profiler overhead): the `run_sliced` call, the
hand-off to the lane where the lane launches (not on CUDA: there the caller does), slice 0's copies ahead (CUDA),
slots and runs, batch checks, the work order and its tables, the enqueue, the native calls, and on CUDA the device's
view: `run_sliced` to the transfer's first event (before slice 0's copies), and from there to slice 0's kernel."""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from lmcache_npu.ops import ChunkBatch, Direction, get_backend
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


Timings = dict[str, list[float]]
_UNSET = object()


def _timed(function: Callable[..., Any], name: str, timings: Timings) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timings[name].append(time.perf_counter() - start)
    return wrapper


class _TimedNative:
    """The CUDA module with its `sliced_load` and `copy_ahead` calls timed; every other attribute passes through."""

    def __init__(self, inner: Any, timings: Timings) -> None:
        self._inner = inner
        self.sliced_load = _timed(inner.sliced_load, "native call", timings)
        self.copy_ahead = _timed(inner.copy_ahead, "  copy ahead: native call", timings)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def timed_steps(case: Any, timings: Timings) -> Iterator[list[Any]]:
    """The lane's steps timed into `timings` (ms lists by step) while inside; yields the device marks at each
    `run_sliced` entry (CUDA), read after each run."""
    mover, backend = case.mover, case.mover.backends[Direction.LOAD]
    entries: list[Any] = []
    entered: list[float] = []
    patches: list[tuple[Any, str, Any]] = []  # owner, name, what its own __dict__ held (_UNSET: nothing)

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, owner.__dict__.get(name, _UNSET)))
        setattr(owner, name, value)

    original_run, original_execute = mover.run_sliced, KVMover._execute

    def run_sliced(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            entries.append(mark)
        entered.append(time.perf_counter())
        try:
            return original_run(*args, **kwargs)
        finally:
            timings["run_sliced (caller)"].append(time.perf_counter() - entered[-1])

    def execute(self: KVMover, lane: Any, job: Any) -> Any:
        if entered and job.slicing is not None and job.launched is None:  # launched by the lane, not the caller
            timings["hand-off"].append(time.perf_counter() - entered[-1])
        return original_execute(self, lane, job)

    patch(mover, "run_sliced", run_sliced)
    patch(KVMover, "_execute", _timed(execute, "lane, whole", timings))
    patch(KVMover, "_cut_runs", _timed(KVMover._cut_runs, "slots and runs", timings))
    patch(ChunkBatch, "from_cut_runs",
          classmethod(_timed(ChunkBatch.from_cut_runs.__func__, "batch checks", timings)))
    if backend.name == "cuda":
        from lmcache_npu.ops.cuda import backend as cuda_backend

        planner = cuda_backend.planner
        patch(planner, "sliced_load_tables", _timed(planner.sliced_load_tables, "work order and tables", timings))
        patch(cuda_backend.CudaBackend, "_enqueue", _timed(cuda_backend.CudaBackend._enqueue, "enqueue", timings))
        patch(cuda_backend.CudaBackend, "copy_ahead", _timed(cuda_backend.CudaBackend.copy_ahead, "copy ahead",
                                                             timings))
        for owner, name in ((cuda_backend.CudaBackend, "_check_objects"), (cuda_backend.StagingBuffer, "claim"),
                            (cuda_backend.NativeResources, "tables"), (cuda_backend.NativeResources, "next_epoch"),
                            (cuda_backend.CudaBackend, "_spare_state")):
            patch(owner, name, _timed(getattr(owner, name), f"  enqueue: {name}", timings))
        patch(backend, "_cuda", _TimedNative(backend._cuda, timings))
    try:
        yield entries
    finally:
        for owner, name, value in reversed(patches):
            if value is _UNSET:
                delattr(owner, name)  # it was found on the class: the instance's patch goes
            else:
                setattr(owner, name, value)


def steps(case: Any, sliced: Any, work: Any, clock: Clock, runs: int, prelude: float = 0.0) -> Timings:
    """Median-ready step timings (seconds) over `runs` sliced loads; on CUDA also the device's view of the start."""
    timings: Timings = defaultdict(list)
    with timed_steps(case, timings) as entries:
        for _ in range(runs):
            run = pipelined(case, sliced, work, clock, prelude=prelude)
            timings["lane to slice 0 mark"].append(run.lane_first)
            timings["TTFT"].append(run.ttft)
            backend = case.mover.backends[Direction.LOAD]
            state = getattr(backend, "_last_state", None)
            if entries and state is not None:
                from lmcache_npu.ops.cuda.native import TransferEvent

                first = state.events[TransferEvent.FIRST]
                timings["device: run_sliced to first copy"].append(
                    backend._cuda.event_elapsed_ms(entries[-1].cuda_event, first) / 1e3)
                timings["device: first copy to slice 0 kernel"].append(
                    state.elapsed_ms(TransferEvent.FIRST, TransferEvent.KERNEL_BEGIN) / 1e3)
    return timings


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=Path, required=True)
    parser.add_argument("--load-mb", type=float, default=256.0)
    parser.add_argument("--slices", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.0, help="T_load / T_compute of the forward (0: none)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--steps", action="store_true", help="wall-clock step times instead of cProfile")
    parser.add_argument("--prelude-ms", type=float, default=0.0,
                        help="the model's thread spins this long between the sync and each load (an engine's input "
                             "preparation)")
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
        if args.steps:
            print(f"S={args.slices} ratio={args.ratio} prelude={args.prelude_ms} ms, median of {args.runs} sliced loads (ms):")
            for name, values in steps(case, sliced, work, clock, args.runs, args.prelude_ms / 1e3).items():
                print(f"  {name:40s} {statistics.median(values) * 1e3:8.3f}")
            return 0
        profile = cProfile.Profile()
        original, mover = KVMover._execute, case.mover
        KVMover._execute = profiled(original, profile)  # type: ignore[method-assign]
        mover.run_sliced = profiled(mover.run_sliced, profile)  # the caller launches where the backend can (CUDA)
        try:
            runs = [pipelined(case, sliced, work, clock, prelude=args.prelude_ms / 1e3) for _ in range(args.runs)]
        finally:
            KVMover._execute = original  # type: ignore[method-assign]
            del mover.run_sliced  # the instance's patch goes: the class's method is found again
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
