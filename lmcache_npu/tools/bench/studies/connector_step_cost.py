"""The connector's per-step CPU on the scheduler/model thread: build_connector_meta and both stats calls, timed
over vLLM's real Scheduler (the simulated engine of tests/integration/engine.py) during a multi-turn replay.

    .venv/bin/python -m lmcache_npu.tools.bench.studies.connector_step_cost \
        [--conversations 8] [--turns 8] [--repeats 3] [--profile]

Prints µs per call (median and mean over every step) for each hook; --profile adds cProfile's top entries of
build_connector_meta.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

# the simulated engine lives in the repository's tests/, so this study runs from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests.integration.conftest import PRESET_ENGINES, prompt  # noqa: E402
from tests.integration.engine import Engine, EngineSpec  # noqa: E402


def timed(fn: Callable[..., Any], sink: list[int], profiler: Any = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter_ns() - start)
            if profiler is not None:
                profiler.disable()
    return wrapper


def replay(conversations: int, turns: int, seed: int, profiler: Any) -> dict[str, list[int]]:
    settings = dict(PRESET_ENGINES[("llama3-8b", "ascend")])
    extra = {**settings.pop("extra_config", {}), "cpu_bytes": "1GiB"}
    engine = Engine(EngineSpec(**{**settings, "num_blocks": 512, "max_num_seqs": 8, "check_every_step": False,
                                  "extra_config": extra}))
    times: dict[str, list[int]] = {"build_connector_meta": [], "scheduler stats": [], "worker stats": []}
    engine._build_meta = timed(engine._build_meta, times["build_connector_meta"], profiler)
    engine.connector.get_kv_connector_stats = timed(engine.connector.get_kv_connector_stats,
                                                    times["scheduler stats"])
    for worker in engine.workers:
        worker.get_kv_connector_stats = timed(worker.get_kv_connector_stats, times["worker stats"])
    history = [prompt(600, seed=seed * 1000 + c) for c in range(conversations)]
    try:
        for turn in range(turns):
            ids = []
            for c in range(conversations):
                history[c] = history[c] + prompt(200, seed=seed * 1000 + 100 * turn + c + 50)
                ids.append(engine.add(history[c], max_tokens=64))
            engine.run(max_steps=20000)
            for c, request_id in enumerate(ids):
                history[c] = history[c] + engine.output_tokens(request_id)
            if turn % 2:
                engine.evict_device_cache()  # later turns load from the connector
    finally:
        engine.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    profiler = cProfile.Profile() if args.profile else None
    total: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name, values in replay(args.conversations, args.turns, repeat, profiler).items():
            total.setdefault(name, []).extend(values)
    for name, values in total.items():
        us = [v / 1000 for v in values]
        print(f"{name:22s} calls {len(us):6d}  median {statistics.median(us):8.1f} us  mean {statistics.mean(us):8.1f} us"
              f"  p90 {sorted(us)[int(len(us) * 0.9)]:8.1f} us")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
