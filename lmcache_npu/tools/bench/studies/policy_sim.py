"""Trace-driven simulation of the arena's eviction policies and the slow tiers' reuse gate (issue 24, item 2).

The REAL `ChunkIndex` answers every request; a fake executor completes every command at once (a Put adds the chunk to
an unbounded in-memory remote store, a Promote from it succeeds only when the chunk is there). Each request is
served as the connector serves it: lookup (asked again while promotions are pending), load of the ready prefix,
store of the rest, release. Chunk keys are prefix-chained like vLLM's block hashes, so a request hits only a prefix.

Traces (synthetic, seeded; one chunk = 256 tokens):
  chat   multi-turn conversations under a few shared system prompts; each turn re-sends the whole history
  agent  tool loops: a shared tool-spec prefix, then a context that grows by a few chunks per step
  rag    one document per request, picked by Zipf(1.1) popularity over 400 documents, then a one-off question
  mixed  the three above interleaved
Every trace has bursts of one-off prompts (the scan) mixed in: --scan-share of its requests.

Part 1 (policies): arena only, no disk or remote; hit rate = chunks found in the arena / chunks asked, against the
arena's capacity as a share of the trace's distinct chunks. Part 2 (gate): a fixed arena (--gate-capacity), a disk
of --disk-factor times the arena and an unbounded Mooncake; for each write-through and admit-hits setting, the hit
rate over every tier and the bytes written to disk (spills + persists) and put to Mooncake.

    .venv/bin/python -m lmcache_npu.tools.bench.studies.policy_sim                      # table; ~1 minute on one core
    .venv/bin/python -m lmcache_npu.tools.bench.studies.policy_sim --json out.json --plot docs/img/policy_hit_rate.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from lmcache_npu.store.commands import Command, Completion, Drop, Persist, Promote, Put, Spill, Tier
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.policies import POLICIES

logger = logging.getLogger(__name__)

NAMESPACE = "5e" * 16
# a 256-token chunk of Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 B x 256 tokens
CHUNK_BYTES = 32 * 8 * 128 * 2 * 2 * 256
TRACES = ("chat", "agent", "rag", "mixed")

Request = list[str]  # a prompt as a list of chunk labels; the key of chunk i chains labels[:i + 1]


# ---- traces ---------------------------------------------------------------------------------------------------------

def _chat(rng: random.Random, tag: str) -> Iterator[Request]:
    """Conversations under 4 shared system prompts (6 chunks each); 12 are open at a time, each lasting 2-12 turns;
    a turn adds the previous answer and a new question (1-3 chunks together)."""
    systems = [[f"sys{s}.{i}" for i in range(6)] for s in range(4)]
    serial = 0

    def fresh() -> tuple[list[str], int]:
        nonlocal serial
        serial += 1
        return list(rng.choice(systems)), rng.randint(2, 12)

    open_chats = [fresh() for _ in range(12)]
    while True:
        slot = rng.randrange(len(open_chats))
        history, turns_left = open_chats[slot]
        history = history + [f"{tag}chat{serial}.{slot}.{len(history)}.{j}" for j in range(rng.randint(1, 3))]
        yield history
        open_chats[slot] = (history, turns_left - 1) if turns_left > 1 else fresh()


def _agent(rng: random.Random, tag: str) -> Iterator[Request]:
    """Tool loops: a 10-chunk tool-spec prefix shared by every task, a task prompt of 2-4 chunks, then 5-20 steps
    each re-sending the context grown by 1-3 chunks (tool output, next call); 4 tasks run at a time."""
    spec = [f"tools.{i}" for i in range(10)]
    serial = 0

    def fresh() -> tuple[list[str], int]:
        nonlocal serial
        serial += 1
        return spec + [f"{tag}task{serial}.{i}" for i in range(rng.randint(2, 4))], rng.randint(5, 20)

    tasks = [fresh() for _ in range(4)]
    while True:
        slot = rng.randrange(len(tasks))
        context, steps_left = tasks[slot]
        yield context
        grown = context + [f"{tag}step{serial}.{slot}.{len(context)}.{j}" for j in range(rng.randint(1, 3))]
        tasks[slot] = (grown, steps_left - 1) if steps_left > 1 else fresh()


def _rag(rng: random.Random, tag: str) -> Iterator[Request]:
    """A 2-chunk instruction, one of 400 documents (4-16 chunks) by Zipf(1.1) popularity, a one-off question."""
    sizes = [rng.randint(4, 16) for _ in range(400)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(400)]
    serial = 0
    while True:
        serial += 1
        doc = rng.choices(range(400), weights)[0]
        yield ["rag.inst.0", "rag.inst.1"] + [f"doc{doc}.{i}" for i in range(sizes[doc])] + [f"{tag}q{serial}"]


def _scan(rng: random.Random, tag: str) -> Iterator[Request]:
    """One-off prompts of 8-48 chunks, never seen again."""
    serial = 0
    while True:
        serial += 1
        yield [f"{tag}scan{serial}.{i}" for i in range(rng.randint(8, 48))]


def make_trace(name: str, requests: int, scan_share: float, seed: int) -> list[Request]:
    """`requests` prompts of trace `name`, a `scan_share` of them one-off prompts arriving in bursts of 20."""
    rng = random.Random(f"{name}-{seed}")
    sources: dict[str, Iterator[Request]] = {
        "chat": _chat(rng, "c"), "agent": _agent(rng, "a"), "rag": _rag(rng, "r")}
    if name == "mixed":
        pick: Callable[[], Request] = lambda: next(sources[rng.choice(("chat", "agent", "rag"))])
    elif name in sources:
        pick = lambda: next(sources[name])
    else:
        raise ValueError(f"trace must be one of {', '.join(TRACES)}, got {name!r}")
    scan = _scan(rng, "s")
    trace: list[Request] = []
    burst = 20
    while len(trace) < requests:
        # a burst of one-offs now and then keeps their overall share at scan_share
        if scan_share > 0 and rng.random() < scan_share / burst:
            trace.extend(next(scan) for _ in range(burst))
        else:
            trace.append(pick())
    return trace[:requests]


class KeyChain:
    """Prefix-chained chunk keys, as vLLM hashes blocks: a chunk's key depends on every label before it."""

    def __init__(self) -> None:
        self._memo: dict[tuple[bytes, str], bytes] = {}

    def keys(self, labels: Sequence[str]) -> list[ChunkKey]:
        parent, out = b"", []
        for label in labels:
            digest = self._memo.get((parent, label))
            if digest is None:
                digest = hashlib.blake2b(parent + label.encode(), digest_size=16).digest()
                self._memo[(parent, label)] = digest
            out.append(ChunkKey(NAMESPACE, digest))
            parent = digest
        return out


