"""Issue 33's measurement: two real vLLM engines, each in a process of its own and serving at the same time, behind
a round-robin router (turn k of conversation c goes to engine (c + k) % 2), in three configurations:

  node      one `lmcache-npu node-cache` service; both engines set `node_cache: PATH` (one cache for the node)
  private   each engine its own host arena of --cpu-bytes (today's deployment without sharing)
  mooncake  each engine its own arena of --cpu-bytes and a Mooncake tier on one mooncake_master over loopback TCP
            (today's only way to share), the store secret set, inside a loopback-only network namespace

    python -m lmcache_npu.tools.bench.studies.node_cache_round_robin --model llama --conversations 2 --turns 3 \\
        --output-tokens 8 --repeats 1 --unique-waves 2 --unique-prompts-per-wave 2      # a smoke run

Per configuration, as medians (min-max) of --repeats runs whose configuration order rotates each repeat, every run on
fresh engines and fresh services: the prompt tokens hit (vLLM's `num_cached_tokens`: its own prefix cache and the
connector's loads) and the connector's share of them, TTFT p50/p90 over every request, the workload's wall time, the
host memory the workload's chunks took (node: the service's arena; private: both arenas; mooncake: both arenas and
the master's allocation), and whether every run gave the first run's tokens. The `unique` workload (no prompt shares
a prefix with another) runs node and private only: what talking to the service costs per scheduler step when the
cache cannot help (host time in the scheduler's connector hooks per step; wall and TTFT). Also per configuration:
the connector's lookups per request (more than one: a lookup found a chunk still being written and waited for it).
Prints the tables at 120 columns, shows progress on stderr (a line per phase when stderr is not a terminal), and
writes every run, the spreads and the verdicts with --json.

The study, not `lmcache-npu replay --engines 2`: the replay runs one in-process engine at a time against vLLM alone
(its configurations, restart phase and verdicts are one engine's); this needs engines in separate processes at once
and a service per configuration. It reuses the replay's parts: workloads, warm-up, hit accounting, spreads, cells.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from lmcache_npu.tools.replay.configs import PLUGIN_CONNECTOR, RunConfig, run_order
from lmcache_npu.tools.replay.pair import EnginePool, EngineSpec, RoundRobinRun, engine_for, run_round_robin
from lmcache_npu.tools.replay.runner import TurnRun
from lmcache_npu.tools.replay.spread import Spread, percentile, spread_of
from lmcache_npu.tools.replay.verdict import change, seconds
from lmcache_npu.tools.replay.workload import Conversation, multi_turn_chat, unique_prompts

logger = logging.getLogger(__name__)

MODULE = "lmcache_npu.tools.bench.studies.node_cache_round_robin"
ENGINES = 2
NODE, PRIVATE, MOONCAKE = "node", "private", "mooncake"
CONFIG_NAMES = {NODE: "node cache", PRIVATE: "private arenas", MOONCAKE: "shared Mooncake"}
CHAT, UNIQUE = "chat", "unique"
WORKLOAD_CONFIGS = {CHAT: (NODE, PRIVATE, MOONCAKE), UNIQUE: (NODE, PRIVATE)}  # unique: the IPC cost, no sharing
IN_NETNS = "NODE_CACHE_STUDY_IN_NETNS"  # set in its copy inside the namespace (LMCACHE_NPU_* are config keys)
LOOPBACK = "127.0.0.1"
METRICS = ("hit_tokens", "connector_tokens", "computed_tokens", "ttft_p50_s", "ttft_p90_s", "wall_s",
           "memory_bytes", "connector_us_per_step", "lookups_per_request")


# ---- what one run measured, and the spreads over runs ----------------------------------------------------------

@dataclass
class ConfigRun:
    """One configuration's run of one workload on two fresh engines."""

    workload: str
    config: str  # NODE, PRIVATE or MOONCAKE
    repeat: int
    position: int  # where it ran within its repeat and workload (0: first)
    prompt_tokens: int
    hits: dict[str, int]  # source -> tokens (replay.accounting.SOURCES), both engines together
    ttfts: list[float]  # every request's
    wall_s: float  # every wave's, from its submission until the last engine answered
    connector_s: float  # host time in the scheduler's connector hooks, both engines
    steps: int  # scheduler steps, both engines
    lookups: int  # the connector's lookups, both engines: one per request unless a lookup waited for a chunk
    memory: dict[str, int]  # what the workload's chunks took, per holder ("node", "arena 0", "mooncake", ...)
    turns: list[TurnRun] = field(default_factory=list, repr=False)  # the completions, for the token check
    matching: tuple[int, int, int] = (0, 0, 0)  # (matching, requests, near ties) against the workload's reference
    first_difference: str = ""
    mismatches: list[str] = field(default_factory=list)  # hit-accounting disagreements
    details: dict[str, Any] = field(default_factory=dict)  # per engine: held before/after, stats, warm-up

    def metrics(self) -> dict[str, float]:
        connector = sum(self.hits.get(s, 0) for s in ("arena", "disk", "mooncake", "peer"))
        return {"hit_tokens": self.prompt_tokens - self.hits.get("computed", 0), "connector_tokens": connector,
                "computed_tokens": self.hits.get("computed", 0),
                "ttft_p50_s": percentile(self.ttfts, 50), "ttft_p90_s": percentile(self.ttfts, 90),
                "wall_s": self.wall_s, "memory_bytes": sum(self.memory.values()),
                "connector_us_per_step": self.connector_s / self.steps * 1e6 if self.steps else 0.0,
                "lookups_per_request": self.lookups / len(self.ttfts) if self.ttfts else 0.0}

    def to_json(self) -> dict[str, Any]:
        values = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("turns", "ttfts")}
        values["metrics"] = self.metrics()
        values["waves"] = [{"wave": t.turn, "requests": len(t.completions), "wall_s": t.wall_s,
                            "ttft_s": [c.ttft_s for c in t.completions],
                            "cached_tokens": [c.cached_tokens for c in t.completions]} for t in self.turns]
        return values


