"""Where the plugin's time goes when nothing can hit (issue 22 item 5): the replay's in-process engine serves the same
fresh random prompts without and with the plugin, and the plugin's run is profiled.

Two views, because the plugin works on two kinds of thread:
- the engine's own thread: every call vLLM makes into the plugin (scheduler lookups, allocation updates, metadata,
  the worker's load/save hooks), each charged with everything it calls; by cProfile on the thread's CPU clock
  (default: where the time goes inside), or with `--timers` by a wall clock around each call of the connector class
  only (a profiler's per-call cost inflates hooks of a few microseconds several times; the timers do not);
- the plugin's own threads (its transfer lanes, disk writers): CPU seconds from /proc, which on a small machine are
  taken from the model's threads.

    python -m lmcache_npu.tools.servebench.overhead_profile --prompts 32 --rounds 3 --json profile.json
    python -m lmcache_npu.tools.servebench.overhead_profile --prompts 16 --rounds 3 --batch 1 --no-baseline --timers

Needs a real vLLM engine (.venv-vllm-0.32.0). Timings on a loaded machine are noisy; the breakdown's shares less so.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import inspect
import json
import logging
import os
import pstats
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # lmcache_npu/: calls into it from outside are entries
# the measuring harness lives in the package too but is not the plugin: calls from it count as outside
HARNESS_DIRS = tuple(os.path.join(PACKAGE_DIR, d) for d in ("replay", "servebench"))
STEP_ENTRY = "integration/vllm/connector.py:build_connector_meta"  # vLLM calls it once per scheduler step
FIRST_ID = 4  # the word tokenizer's first ordinary id; the engine gets token ids, so any id above works


def _in_package(filename: str, package_dir: str, harness: Sequence[str] = ()) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(package_dir + os.sep) and not any(path.startswith(h + os.sep) for h in harness)


@dataclass(frozen=True)
class Entry:
    """One entry point's calls from outside the package and the time they took (callees included)."""

    seconds: float
    calls: int


def entries(stats: pstats.Stats, package_dir: str = PACKAGE_DIR,
            harness: Sequence[str] = HARNESS_DIRS) -> dict[str, Entry]:
    """Time spent in the package per entry point: for every function of `package_dir` (less the `harness` folders,
    which count as outside) called from outside it, the cumulative time of those outside calls (callees included,
    calls from inside the package not counted twice; calls through a builtin are taken as the package's own). Keys
    are "file.py:function"; the time is whatever clock the profiler ran on."""
    raw: Mapping[Any, Any] = stats.stats  # type: ignore[attr-defined]
    found: dict[str, Entry] = {}
    for (filename, _, function), (_, calls, _, cumulative, callers) in raw.items():
        if not _in_package(filename, package_dir, harness):
            continue
        # what is left after the package's own calls: outside callers, and frames begun before profiling started
        # (cProfile lists no caller for those); a builtin caller ("~": sum, map, ...) sits under whoever called it,
        # most likely the package itself
        own = [timing for (caller_file, _, _), timing in callers.items()
               if caller_file == "~" or _in_package(caller_file, package_dir, harness)]
        outside = cumulative - sum(timing[3] for timing in own)
        if outside > 1e-9:  # float leftovers of a function only the package calls
            key = f"{os.path.relpath(filename, package_dir)}:{function}"
            before = found.get(key, Entry(0.0, 0))
            found[key] = Entry(before.seconds + outside, before.calls + calls - sum(timing[1] for timing in own))
    return found