# ---- the fake executor and one run ----------------------------------------------------------------------------------

class InstantExecutor:
    """Completes every command at once on one rank; the remote store is a set of keys."""

    def __init__(self) -> None:
        self.remote: set[ChunkKey] = set()
        self.counts = {"spill": 0, "persist": 0, "put": 0, "promote_disk": 0, "promote_remote": 0}

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [key in self.remote for key in keys]

    def settle(self, index: ChunkIndex) -> None:
        for _ in range(100):
            commands = index.take_commands()
            if not commands:
                return
            index.on_completions([self._run(command) for command in commands])
        raise RuntimeError("the index kept issuing commands for 100 rounds")

    def _run(self, command: Command) -> Completion:
        ok = True
        if isinstance(command, Put):
            self.remote.add(command.key)
            self.counts["put"] += 1
        elif isinstance(command, (Spill, Persist)):
            self.counts["spill" if isinstance(command, Spill) else "persist"] += 1
        elif isinstance(command, Promote):
            ok = command.source is Tier.DISK or command.key in self.remote
            self.counts[f"promote_{command.source.value}"] += 1
        elif isinstance(command, Drop) and command.tier is Tier.REMOTE:
            self.remote.discard(command.key)
        return Completion(command.cmd_id, 0, ok)


@dataclass
class RunResult:
    trace: str
    policy: str
    capacity_share: float
    slots: int
    write_through: bool
    remote_admit_hits: int
    disk_admit_hits: int
    disk_chunks: int
    asked: int
    arena_hits: int
    disk_hits: int
    remote_hits: int
    disk_gib: float
    remote_gib: float

    @property
    def arena_hit_rate(self) -> float:
        return self.arena_hits / self.asked

    @property
    def hit_rate(self) -> float:
        return (self.arena_hits + self.disk_hits + self.remote_hits) / self.asked