def schedule(workloads: Sequence[str], configs: Sequence[str], repeats: int) -> list[tuple[str, int, str]]:
    """(workload, repeat, configuration) in the order they run: each repeat runs every workload, and within a
    workload its configurations (those of `configs` it takes) rotate by one per repeat, so each goes first
    equally often and none always inherits a machine the others warmed."""
    unknown = [w for w in workloads if w not in WORKLOAD_CONFIGS] + [c for c in configs if c not in CONFIG_NAMES]
    if unknown:
        raise ValueError(f"unknown workload(s) or configuration(s) {unknown}; workloads: {', '.join(WORKLOAD_CONFIGS)};"
                         f" configurations: {', '.join(CONFIG_NAMES)}")
    if not workloads:
        raise ValueError("--workloads names no workload")
    per_workload = {w: [c for c in WORKLOAD_CONFIGS[w] if c in configs] for w in workloads}
    empty = [w for w, chosen in per_workload.items() if not chosen]
    if empty:
        raise ValueError(f"workload(s) {empty} take none of the configurations {list(configs)}")
    orders = {w: run_order([RunConfig(c) for c in chosen], repeats) for w, chosen in per_workload.items()}
    return [(w, repeat, config.name) for repeat in range(repeats) for w in workloads
            for r, config in orders[w] if r == repeat]


def summarize(runs: Sequence[ConfigRun]) -> dict[str, dict[str, dict[str, Spread]]]:
    """workload -> configuration -> metric -> its spread over the repeats."""
    grouped: dict[str, dict[str, list[ConfigRun]]] = {}
    for run in runs:
        grouped.setdefault(run.workload, {}).setdefault(run.config, []).append(run)
    return {workload: {config: {m: spread_of(r.metrics()[m] for r in chosen) for m in METRICS}
                       for config, chosen in configs.items()}
            for workload, configs in grouped.items()}