class HookTimers:
    """Within the block, every public method of `cls` (both connector halves' entry points) adds its call's wall
    time, callees included, under the cProfile key "file.py:function"; restored on exit."""

    def __init__(self, cls: type, package_dir: str = PACKAGE_DIR) -> None:
        self.cls = cls
        self.prefix = os.path.relpath(inspect.getsourcefile(cls) or "", package_dir)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Any] = {}
        self._lock = threading.Lock()  # hooks may run on several threads (a scheduler and a worker in one process)

    def _timed(self, name: str, method: Any) -> Any:
        key = f"{self.prefix}:{name}"

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                with self._lock:
                    self.seconds[key] = self.seconds.get(key, 0.0) + took
                    self.calls[key] = self.calls.get(key, 0) + 1
        return timed

    def __enter__(self) -> "HookTimers":
        for name, member in vars(self.cls).items():
            if not name.startswith("_") and inspect.isfunction(member):  # instance methods; class hooks run rarely
                self._saved[name] = member
                setattr(self.cls, name, self._timed(name, member))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, member in self._saved.items():
            setattr(self.cls, name, member)
        self._saved = {}


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) each live Python thread of this process has used, by thread name."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        # after the ")" that closes the command name: state is field 0, utime field 11, stime field 12
        found[thread.name] = found.get(thread.name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return found


def process_cpu_seconds() -> float:
    """CPU seconds every thread of this process has used (the model's OpenMP threads included)."""
    usage = os.times()
    return usage.user + usage.system


@dataclass
class RunProfile:
    """One configuration's rounds: wall seconds per round, CPU seconds, and (plugin) where its time went."""

    name: str
    round_wall_s: list[float] = field(default_factory=list)
    process_cpu_s: float = 0.0
    entries_s: dict[str, float] = field(default_factory=dict)  # engine thread seconds, per plugin entry point
    entry_calls: dict[str, int] = field(default_factory=dict)
    plugin_threads_cpu_s: dict[str, float] = field(default_factory=dict)  # the plugin's own threads
    clock: str = "CPU"  # what entries_s counts: the engine thread's CPU (cProfile) or wall time (timers)

    @property
    def wall_s(self) -> float:
        return sum(self.round_wall_s)


def random_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `tokens` fresh random ids each (what `vllm bench serve --dataset-name random` sends)."""
    if count < 1 or tokens < 1 or vocab <= FIRST_ID:
        raise ValueError(f"random prompts need count >= 1, tokens >= 1 and a vocabulary above {FIRST_ID}, got "
                         f"{count}, {tokens}, {vocab}")
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(tokens)] for _ in range(count)]


def _run(name: str, engine: Any, rounds: Sequence[Sequence[Sequence[int]]], batch: int, output_tokens: int,
         profile: Optional[str], pstats_path: Optional[Path] = None) -> RunProfile:
    """`profile`: None, "cprofile" or "timers" (HookTimers around the connector class)."""
    result = RunProfile(name, clock="wall" if profile == "timers" else "CPU")
    # the engine thread's own CPU clock: time other processes take from it is not charged to the plugin
    profiler = cProfile.Profile(time.thread_time) if profile == "cprofile" else None
    timers = None
    if profile == "timers":
        from ...integration.vllm.connector import LMCacheNPUConnector

        timers = HookTimers(LMCacheNPUConnector)
    own_before = {k: v for k, v in thread_cpu_seconds().items() if k.startswith("lmcache")}
    cpu_before = process_cpu_seconds()
    with timers if timers is not None else contextlib.nullcontext():
        for prompts in rounds:
            started = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for at in range(0, len(prompts), batch):
                engine.generate(prompts[at:at + batch], output_tokens)
            if profiler is not None:
                profiler.disable()
            result.round_wall_s.append(time.perf_counter() - started)
    if timers is not None:
        result.entries_s, result.entry_calls = dict(timers.seconds), dict(timers.calls)
    result.process_cpu_s = process_cpu_seconds() - cpu_before
    own_after = {k: v for k, v in thread_cpu_seconds().items() if k.startswith("lmcache")}
    result.plugin_threads_cpu_s = {k: v - own_before.get(k, 0.0) for k, v in own_after.items()
                                   if v - own_before.get(k, 0.0) > 0}
    if profiler is not None:
        found = entries(pstats.Stats(profiler))
        result.entries_s = {k: e.seconds for k, e in found.items()}
        result.entry_calls = {k: e.calls for k, e in found.items()}
        if pstats_path is not None:  # the whole profile, for `python -m pstats` or snakeviz
            profiler.dump_stats(str(pstats_path))
    return result


def profile_overhead(model: str, prompts: int, rounds: int, input_tokens: int, output_tokens: int, batch: int,
                     cpu_bytes: str, seed: int, baseline: bool = True,
                     pstats_path: Optional[Path] = None, profile: str = "cprofile") -> list[RunProfile]:
    """vLLM alone (unless not `baseline`), then vLLM with the plugin, each on a fresh in-process engine over the same
    rounds of fresh random prompts (a warm-up round of other prompts first); the plugin's run is profiled
    (`profile`: "cprofile" or "timers")."""
    from ..replay.engine import Engine, EngineSettings
    from ..replay.models import VOCAB, make_model, model_vocab, resolve_recipe
    from ..replay.sizing import kv_bytes_per_token

    recipe = resolve_recipe(model)
    model_dir = str(make_model(recipe))
    vocab = model_vocab(model_dir, VOCAB)
    max_model_len = -(-(input_tokens + output_tokens) // 256) * 256
    # a device KV of a few requests, as bench-serve's offload regime has: the store path runs at its real rate
    kv_bytes = 4 * max_model_len * kv_bytes_per_token(model_dir, recipe.dtype)
    warm = random_prompts(batch, input_tokens, vocab, seed + 1_000_003)
    measured = [random_prompts(prompts, input_tokens, vocab, seed + r) for r in range(rounds)]
    found = []
    for plugin in (False, True) if baseline else (True,):
        name = "vLLM + lmcache-npu" if plugin else "vLLM alone"
        settings = EngineSettings.for_recipe(recipe, model_dir, plugin=plugin, extra_config={"cpu_bytes": cpu_bytes},
                                             prefix_caching=True, max_model_len=max_model_len,
                                             kv_cache_memory_bytes=kv_bytes, max_num_seqs=16, seed=seed)
        with Engine(settings) as engine:
            engine.generate(warm, output_tokens)
            found.append(_run(name, engine, measured, batch, output_tokens, profile=profile if plugin else None,
                              pstats_path=pstats_path if plugin else None))
        logger.info("%s: %.2f s over %d rounds", name, found[-1].wall_s, rounds)
    return found


def render(runs: Sequence[RunProfile], top: int = 12) -> list[str]:
    """Plain lines: wall and CPU per configuration, the plugin's engine-thread entries, its own threads."""
    lines = [f"{'configuration':<22} {'wall s':>8} {'per round s':>28} {'process CPU s':>14}"]
    for run in runs:
        rounds = " ".join(f"{w:.2f}" for w in run.round_wall_s)
        lines.append(f"{run.name:<22} {run.wall_s:8.2f} {rounds:>28} {run.process_cpu_s:14.2f}")
    base = runs[0].wall_s if len(runs) > 1 else 0.0
    for run in [r for r in runs if r.entries_s or r.plugin_threads_cpu_s]:
        engine_thread = sum(run.entries_s.values())
        own = sum(run.plugin_threads_cpu_s.values())
        lines.append("")
        against = (f"wall {run.wall_s - base:+.2f} s against {runs[0].name} ({(run.wall_s - base) / base * 100:+.1f}%)"
                   if base else f"wall {run.wall_s:.2f} s")
        steps = run.entry_calls.get(STEP_ENTRY, 0)
        per_step = f", {engine_thread / steps * 1000:.3f} ms per scheduler step ({steps} steps)" if steps else ""
        lines.append(f"{run.name}: {against}; engine thread in the plugin {engine_thread:.3f} {run.clock} s "
                     f"({engine_thread / run.wall_s * 100 if run.wall_s else 0.0:.2f}% of wall{per_step}); "
                     f"the plugin's own threads {own:.3f} CPU s")
        lines.append(f"  {'entry point (engine thread)':<58} {'calls':>7} {run.clock + ' s':>8} {'us/call':>9} "
                     f"{'% of wall':>10}")
        for key, seconds in sorted(run.entries_s.items(), key=lambda kv: -kv[1])[:top]:
            calls = run.entry_calls.get(key, 0)
            per_call = f"{seconds / calls * 1e6:9.1f}" if calls else f"{'-':>9}"
            lines.append(f"  {key:<58} {calls:7d} {seconds:8.3f} {per_call} "
                         f"{seconds / run.wall_s * 100 if run.wall_s else 0.0:9.2f}%")
        for key, seconds in sorted(run.plugin_threads_cpu_s.items(), key=lambda kv: -kv[1]):
            lines.append(f"  thread {key:<57} {seconds:8.3f} CPU s")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_npu.tools.servebench.overhead_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-demo")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="prompts submitted together (bench-serve's concurrency)")
    parser.add_argument("--cpu-bytes", default="1GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="profile the plugin's run only")
    parser.add_argument("--pstats", type=Path, help="also dump the plugin run's whole cProfile here")
    parser.add_argument("--timers", action="store_true",
                        help="time each call into the connector with a wall clock instead of profiling")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be >= 1")
    if args.timers and args.pstats is not None:
        parser.error("--pstats needs the profiler: leave out --timers")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = profile_overhead(args.model, args.prompts, args.rounds, args.input_tokens, args.output_tokens, args.batch,
                            args.cpu_bytes, args.seed, baseline=not args.no_baseline, pstats_path=args.pstats,
                            profile="timers" if args.timers else "cprofile")
    sys.stdout.write("\n".join(render(runs)) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
