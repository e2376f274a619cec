"""Tier-speed sweep (issue 40 item 5): time to first token per load policy against the disk tier's read bandwidth,
on a real vLLM CPU engine, with a per-request oracle and the cost model's regret.

Every point is a fresh engine over one multi-turn chat: `recompute` (vLLM alone: the plugin off), `arena only` (the
plugin without a disk tier) and, at each bandwidth, `load-all` (every hit loaded, every promotion waited for) and
`cost-model` (the default). The plugin's arena holds a few chunks, so later turns' hits come from the disk tier, whose
reads a study-only throttle (`ReadThrottle`, wrapped around the in-process worker's disk tier: users have no such
setting) holds to the bandwidth. vLLM's own prefix cache is off in every run, so every hit is the plugin's. The
per-request oracle takes, per request, the faster of its recompute and load-all TTFTs (each request measured both
ways); the regret is the cost model's mean TTFT over the oracle's, minus one. That oracle is no policy anyone can
run: on a batched engine a request's TTFT is mostly its place in its wave, which differs between runs. The per-wave
bound is one: per turn, the whole wave served by whichever of recompute, arena only and load-all served that turn
fastest (a policy that knows, per wave, which fixed policy wins); the wave regret is against it. The crossover is the bandwidth where load-all's
mean TTFT meets recompute's (interpolated in log bandwidth); the slow-tier cost is the cost model's TTFT p50 and p99
against the arena-only plugin's.

    PYTHONHASHSEED=20261127 .venv-vllm-0.32.0/bin/python -m lmcache_npu.tools.bench.studies.tier_sweep \\
        --json tier_sweep.json --plot docs/img/tier_sweep.png          # ~15 minutes on the 2-core VM
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from ...replay.spread import percentile

logger = logging.getLogger(__name__)

RECOMPUTE, ARENA_ONLY, LOAD_ALL, COST_MODEL = "recompute", "arena only", "load-all", "cost-model"
WAVE_BOUND = "per-wave bound"  # per turn, the fastest of the fixed policies (recompute, arena only, load-all)
RECOMPUTE_AGAIN = "recompute again"  # the noise control: the oracle of two identical runs is below both by noise alone
SWEPT = (LOAD_ALL, COST_MODEL)  # the policies run at every bandwidth
# straddles the crossover of the demo model on a CPU engine (~18 ms to compute a 128-token chunk of 0.75 MiB: loading
# pays above ~0.05 GB/s); an accelerator computes 10-100x faster, so its crossover sits that much higher
DEFAULT_GBPS = (0.005, 0.015, 0.05, 0.15, 0.5, 5.0)
RequestTimes = Mapping[tuple[int, int], float]  # (turn, conversation) -> TTFT seconds


class ReadThrottle:
    """One channel of `bytes_per_s` shared by every reader thread: a read returns once the channel has carried its
    bytes after every read before it (a token bucket of no burst), so parallel readers do not multiply the rate."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a read throttle needs bytes_per_s > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the channel has carried every read so far

    def wait(self, nbytes: int, now: Optional[Callable[[], float]] = None,
             sleep: Callable[[float], None] = time.sleep) -> float:
        """Blocks until `nbytes` more have gone through the channel; returns the seconds waited."""
        clock = now or time.monotonic
        with self._lock:
            start = max(clock(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            done = self._free_at
        waited = max(done - clock(), 0.0)
        if waited:
            sleep(waited)
        return waited

    def wrap(self, read_into: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
        """A disk tier's `read_into(name, out)` whose bytes go through this channel."""

        def throttled(name: str, out: Any) -> Any:
            result = read_into(name, out)
            self.wait(memoryview(out).nbytes)
            return result

        return throttled


@dataclass(frozen=True)
class Point:
    """One policy at one bandwidth (0 where the bandwidth does not apply), over the requests of turns 2 on."""

    policy: str
    gbps: float
    mean_s: float
    p50_s: float
    p99_s: float
    requests: int
    loaded_tokens: int = 0


def point(policy: str, gbps: float, times: RequestTimes, loaded_tokens: int = 0) -> Point:
    """The point of one run: turn 1 (nothing to hit) is left out."""
    values = [t for (turn, _), t in times.items() if turn > 0]
    if not values:
        raise ValueError(f"{policy} at {gbps} GB/s: no request after the first turn")
    return Point(policy, gbps, statistics.fmean(values), percentile(values, 50), percentile(values, 99), len(values),
                 loaded_tokens)


def oracle(recompute: RequestTimes, load_all: RequestTimes) -> dict[tuple[int, int], float]:
    """Per request, the faster of its two measured TTFTs."""
    if set(recompute) != set(load_all):
        raise ValueError("the oracle needs the same requests measured both ways")
    return {request: min(recompute[request], load_all[request]) for request in recompute}


def wave_bound(candidates: Sequence[RequestTimes]) -> dict[tuple[int, int], float]:
    """Per turn, every request's TTFT from the candidate run whose mean over that turn is the lowest (the best fixed
    policy chosen per wave, which a policy could run)."""
    if not candidates or any(set(c) != set(candidates[0]) for c in candidates):
        raise ValueError("the wave bound needs the same requests measured in every candidate run")
    chosen: dict[tuple[int, int], float] = {}
    for turn in sorted({turn for turn, _ in candidates[0]}):
        requests = [r for r in candidates[0] if r[0] == turn]
        best = min(candidates, key=lambda run: statistics.fmean(run[r] for r in requests))
        chosen.update((r, best[r]) for r in requests)
    return chosen


def crossover(gbps: Sequence[float], load_all_s: Sequence[float], recompute_s: float) -> Optional[float]:
    """The bandwidth where load-all's mean TTFT first drops below recompute's, interpolated in log bandwidth (None:
    it never crosses within the sweep)."""
    pairs = sorted(zip(gbps, load_all_s))
    for (g0, t0), (g1, t1) in zip(pairs, pairs[1:]):
        if t0 >= recompute_s > t1:
            share = (t0 - recompute_s) / (t0 - t1)
            return math.exp(math.log(g0) + share * (math.log(g1) - math.log(g0)))
    return None


@dataclass(frozen=True)
class Summary:
    points: list[Point]
    regret: dict[float, float]  # bandwidth -> cost model's mean TTFT / the oracle's - 1
    gain: dict[float, float]  # bandwidth -> 1 - cost model's mean TTFT / the better of load-all and recompute
    slow_tier_p50: dict[float, float]  # bandwidth -> cost model's p50 / the arena-only plugin's - 1
    slow_tier_p99: dict[float, float]
    crossover_gbps: Optional[float]
    noise_floor: Optional[float] = None  # recompute's mean TTFT over the oracle of two recompute runs, minus one
    wave_regret: Optional[dict[float, float]] = None  # bandwidth -> cost model's mean TTFT / the wave bound's - 1


def summarize(runs: Mapping[tuple[str, float], RequestTimes], loaded: Optional[Mapping[tuple[str, float], int]] = None
              ) -> Summary:
    """From every run's per-request TTFTs (keyed by (policy, GB/s); recompute and arena only at 0 GB/s)."""
    loaded = loaded or {}
    of = {run: point(*run, times, loaded.get(run, 0)) for run, times in runs.items()}
    points = list(of.values())
    recompute = runs[(RECOMPUTE, 0.0)]
    base = of[(RECOMPUTE, 0.0)]
    arena = of.get((ARENA_ONLY, 0.0))
    bandwidths = sorted({g for (p, g) in runs if p in SWEPT})
    regret, gain, p50, p99, wave_regret = {}, {}, {}, {}, {}
    for gbps in bandwidths:
        best = point("oracle", gbps, oracle(recompute, runs[(LOAD_ALL, gbps)]))
        points.append(best)
        fixed = [recompute, runs[(LOAD_ALL, gbps)]] + ([runs[(ARENA_ONLY, 0.0)]] if arena is not None else [])
        wave = point(WAVE_BOUND, gbps, wave_bound(fixed))
        points.append(wave)
        model, load_all = of[(COST_MODEL, gbps)], of[(LOAD_ALL, gbps)]
        regret[gbps] = model.mean_s / best.mean_s - 1
        wave_regret[gbps] = model.mean_s / wave.mean_s - 1
        gain[gbps] = 1 - model.mean_s / min(load_all.mean_s, base.mean_s)
        if arena is not None:
            p50[gbps], p99[gbps] = model.p50_s / arena.p50_s - 1, model.p99_s / arena.p99_s - 1
    curve = [of[(LOAD_ALL, g)].mean_s for g in bandwidths]
    noise = None
    if (RECOMPUTE_AGAIN, 0.0) in runs:  # a per-request min of two runs of one policy: what noise alone gives
        twice = point("oracle", 0.0, oracle(recompute, runs[(RECOMPUTE_AGAIN, 0.0)]))
        noise = min(base.mean_s, of[(RECOMPUTE_AGAIN, 0.0)].mean_s) / twice.mean_s - 1
    return Summary(points, regret, gain, p50, p99, crossover(bandwidths, curve, base.mean_s), noise, wave_regret)


def render(summary: Summary) -> Any:
    from rich.table import Table

    table = Table(title="TTFT of turns 2 on against the disk tier's read bandwidth (mean / p50 / p99, ms)",
                  title_justify="left")
    table.add_column("GB/s", justify="right")
    for name in (RECOMPUTE, ARENA_ONLY, LOAD_ALL, COST_MODEL, WAVE_BOUND, "oracle"):
        table.add_column(name, justify="right")
    table.add_column("regret: wave / request", justify="right")
    table.add_column("vs better of load-all, recompute", justify="right")
    by = {(p.policy, p.gbps): p for p in summary.points}

    def cell(policy: str, gbps: float) -> str:
        p = by.get((policy, gbps))
        return "-" if p is None else f"{p.mean_s * 1e3:.0f} / {p.p50_s * 1e3:.0f} / {p.p99_s * 1e3:.0f}"

    for gbps in sorted(summary.regret):
        wave = (summary.wave_regret or {}).get(gbps)
        table.add_row(f"{gbps:g}", cell(RECOMPUTE, 0.0), cell(ARENA_ONLY, 0.0), cell(LOAD_ALL, gbps),
                      cell(COST_MODEL, gbps), cell(WAVE_BOUND, gbps), cell("oracle", gbps),
                      f"{'-' if wave is None else f'{wave:+.1%}'} / {summary.regret[gbps]:+.1%}",
                      f"{summary.gain[gbps]:+.1%}")
    return table


def plot(summary: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bandwidths = sorted(summary.regret)
    by = {(p.policy, p.gbps): p for p in summary.points}
    for policy, style in ((LOAD_ALL, "o-"), (COST_MODEL, "s-"), (WAVE_BOUND, "k-."), ("oracle", "k:")):
        ax.plot(bandwidths, [by[(policy, g)].mean_s * 1e3 for g in bandwidths], style, label=policy)
    for policy, style in ((RECOMPUTE, "r--"), (ARENA_ONLY, "g--")):
        if (policy, 0.0) in by:
            ax.axhline(by[(policy, 0.0)].mean_s * 1e3, linestyle=style[1:], color=style[0], label=policy)
    if summary.crossover_gbps is not None:
        ax.axvline(summary.crossover_gbps, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("disk read bandwidth (GB/s, throttled)")
    ax.set_ylabel("mean TTFT, turns 2 on (ms)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---- the runs (a real vLLM engine) -----------------------------------------------------------------------------

def _request_times(result: Any) -> dict[tuple[int, int], float]:
    return {(turn.turn, conversation): completion.ttft_s
            for turn in result.turns for conversation, completion in zip(turn.conversations, turn.completions)}


# what each plugin run's JSON keeps of its index's counters, beside its hit tokens by tier
COUNTERS = ("promotions_disk", "persists", "spills", "cost_declined_disk_writes", "evicted_lost")


def run_sweep(args: argparse.Namespace, on_phase: Callable[[str], None]) -> tuple[dict, dict, dict]:
    from ...replay.accounting import TIERS
    from ...replay.configs import BASELINE, PLUGIN, PLUGIN_CONNECTOR, RunConfig
    from ...replay.engine import EngineSettings
    from ...replay.models import VOCAB, make_model, model_vocab, resolve_recipe
    from ...replay.runs import start_engine, timed_run
    from ...replay.sizing import longest_request_tokens
    from ...replay.workload import multi_turn_chat

    recipe = resolve_recipe(args.model)
    model_dir = str(make_model(recipe))
    vocab = model_vocab(model_dir, VOCAB)
    conversations = multi_turn_chat(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                    args.output_tokens, vocab, seed=args.seed)
    settings = EngineSettings.for_recipe(recipe, model_dir, prefix_caching=False,
                                         max_model_len=-(-longest_request_tokens(conversations) // 256) * 256)
    plan = [(RECOMPUTE, 0.0), (ARENA_ONLY, 0.0)] + [(p, g) for g in args.gbps for p in SWEPT] + [(RECOMPUTE_AGAIN, 0.0)]
    runs: dict[tuple[str, float], dict] = {}
    loaded: dict[tuple[str, float], int] = {}
    counters: dict[tuple[str, float], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="lmcache-npu-tier-sweep-") as scratch:
        for number, (policy, gbps) in enumerate(plan, 1):
            on_phase(f"run {number}/{len(plan)}: {policy}" + (f" at {gbps:g} GB/s" if gbps else ""))
            extra: dict[str, Any] = {"cpu_bytes": args.arena_bytes, "load_policy": LOAD_ALL if policy == LOAD_ALL
                                     else COST_MODEL}
            if policy in SWEPT:
                extra.update(disk_path=os.path.join(scratch, f"run-{number}"), disk_bytes="4GiB",
                             disk_write_through=True)
            config = (RunConfig(BASELINE) if policy in (RECOMPUTE, RECOMPUTE_AGAIN)
                      else RunConfig(PLUGIN, PLUGIN_CONNECTOR, extra))
            engine = start_engine(settings, config, extra if config.plugin else None)
            try:
                if policy in SWEPT:
                    disk = engine.worker_connector.worker_half.executor.disk
                    disk.read_into = ReadThrottle(gbps * 1e9).wrap(disk.read_into)
                result = timed_run(engine, config, 0, 0, conversations, vocab)
                hits = result.total_hits().by_source()
                if config.plugin:
                    stats = engine.plugin_stats()
                    counters[(policy, gbps)] = {**{k: float(stats.get(k, 0)) for k in COUNTERS},
                                                **{f"{tier}_hit_tokens": float(hits[tier]) for tier in TIERS}}
            finally:
                engine.close()
            runs[(policy, gbps)] = _request_times(result)
            loaded[(policy, gbps)] = int(sum(hits[tier] for tier in TIERS))
    return runs, loaded, counters


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gbps", type=float, nargs="+", default=list(DEFAULT_GBPS))
    parser.add_argument("--model", default="gemma3-demo")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--arena-bytes", default="16MiB", help="the plugin's host arena: a few chunks, so hits come "
                                                              "from the disk tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--log-file", type=Path, default=Path("build/tier_sweep.log"))
    args = parser.parse_args(argv)
    if any(not g > 0 for g in args.gbps):
        raise SystemExit(f"--gbps: every bandwidth must be > 0, got {args.gbps}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("PYTHONHASHSEED", "20261127")  # disk-tier chunk keys (vLLM reads it)
    from rich.console import Console

    from ...run_log import RunLog

    started = time.perf_counter()
    with RunLog(args.log_file, until_exit=True) as run_log:
        console = Console(file=run_log.console_out)
        console.print(f"engines' output: {args.log_file}")
        runs, loaded, counters = run_sweep(args, lambda text: console.log(text))
        summary = summarize(runs, loaded)
        crossing = summary.crossover_gbps
        if args.json:  # first: the runs are what took the time
            args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()},
                                             "points": [asdict(p) for p in summary.points],
                                             "regret": summary.regret, "wave_regret": summary.wave_regret,
                                             "gain": summary.gain,
                                             "slow_tier_p50": summary.slow_tier_p50,
                                             "slow_tier_p99": summary.slow_tier_p99,
                                             "crossover_gbps": crossing, "noise_floor": summary.noise_floor,
                                             "counters": {f"{p}@{g:g}": c for (p, g), c in counters.items()},
                                             "requests": {f"{p}@{g:g}": {f"{t}/{c}": s for (t, c), s in times.items()}
                                                          for (p, g), times in runs.items()}}, indent=1))
        if args.plot:
            plot(summary, args.plot)
        console.print(render(summary))
        where = "none in the sweep" if crossing is None else f"{crossing:.2g} GB/s"
        console.print(f"crossover (load-all = recompute): {where}; worst regret {max(summary.regret.values()):+.1%} "
                      f"against the per-request oracle, {max((summary.wave_regret or {0: 0.0}).values()):+.1%} "
                      f"against the per-wave bound; "
                      f"slow tier against arena only: p50 {max(summary.slow_tier_p50.values()):+.1%} worst, p99 "
                      f"{max(summary.slow_tier_p99.values()):+.1%} worst; the oracle's noise floor (two recompute runs) "
                      f"{'-' if summary.noise_floor is None else f'{summary.noise_floor:+.1%}'}; "
                      f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