def held_delta(before: int, after: int, holder: str) -> int:
    """Bytes the workload added to `holder`; a holder that shrank evicted what it held before (a full cache),
    which would hide the workload's size: refused."""
    if after < before:
        raise ValueError(f"{holder} held {before:,} B before the workload and {after:,} B after: it evicted, so the "
                         f"workload's bytes cannot be told (give it more memory)")
    return after - before


def cpu_sets(engines: int, per_engine: int, available: Sequence[int]) -> list[tuple[int, ...]]:
    """The CPUs each engine runs on: disjoint sets of `per_engine` when the machine has that many, otherwise no
    pinning (empty sets: every engine may run anywhere)."""
    if engines < 1 or per_engine < 1:
        raise ValueError(f"engines and CPUs per engine must be >= 1, got {engines} and {per_engine}")
    cpus = sorted(available)
    if len(cpus) < engines * per_engine:
        return [() for _ in range(engines)]
    return [tuple(cpus[i * per_engine:(i + 1) * per_engine]) for i in range(engines)]


# ---- the services a configuration needs -------------------------------------------------------------------------

@dataclass
class Services:
    """What a configuration's engines are given (connector keys, environment) and how its shared holder's bytes
    are read (None: no shared holder)."""

    extra_config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    shared_holder: str = ""  # "node" or "mooncake"
    shared_used: Optional[Callable[[], int]] = None  # the bytes the shared holder uses now


@contextlib.contextmanager
def services_for(config: str, options: argparse.Namespace, folder: str) -> Iterator[Services]:
    """Starts what `config` needs (a node cache service, a Mooncake master), yields it, stops it after."""
    common: dict[str, Any] = {} if options.chunk_tokens is None else {"chunk_tokens": options.chunk_tokens}
    if config == NODE:
        from lmcache_npu.tools.node_local import LocalNodeCache

        with LocalNodeCache(folder, options.node_cpu_bytes) as node:
            yield Services({"node_cache": node.socket, **common}, shared_holder="node", shared_used=node.used_bytes)
    elif config == PRIVATE:
        yield Services({"cpu_bytes": options.cpu_bytes, **common})
    elif config == MOONCAKE:
        from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

        with LocalMooncakeMaster() as master:
            mooncake = {"master": master.master, "metadata": master.metadata, "local_hostname": LOOPBACK,
                        "global_segment_bytes": options.mooncake_segment_bytes,
                        "local_buffer_bytes": options.mooncake_buffer_bytes}
            # each run its own store secret: the engines seal and check their objects with it (never printed)
            env = {"LMCACHE_NPU_SECRET": secrets.token_hex(32), "MC_TCP_BIND_ADDRESS": LOOPBACK}
            yield Services({"cpu_bytes": options.cpu_bytes, "mooncake": mooncake, **common}, env, "mooncake",
                           master.allocated_bytes)
    else:
        raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIG_NAMES)}")


# ---- running ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    conversations: list[Conversation]
    settings: Any  # replay.engine.EngineSettings