def simulate(trace: list[list[ChunkKey]], policy: str, slots: int, disk_chunks: int = 0, remote: bool = False,
             write_through: bool = False, remote_admit: int = 0,
             disk_admit: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """Serves `trace` through a real index; returns (hits by source plus `asked`, the executor's command counts)."""
    executor = InstantExecutor()
    index = ChunkIndex(slots, 1, disk_chunks=disk_chunks, remote_exists=executor.exists if remote else None,
                       disk_write_through=write_through, eviction_policy=policy, remote_admit_hits=remote_admit,
                       disk_admit_hits=disk_admit)
    hits = {"asked": 0, "cpu": 0, "disk": 0, "remote": 0}
    for number, keys in enumerate(trace):
        request = f"q{number}"
        result = index.lookup(request, keys)
        hits["asked"] += len(keys)
        for source in result.sources:
            hits[source] += 1
        for _ in range(10):
            if not result.pending:
                break
            executor.settle(index)
            result = index.lookup(request, keys)
        index.begin_load(request, list(enumerate(keys[:result.ready_chunks])))
        executor.settle(index)
        index.allocate_store(request, list(enumerate(keys))[result.ready_chunks:])
        executor.settle(index)
        index.release(request)
    index.check_invariants()
    return hits, executor.counts


def run_policies(traces: dict[str, list[list[ChunkKey]]], policies: Sequence[str],
                 shares: Sequence[float]) -> list[RunResult]:
    results = []
    for name, trace in traces.items():
        distinct = len({key for keys in trace for key in keys})
        for share in shares:
            slots = max(1, int(distinct * share))
            for policy in policies:
                hits, _ = simulate(trace, policy, slots)
                results.append(RunResult(name, policy, share, slots, False, 0, 0, 0, hits["asked"], hits["cpu"], 0,
                                         0, 0.0, 0.0))
    return results


# (disk write-through, remote_admit_hits, disk_admit_hits); the first is today's behaviour
GATE_SETTINGS = ((True, 0, 0), (False, 0, 0), (True, 1, 0), (False, 1, 1), (False, 2, 2))


def run_gate(traces: dict[str, list[list[ChunkKey]]], policy: str, share: float,
             disk_factor: float) -> list[RunResult]:
    results = []
    for name, trace in traces.items():
        distinct = len({key for keys in trace for key in keys})
        slots = max(1, int(distinct * share))
        disk = max(1, int(slots * disk_factor))
        for write_through, remote_admit, disk_admit in GATE_SETTINGS:
            hits, counts = simulate(trace, policy, slots, disk, True, write_through, remote_admit, disk_admit)
            results.append(RunResult(name, policy, share, slots, write_through, remote_admit, disk_admit, disk,
                                     hits["asked"],
                                     hits["cpu"], hits["disk"], hits["remote"],
                                     (counts["spill"] + counts["persist"]) * CHUNK_BYTES / 2**30,
                                     counts["put"] * CHUNK_BYTES / 2**30))
    return results


# ---- output ---------------------------------------------------------------------------------------------------

def print_tables(policy_runs: list[RunResult], gate_runs: list[RunResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    policies = list(dict.fromkeys(r.policy for r in policy_runs))
    table = Table(title="arena hit rate (chunks found in the arena / chunks asked), arena only")
    for column in ("trace", "arena / distinct chunks", "slots", *policies, "best vs lru"):
        table.add_column(column, justify="right")
    for (trace, share), rows in _group(policy_runs, lambda r: (r.trace, r.capacity_share)).items():
        rate = {r.policy: r.arena_hit_rate for r in rows}
        best = max(rate, key=rate.get)
        gain = f"{best} {100 * (rate[best] - rate.get('lru', rate[best])):+.1f} pt" if "lru" in rate else "-"
        table.add_row(trace, f"{share:.0%}", str(rows[0].slots), *(f"{rate[p]:.3f}" for p in policies), gain)
    console.print(table)
    if not gate_runs:
        return
    table = Table(title=f"slow tiers ({gate_runs[0].policy}; arena {gate_runs[0].capacity_share:.0%} of distinct "
                        f"chunks, disk {gate_runs[0].disk_chunks // max(1, gate_runs[0].slots)}x the arena, "
                        f"Mooncake unbounded; {CHUNK_BYTES >> 20} MiB chunks)")
    for column in ("trace", "write-through", "remote / disk admit", "arena hits", "disk hits", "remote hits",
                   "hit rate",
                   "disk GiB", "Mooncake GiB"):
        table.add_column(column, justify="right")
    for r in gate_runs:
        table.add_row(r.trace, "on" if r.write_through else "off", f"{r.remote_admit_hits} / {r.disk_admit_hits}",
                      f"{r.arena_hit_rate:.3f}",
                      f"{r.disk_hits / r.asked:.3f}", f"{r.remote_hits / r.asked:.3f}", f"{r.hit_rate:.3f}",
                      f"{r.disk_gib:.1f}", f"{r.remote_gib:.1f}")
    console.print(table)


def _group(runs: list[RunResult], by: Callable[[RunResult], tuple]) -> dict[tuple, list[RunResult]]:
    groups: dict[tuple, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(by(run), []).append(run)
    return groups


def plot(policy_runs: list[RunResult], gate_runs: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in policy_runs))
    columns = len(traces) + (1 if gate_runs else 0)
    fig, axes = plt.subplots(1, columns, figsize=(4.2 * columns, 3.8), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        for policy, rows in _group([r for r in policy_runs if r.trace == trace], lambda r: (r.policy,)).items():
            ax.plot([100 * r.capacity_share for r in rows], [r.arena_hit_rate for r in rows], marker="o",
                    label=policy[0])
        ax.set_xscale("log")
        shares = sorted({100 * r.capacity_share for r in policy_runs})
        ax.set_xticks(shares, [f"{x:g}%" for x in shares])
        ax.minorticks_off()
        ax.set_title(f"{trace}")
        ax.set_xlabel("arena, share of distinct chunks")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("arena hit rate")
    axes[0][0].legend()
    if gate_runs:
        ax = axes[0][-1]
        labels = [f"wt {'on' if wt else 'off'}, N {remote}/{disk}" for wt, remote, disk in GATE_SETTINGS]
        by_setting = _group(gate_runs, lambda r: (r.write_through, r.remote_admit_hits, r.disk_admit_hits))
        disk = [sum(r.disk_gib for r in by_setting[s]) for s in GATE_SETTINGS]
        remote = [sum(r.remote_gib for r in by_setting[s]) for s in GATE_SETTINGS]
        positions = range(len(GATE_SETTINGS))
        ax.barh([p - 0.2 for p in positions], disk, height=0.4, label="disk")
        ax.barh([p + 0.2 for p in positions], remote, height=0.4, label="Mooncake")
        ax.set_yticks(list(positions), labels)
        ax.set_xlabel("GiB written, all traces")
        ax.set_title("slow-tier writes by gate")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per trace")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--capacities", default="0.02,0.05,0.1,0.2,0.4",
                        help="arena sizes as shares of the trace's distinct chunks")
    parser.add_argument("--scan-share", type=float, default=0.2, help="share of requests that are one-off prompts")
    parser.add_argument("--gate-policy", default="", help="policy for the gate runs (default: best in part 1)")
    parser.add_argument("--gate-capacity", type=float, default=0.1)
    parser.add_argument("--disk-factor", type=float, default=4.0)
    parser.add_argument("--no-gate", action="store_true", help="skip part 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--plot", type=Path, help="write a PNG here")
    args = parser.parse_args(argv)
    if args.requests < 1 or not 0.0 <= args.scan_share < 1.0:
        parser.error("--requests must be >= 1 and --scan-share in [0, 1)")
    shares = [float(x) for x in args.capacities.split(",")]
    policies = args.policies.split(",")
    for policy in policies:
        if policy not in POLICIES:
            parser.error(f"--policies: {policy!r} is not one of {', '.join(POLICIES)}")
    chain = KeyChain()
    traces = {name: [chain.keys(labels) for labels in make_trace(name, args.requests, args.scan_share, args.seed)]
              for name in args.traces.split(",")}
    policy_runs = run_policies(traces, policies, shares)
    gate_policy = args.gate_policy or _best_policy(policy_runs)
    gate_runs = [] if args.no_gate else run_gate(traces, gate_policy, args.gate_capacity, args.disk_factor)
    print_tables(policy_runs, gate_runs)
    if args.json:
        rows = [{**asdict(r), "arena_hit_rate": r.arena_hit_rate, "hit_rate": r.hit_rate}
                for r in policy_runs + gate_runs]
        summary = {"chunk_bytes": CHUNK_BYTES, "requests": args.requests, "scan_share": args.scan_share,
                   "seed": args.seed, "runs": rows}
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(policy_runs, gate_runs, args.plot)
    return 0


def _best_policy(runs: list[RunResult]) -> str:
    """The policy with the highest mean arena hit rate over every trace and capacity."""
    means = {policy: sum(r.arena_hit_rate for r in rows) / len(rows)
             for (policy,), rows in _group(runs, lambda r: (r.policy,)).items()}
    return max(means, key=means.get)


if __name__ == "__main__":
    sys.exit(main())