def run_config(workload: Workload, config: str, repeat: int, position: int, options: argparse.Namespace,
               cpus: Sequence[tuple[int, ...]], vocab: int, on_wave: Callable[[TurnRun], None],
               on_phase: Callable[[str], None]) -> ConfigRun:
    """One configuration's run of `workload` on two fresh engines and fresh services."""
    from lmcache_npu.tools.replay.warmup import shadow_first_turn

    conversations = workload.conversations
    with tempfile.TemporaryDirectory(prefix="lmcache-npu-round-robin-") as folder, \
            services_for(config, options, folder) as services:
        specs = []
        for index in range(ENGINES):
            first = [c for i, c in enumerate(conversations) if c.start == 0 and engine_for(i, 0, ENGINES) == index]
            warmup = tuple(tuple(p) for p in shadow_first_turn(first, vocab)) if first else ()
            specs.append(EngineSpec(f"engine {index}", workload.settings,
                                    RunConfig(CONFIG_NAMES[config], PLUGIN_CONNECTOR, services.extra_config),
                                    services.env, cpus[index], warmup))
        on_phase(f"repeat {repeat + 1}, {workload.name}, {CONFIG_NAMES[config]}: starting {ENGINES} engines")
        load_before = _load()
        with EnginePool(specs) as engines:
            shared_before = services.shared_used() if services.shared_used else 0
            on_phase(f"repeat {repeat + 1}, {workload.name}, {CONFIG_NAMES[config]}: running")
            run: RoundRobinRun = run_round_robin(engines, conversations, on_wave)
            reports = [engine.finish() for engine in engines]
            shared_after = services.shared_used() if services.shared_used else 0
            ready = [engine.ready for engine in engines]
            load_after = _load()
    memory: dict[str, int] = {}
    if services.shared_holder:
        memory[services.shared_holder] = held_delta(shared_before, shared_after, services.shared_holder)
    if config != NODE:  # a node cache engine's arena is the node's, counted once above
        for index, (start, end) in enumerate(zip(ready, reports)):
            memory[f"arena {index}"] = held_delta(start.held.used_bytes, end.held.used_bytes, f"engine {index}'s arena")
    hits = run.hits()
    connector_s, steps, lookups = run.connector()
    details = {report.name: {"held_before": dataclasses.asdict(start.held),
                             "held_after": dataclasses.asdict(report.held),
                             "capacity_tokens": start.capacity_tokens, "plugin_stats": report.plugin_stats,
                             "reloaded_tokens": report.reloaded_tokens, "hook_seconds": report.hook_seconds,
                             "hook_calls": report.hook_calls,
                             "warmup": None if start.warmup is None else start.warmup.to_json()}
               for start, report in zip(ready, reports)}
    if services.shared_holder:
        details["shared"] = {"holder": services.shared_holder, "before": shared_before, "after": shared_after}
    # the machine's 1-minute load average before the engines started and after the workload: other work on the
    # machine is run-to-run noise, and this says which runs had it
    details["load_average"] = {"before": load_before, "after": load_after}
    return ConfigRun(workload.name, config, repeat, position, hits.prompt_tokens, hits.by_source(),
                     [c.ttft_s for t in run.turns for c in t.completions], sum(t.wall_s for t in run.turns),
                     connector_s, steps, lookups, memory, run.turns,
                     mismatches=[m for r in reports for m in r.mismatches], details=details)


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def check_tokens(runs: Sequence[ConfigRun], tolerance: float) -> None:
    """Every run's tokens against its workload's first run (a near tie of the model's precision excused)."""
    from lmcache_npu.tools.replay.turns import compare_turns

    references: dict[str, ConfigRun] = {}
    for run in runs:
        reference = references.setdefault(run.workload, run)
        reports = compare_turns(reference.turns, run.turns, tolerance)
        run.matching = (sum(t.matching for t in reports), sum(t.requests for t in reports),
                        sum(t.near_ties for t in reports))
        run.first_difference = next((f"wave {t.turn}: {t.first_difference}" for t in reports if t.first_difference), "")


# ---- the report -------------------------------------------------------------------------------------------------

def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def byte_cell(spread: Spread, repeats: int) -> str:
    """The median in MiB, the min-max below it (as the replay's cells)."""
    if repeats < 2 or spread.low == spread.high:
        return mib(spread.median)
    return f"{mib(spread.median)}\n{spread.low / 2**20:,.1f}-{spread.high / 2**20:,.1f}"


def micro_cell(spread: Spread, repeats: int) -> str:
    value = f"{spread.median:,.0f} µs"
    return value if repeats < 2 or spread.low == spread.high else f"{value}\n{spread.low:,.0f}-{spread.high:,.0f}"


def memory_parts(runs: Sequence[ConfigRun]) -> dict[str, float]:
    """Each holder's median bytes over the runs of one configuration."""
    holders = sorted({h for r in runs for h in r.memory})
    return {h: percentile([r.memory.get(h, 0) for r in runs], 50) for h in holders}


def _moved(label: str, base: Spread, candidate: Spread) -> str:
    """"TTFT p50 80 ms -> 60 ms (1.33x faster)": the baseline's median, the candidate's, and whether the change
    lies beyond the run-to-run spread (verdict.change)."""
    return f"{label} {seconds(base.median)} -> {seconds(candidate.median)} ({change(base, candidate)})"


def _sharing_verdict(node: Mapping[str, Spread], other: Mapping[str, Spread], name: str) -> str:
    timings = ", ".join(_moved(label, other[m], node[m]) for label, m in
                        (("TTFT p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("wall", "wall_s")))
    return (f"{CONFIG_NAMES[NODE]} against {name}: hit tokens {node['hit_tokens'].median:,.0f} vs "
            f"{other['hit_tokens'].median:,.0f}; {timings}; memory {mib(node['memory_bytes'].median)} vs "
            f"{mib(other['memory_bytes'].median)}.")


def verdicts(summary: Mapping[str, Mapping[str, Mapping[str, Spread]]]) -> list[str]:
    """The node cache against each other configuration on the shared workload, and its cost per scheduler step on
    the workload without reuse (the target: within the run-to-run spread)."""
    out = []
    chat = summary.get(CHAT, {})
    if NODE in chat:
        out += [_sharing_verdict(chat[NODE], chat[c], CONFIG_NAMES[c]) for c in (PRIVATE, MOONCAKE) if c in chat]
    unique = summary.get(UNIQUE, {})
    if NODE in unique and PRIVATE in unique:
        node, private = unique[NODE], unique[PRIVATE]
        node_us, private_us = node["connector_us_per_step"].median, private["connector_us_per_step"].median
        timings = ", ".join(_moved(label, private[m], node[m]) for label, m in
                            (("wall", "wall_s"), ("TTFT p50", "ttft_p50_s"), ("p90", "ttft_p90_s")))
        out.append(f"IPC cost without reuse: the scheduler's connector hooks take {node_us:,.0f} µs per step with the "
                   f"node cache, {private_us:,.0f} µs with a private arena ({node_us - private_us:+,.0f} µs per "
                   f"step); {timings}.")
    return out


def _matching(runs: Sequence[ConfigRun]) -> tuple[int, int, int]:
    return (sum(r.matching[0] for r in runs), sum(r.matching[1] for r in runs), sum(r.matching[2] for r in runs))


def render(runs: Sequence[ConfigRun], repeats: int, descriptions: Mapping[str, str]) -> list[Any]:
    """Rich renderables: a table per workload (medians, min-max below), notes, the verdicts."""
    from rich.table import Table
    from rich.text import Text

    from lmcache_npu.tools.replay.replay import matching_cell, spread_cell

    summary = summarize(runs)
    spread_note = f"medians of {repeats} runs, min-max below" if repeats > 1 else "one run each"
    out: list[Any] = []
    for workload, configs in summary.items():
        table = Table(title=f"{descriptions[workload]}; {spread_note}", title_justify="left")
        sharing = workload == CHAT
        columns = (["hit tokens", "by connector"] if sharing else []) + \
            ["TTFT p50", "TTFT p90", "wall"] + (["host memory"] if sharing else ["connector/step"]) + ["tokens"]
        table.add_column("configuration")
        for column in columns:
            table.add_column(column, justify="right", no_wrap=True)
        for config, row in configs.items():
            chosen = [r for r in runs if r.workload == workload and r.config == config]
            cells = [spread_cell(row[m], repeats, "tokens") for m in ("hit_tokens", "connector_tokens")] \
                if sharing else []
            cells += [spread_cell(row[m], repeats) for m in ("ttft_p50_s", "ttft_p90_s", "wall_s")]
            cells.append(byte_cell(row["memory_bytes"], repeats) if sharing
                         else micro_cell(row["connector_us_per_step"], repeats))
            cells.append(matching_cell(*_matching(chosen)))
            table.add_row(CONFIG_NAMES[config], *cells)
        out.append(table)
        if sharing:
            parts = "; ".join(f"{CONFIG_NAMES[c]}: " + " + ".join(
                f"{holder} {mib(value)}" for holder, value in memory_parts(
                    [r for r in runs if r.workload == workload and r.config == c]).items()) for c in configs)
            prompt = max(r.prompt_tokens for r in runs if r.workload == workload)
            out.append(Text(f"host memory: the bytes the workload's chunks took ({parts}). hit tokens: of the "
                            f"{prompt:,} prompt tokens of a run, those not computed (vLLM's own prefix cache and the "
                            "connector's loads); by connector: the plugin's loads (node arena, own arena or "
                            "Mooncake)."))
            waits = ", ".join(f"{CONFIG_NAMES[c]} {row['lookups_per_request'].median:.1f}"
                              for c, row in configs.items())
            out.append(Text(f"lookups per request: {waits} (more than one: a lookup found a chunk still being "
                            "written, by this engine or, with a shared cache, the other, and asked again every "
                            "step until it landed)."))
            tiers = {c: percentile([r.hits.get("mooncake", 0) for r in runs if r.workload == workload
                                    and r.config == c], 50) for c in configs}
            if any(tiers.values()):
                out.append(Text("loaded from Mooncake: " + ", ".join(f"{CONFIG_NAMES[c]} {v:,.0f} tokens"
                                                                     for c, v in tiers.items() if v)))
        else:
            steps = {c: percentile([r.steps for r in runs if r.workload == workload and r.config == c], 50)
                     for c in configs}
            out.append(Text("connector/step: host time vLLM's scheduler spent in the connector's hooks per scheduler "
                            "step, both engines (" + ", ".join(f"{CONFIG_NAMES[c]} {n:,.0f} steps"
                                                               for c, n in steps.items()) + ")."))
    mismatches = [m for r in runs for m in r.mismatches]
    if mismatches:
        out.append(Text(f"hit accounting: {len(mismatches)} disagreement(s), first: {mismatches[0]}", style="red"))
    for line in verdicts(summary):
        out.append(Text(line))
    differences = [f"{CONFIG_NAMES[r.config]} (repeat {r.repeat + 1}, {r.workload}): {r.first_difference}"
                   for r in runs if r.first_difference]
    if differences:
        out.append(Text(f"tokens differed: {differences[0]}", style="red"))
    else:
        out.append(Text("every run's tokens were those of its workload's first run", style="green"))
    return out


def report_json(runs: Sequence[ConfigRun], args: argparse.Namespace, settings: Mapping[str, Any],
                descriptions: Mapping[str, str], cpus: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    summary = summarize(runs)
    return {"engines": ENGINES, "repeats": args.repeats, "model": args.model, "cpus": [list(c) for c in cpus],
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "settings": dict(settings), "workloads": descriptions,
            "summary": {w: {CONFIG_NAMES[c]: {m: s.to_json() for m, s in row.items()} for c, row in configs.items()}
                        for w, configs in summary.items()},
            "verdicts": verdicts(summary), "identical": all(not r.first_difference for r in runs),
            "runs": [r.to_json() for r in runs]}


# ---- the command ------------------------------------------------------------------------------------------------

def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", help="a replay model recipe (lmcache_npu/tools/replay/models.py) "
                        "or a model directory (default: llama)")
    parser.add_argument("--workloads", nargs="+", default=[CHAT, UNIQUE], choices=list(WORKLOAD_CONFIGS))
    parser.add_argument("--configs", nargs="+", default=[NODE, PRIVATE, MOONCAKE], choices=list(CONFIG_NAMES))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, the order rotating")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512, help="the system prompt all conversations share")
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--unique-waves", type=int, default=4, help="unique: waves of concurrent prompts")
    parser.add_argument("--unique-prompts-per-wave", type=int, default=4)
    parser.add_argument("--unique-prompt-tokens", type=int, default=640)
    parser.add_argument("--cpu-bytes", default="1GiB", help="each engine's own arena (private, mooncake)")
    parser.add_argument("--node-cpu-bytes", help="the node cache's memory (default: twice --cpu-bytes, the two "
                        "private arenas' total)")
    parser.add_argument("--mooncake-segment-bytes", help="what each engine contributes to Mooncake (default: "
                        "--cpu-bytes)")
    parser.add_argument("--mooncake-buffer-bytes", default="64MiB")
    parser.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default: the plugin's choice)")
    parser.add_argument("--kv-cache-memory", default="auto", help="each engine's vLLM KV cache, or auto: the "
                        "chat workload's working set --working-set-ratio times what it holds")
    parser.add_argument("--working-set-ratio", type=float, default=4.0)
    parser.add_argument("--vllm-prefix-cache", choices=["on", "off"], default="on")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--cpus-per-engine", type=int, help="CPUs each engine is pinned to (default: half of "
                        "this process's CPUs; no pinning when the machine has too few)")
    parser.add_argument("--host-network", action="store_true", help="run the Mooncake configuration on the host's "
                        "network instead of a loopback-only network namespace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the runs, spreads and verdicts here")
    args = parser.parse_args(argv)
    for name in ("repeats", "conversations", "turns", "unique_waves", "unique_prompts_per_wave",
                 "unique_prompt_tokens", "output_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from lmcache_npu.store.config import parse_bytes

    cpu = parse_bytes("--cpu-bytes", args.cpu_bytes)
    args.node_cpu_bytes = str(parse_bytes("--node-cpu-bytes", args.node_cpu_bytes or str(2 * cpu)))
    args.mooncake_segment_bytes = parse_bytes("--mooncake-segment-bytes", args.mooncake_segment_bytes or str(cpu))
    args.mooncake_buffer_bytes = parse_bytes("--mooncake-buffer-bytes", args.mooncake_buffer_bytes)
    schedule(args.workloads, args.configs, args.repeats)  # names a workload left without a configuration
    return args


def _in_network_namespace(argv: Sequence[str]) -> Optional[int]:
    """Runs this study again inside a loopback-only network namespace when it runs Mooncake and is not there yet
    (its exit code), or None: run here (already inside, not asked for, or no namespace can be made: said so)."""
    from lmcache_npu.tools.mooncake_local import netns_available, run_in_loopback_netns

    if os.environ.get(IN_NETNS) == "1":
        return None
    available, why = netns_available()
    if not available:
        print(f"note: {why}; the Mooncake configuration runs on the host's network (on 127.0.0.1)", file=sys.stderr)
        return None
    env = dict(os.environ, **{IN_NETNS: "1"})
    return run_in_loopback_netns([sys.executable, "-m", MODULE, *argv], env=env, timeout=None,
                                 capture=False).returncode


def _workloads(args: argparse.Namespace, vocab: int) -> dict[str, tuple[str, list[Conversation]]]:
    out = {}
    if CHAT in args.workloads:
        out[CHAT] = (f"chat: {args.conversations} conversations x {args.turns} turns after a "
                     f"{args.system_tokens}-token system prompt, turns alternating between {ENGINES} engines",
                     multi_turn_chat(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                     args.output_tokens, vocab, args.seed))
    if UNIQUE in args.workloads:
        out[UNIQUE] = (f"no reuse: {args.unique_waves} waves x {args.unique_prompts_per_wave} unique prompts of "
                       f"{args.unique_prompt_tokens} tokens over {ENGINES} engines",
                       unique_prompts(args.unique_waves, args.unique_prompts_per_wave, args.unique_prompt_tokens,
                                      args.output_tokens, vocab, args.seed))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if MOONCAKE in args.configs and CHAT in args.workloads and not args.host_network:
        code = _in_network_namespace(argv)
        if code is not None:
            return code
    os.environ.setdefault("PYTHONHASHSEED", "20261127")  # the engines' processes chain block hashes alike
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout: keep the table readable
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the Mooncake clients' INFO lines (GLOG_minloglevel is not read)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lmcache_npu.store.config import parse_bytes
    from lmcache_npu.tools.replay.compare import tolerance_for
    from lmcache_npu.tools.replay.engine import EngineSettings, engine_available
    from lmcache_npu.tools.replay.models import VOCAB, make_model, model_vocab, resolve_recipe
    from lmcache_npu.tools.replay.sizing import kv_bytes_per_token, kv_memory_for, longest_request_tokens

    missing = engine_available()
    if missing:
        raise SystemExit(f"{MODULE}: needs a real vLLM engine: {missing}")
    console = Console(width=None if sys.stdout.isatty() else 120)
    recipe = None if os.path.isdir(args.model) else resolve_recipe(args.model)
    model_dir = args.model if recipe is None else str(make_model(recipe, progress=console.log))
    vocab = model_vocab(model_dir, VOCAB)
    built = _workloads(args, vocab)
    workloads: dict[str, Workload] = {}
    for name, (description, conversations) in built.items():
        longest = longest_request_tokens(conversations)
        overrides: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "seed": args.seed,
                                     "max_model_len": -(-longest // 256) * 256,
                                     "prefix_caching": args.vllm_prefix_cache == "on"}
        settings = (EngineSettings.for_recipe(recipe, model_dir, **overrides) if recipe is not None
                    else EngineSettings(model_dir=model_dir, **overrides))
        kv_bytes = (kv_memory_for(conversations, args.working_set_ratio, kv_bytes_per_token(model_dir, settings.dtype),
                                  settings.max_model_len)
                    if args.kv_cache_memory == "auto" else parse_bytes("--kv-cache-memory", args.kv_cache_memory))
        workloads[name] = Workload(name, description, conversations,
                                   dataclasses.replace(settings, kv_cache_memory_bytes=kv_bytes))
    available = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else list(range(os.cpu_count() or 1)))
    cpus = cpu_sets(ENGINES, args.cpus_per_engine or max(1, len(available) // ENGINES), available)
    order = schedule(args.workloads, args.configs, args.repeats)
    total = sum(len(c.turns) for w, _, _ in order for c in workloads[w].conversations)
    runs: list[ConfigRun] = []
    live = sys.stderr.isatty()
    started = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=not live) as progress:
        task = progress.add_task("requests", total=total)

        def on_phase(text: str) -> None:
            progress.update(task, description=text)
            if not live:  # no live bar in a log: one line per phase
                print(f"[{time.monotonic() - started:7.1f} s] {text}", file=sys.stderr, flush=True)

        def on_wave(turn: TurnRun) -> None:
            progress.update(task, advance=len(turn.completions))

        for step, (workload, repeat, config) in enumerate(order):
            position = sum(1 for w, r, _ in order[:step] if (w, r) == (workload, repeat))
            runs.append(run_config(workloads[workload], config, repeat, position, args, cpus, vocab, on_wave,
                                   on_phase))
    check_tokens(runs, tolerance_for(next(iter(workloads.values())).settings.dtype))
    descriptions = {name: w.description for name, w in workloads.items()}
    for item in render(runs, args.repeats, descriptions):
        console.print(item)
    if args.json:
        settings = {name: {k: v for k, v in dataclasses.asdict(w.settings).items() if k != "extra_config"}
                    for name, w in workloads.items()}
        args.json.write_text(json.dumps(report_json(runs, args, settings, descriptions, cpus), indent=1))
        console.print(f"wrote {args.json}")
    return 0 if all(not r.first_difference for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
