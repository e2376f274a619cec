"""`lmcache-npu bench-serve`: its arguments and what it does (the subcommand in lmcache_npu/tools/cli.py is these two
functions)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..cores import add_mode_options

logger = logging.getLogger(__name__)


# the overhead verdict at a lone request and at two: with the default device KV (vLLM counts about 850 tokens of it)
# four 272-token random requests do not fit, vLLM preempts, and the plugin reloads what it stored (measured: 3712
# tokens), so concurrency 4 would time preemption recovery, not the cost of a plugin that finds nothing
RANDOM_CONCURRENCY = (1, 2)
# vLLM's KV capacity on this CPU backend is about 0.83 of kv_bytes_per_token's estimate (847 of 1024 tokens, gemma3)
CAPACITY_MARGIN = 0.8
REUSE_CONCURRENCY = (4,)  # one pace for the reusing workloads keeps the default sweep near 12 minutes on 2 cores
# one run of random moves a few percent either way on a 2-core VM (the peer, finding nothing, showed -10 %): the
# verdict takes the median of three runs per pace
RANDOM_REPEATS = 3
REUSE_REPEATS = 3  # one run of a reusing workload moves about 5 % either way on 2 cores


def add_bench_serve_parser(sub: Any) -> None:
    """The `bench-serve` subparser on `sub` (argparse's subparsers of the main command)."""
    from .workloads import ChatShape, PrefixShape, RandomShape

    p = sub.add_parser("bench-serve", help="vllm serve without and with the plugin (and vLLM's MooncakeStoreConnector "
                                           "where it runs), driven by vLLM's `vllm bench serve`: prefix_repetition, a "
                                           "multi-turn chat trace, random")
    p.add_argument("--model", default="gemma3-demo", help="a model recipe (lmcache_npu.tools.replay.models) or a model "
                                                          "directory (default gemma3-demo, the replay's model)")
    p.add_argument("--dtype", help="the server's dtype (default: the recipe's, else float32)")
    p.add_argument("--configs", nargs="+", default=["baseline", "plugin", "peer"],
                   help="configurations: baseline, plugin, plugin-async, plugin-sliced (the plugin with load_mode "
                        "async or sliced; plugin: auto), peer (default baseline plugin peer; a peer that cannot "
                        "start is skipped)")
    add_mode_options(p, "bind the server's model threads to these CPU ids (vLLM's VLLM_CPU_OMP_THREADS_BIND), e.g. 0 "
                        "(default: vLLM's auto binding)")
    p.add_argument("--workloads", nargs="+", default=["prefix_repetition", "chat", "random"],
                   help="prefix_repetition, chat, random (default all three)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--concurrency", type=int, nargs="+",
                      help=f"max-concurrency values random (the no-reuse verdict) runs at (default "
                           f"{' '.join(map(str, RANDOM_CONCURRENCY))})")
    pace.add_argument("--request-rate", type=float, nargs="+",
                      help="request rates (req/s) every workload runs at, instead of concurrency caps")
    p.add_argument("--random-repeats", type=int, default=RANDOM_REPEATS,
                   help=f"runs of random at each pace, in rounds over the paces; the no-reuse verdict compares "
                        f"their medians (default {RANDOM_REPEATS})")
    p.add_argument("--reuse-repeats", type=int, default=REUSE_REPEATS,
                   help=f"runs of prefix_repetition and chat at each of their paces, each on fresh prompts; the table "
                        f"shows medians (default {REUSE_REPEATS})")
    p.add_argument("--reuse-concurrency", type=int, nargs="+",
                   help=f"max-concurrency values prefix_repetition and chat run at (default "
                        f"{' '.join(map(str, REUSE_CONCURRENCY))}; not with --request-rate)")
    chat, prefix, rand = ChatShape(), PrefixShape(), RandomShape()
    p.add_argument("--chat-conversations", type=int, default=chat.conversations)
    p.add_argument("--chat-turns", type=int, default=chat.turns)
    p.add_argument("--chat-system-tokens", type=int, default=chat.system_tokens,
                   help="shared system prompt (a multiple of 16)")
    p.add_argument("--chat-user-tokens", type=int, default=chat.user_tokens,
                   help="each turn's message (a multiple of 16)")
    p.add_argument("--chat-output-tokens", type=int, default=chat.output_tokens,
                   help="each turn's answer (a multiple of 16)")
    p.add_argument("--prefix-num-prompts", type=int, default=prefix.num_prompts)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=prefix.num_prefixes)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=prefix.prefix_tokens)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=prefix.suffix_tokens)
    p.add_argument("--prefix-repetition-output-len", type=int, default=prefix.output_tokens)
    p.add_argument("--random-num-prompts", type=int, default=rand.num_prompts)
    p.add_argument("--random-input-len", type=int, default=rand.input_tokens)
    p.add_argument("--random-output-len", type=int, default=rand.output_tokens)
    p.add_argument("--chunk-tokens", type=int, help="the plugin's tokens per chunk (default: the plugin's choice)")
    p.add_argument("--cpu-bytes", default="1GiB", help="the plugin's host arena (default 1GiB)")
    p.add_argument("--kv-cache-memory", default="auto", help="vLLM's device KV cache, or auto (default): sized so "
                                                             "the largest working set is --working-set-ratio times it")
    p.add_argument("--working-set-ratio", type=float, default=4.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--warmup-prompts", type=int, default=2, help="unrelated random prompts each server gets first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep server logs and bench results here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the points and the verdict as JSON")
    p.add_argument("--plot", type=Path, help="write serve-throughput.png and serve-ttft-p99.png into this directory")
    p.set_defaults(func=run_bench_serve)


def _workloads(args: argparse.Namespace) -> Any:
    from .workloads import ChatShape, PrefixShape, RandomShape, Workloads

    return Workloads(
        ChatShape(args.chat_conversations, args.chat_turns, args.chat_system_tokens, args.chat_user_tokens,
                  args.chat_output_tokens),
        PrefixShape(args.prefix_num_prompts, args.prefix_repetition_num_prefixes, args.prefix_repetition_prefix_len,
                    args.prefix_repetition_suffix_len, args.prefix_repetition_output_len),
        RandomShape(args.random_num_prompts, args.random_input_len, args.random_output_len))


def _paces(args: argparse.Namespace) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(random's paces, the reusing workloads' paces) from --concurrency / --reuse-concurrency / --request-rate."""
    from .sweep import grid

    if args.request_rate:
        if args.reuse_concurrency:
            raise ValueError("--reuse-concurrency paces by concurrency: it cannot go with --request-rate")
        rates = tuple(grid([], args.request_rate))
        return rates, rates
    return (tuple(grid(args.concurrency or list(RANDOM_CONCURRENCY), [])),
            tuple(grid(args.reuse_concurrency or list(REUSE_CONCURRENCY), [])))


def sweep_settings(args: argparse.Namespace) -> Any:
    """The SweepSettings the arguments ask for (workloads, paces, repeats); bad values raise ValueError."""
    from .sweep import SweepSettings

    random_paces, reuse_paces = _paces(args)
    return SweepSettings(_workloads(args), tuple(args.workloads), paces=random_paces,
                         warmup_prompts=args.warmup_prompts, seed=args.seed, reuse_paces=reuse_paces,
                         random_repeats=args.random_repeats, reuse_repeats=args.reuse_repeats)


def sweep_json(sweep: Any) -> dict[str, Any]:
    """The sweep's part of the JSON settings: which workloads ran, at which paces, how many times per pace."""
    return {"workloads": list(sweep.names),
            "paces": {name: [p.label for p in sweep.paces_for(name)] for name in sweep.names},
            "random_repeats": sweep.random_repeats, "reuse_repeats": sweep.reuse_repeats}


def random_fits(sweep: Any, device_tokens: int, block_tokens: int = 128) -> bool:
    """Whether `random` at its highest concurrency fits the device KV (whole blocks per request, vLLM's capacity
    taken as CAPACITY_MARGIN of the estimate): if not, vLLM preempts and the no-reuse verdict measures the plugin
    reloading preempted requests instead of its cost."""
    if "random" not in sweep.names:
        return True
    caps = [p.max_concurrency for p in sweep.paces_for("random")]
    if any(c is None for c in caps):  # paced by rate: no cap to check against
        return True
    shape = sweep.workloads.random
    blocks = -(-(shape.input_tokens + shape.output_tokens) // block_tokens)
    return max(caps) * blocks * block_tokens <= CAPACITY_MARGIN * device_tokens


def _warn_if_random_preempts(sweep: Any, device_tokens: int, say: Any) -> None:
    if not random_fits(sweep, device_tokens):
        message = (f"random at concurrency {max(p.max_concurrency for p in sweep.paces_for('random'))} does not fit "
                   f"the device KV (about {int(CAPACITY_MARGIN * device_tokens)} usable tokens): vLLM will preempt, "
                   f"and the no-reuse verdict will time the plugin reloading preempted requests")
        logger.warning(message)
        say(f"warning: {message}")


def run_bench_serve(args: argparse.Namespace) -> int:
    """Sizes the servers from the workloads, sweeps every configuration, prints the table and the verdict."""
    from rich.console import Console

    from ..cores import check_apart, parse_cpus
    from ..replay.configs import named_configs
    from ..replay.engine import engine_available
    from ..replay.models import VOCAB, make_model, model_vocab, resolve_recipe
    from ..replay.sizing import kv_bytes_per_token, kv_memory_for
    from ...store.config import parse_bytes
    from .plots import write_plots
    from .report import check_baseline, render, to_json
    from .server import ServerSettings
    from .sweep import run_sweep
    from .tokenizer import tokenizer_dir

    missing = engine_available()
    if missing:
        raise ValueError(f"bench-serve needs a real vLLM engine: {missing}")
    console = Console(width=None if sys.stdout.isatty() else 200)
    if os.path.isdir(args.model):
        model_dir, dtype = args.model, args.dtype or "float32"
    else:
        recipe = resolve_recipe(args.model)
        model_dir, dtype = str(make_model(recipe, progress=console.log)), args.dtype or recipe.dtype
    vocab = model_vocab(model_dir, VOCAB)
    sweep = sweep_settings(args)
    workloads = sweep.workloads
    largest, longest = workloads.sizing(sweep.names, vocab)
    max_model_len = -(-longest // 256) * 256
    if args.kv_cache_memory == "auto":
        kv_bytes = kv_memory_for(workloads.largest_conversations(sweep.names, vocab), args.working_set_ratio,
                                 kv_bytes_per_token(model_dir, dtype), max_model_len)
    else:
        kv_bytes = parse_bytes("--kv-cache-memory", args.kv_cache_memory)
    plugin_config: dict[str, object] = {"cpu_bytes": args.cpu_bytes}
    if args.chunk_tokens is not None:
        plugin_config["chunk_tokens"] = args.chunk_tokens
    if args.load_slices is not None:
        plugin_config["load_slices"] = args.load_slices
    engine_cpus, transfer_cpus = (parse_cpus("--engine-cpus", args.engine_cpus),
                                  parse_cpus("--transfer-cpus", args.transfer_cpus))
    check_apart(engine_cpus, transfer_cpus)
    if transfer_cpus is not None:
        plugin_config["transfer_cpus"] = list(transfer_cpus)
    configs = named_configs(args.configs, plugin_config)
    server = ServerSettings(model_dir, str(tokenizer_dir(vocab)), dtype, max_model_len, kv_bytes, args.max_num_seqs,
                            prefix_caching=True, seed=args.seed, engine_cpus=engine_cpus)
    device_tokens = kv_bytes // kv_bytes_per_token(model_dir, dtype)
    _warn_if_random_preempts(sweep, device_tokens, console.log)
    console.log(f"device KV {kv_bytes / 2**20:.0f} MiB (about {device_tokens} tokens); the largest working set "
                f"{largest} tokens, {largest / max(device_tokens, 1):.1f}x that")
    with tempfile.TemporaryDirectory(prefix="lmcache-npu-bench-serve-") as scratch:
        work = args.work_dir or Path(scratch)
        result = run_sweep(configs, server, sweep, work, on_phase=console.log)
    check_baseline(result)
    title = (f"bench-serve: {Path(model_dir).name}, vLLM prefix cache on in every configuration, device KV "
             f"{kv_bytes / 2**20:.0f} MiB (working set {largest / max(device_tokens, 1):.1f}x), {len(result.points)} "
             f"runs")
    for item in render(result, title):
        console.print(item)
    if args.plot is not None:
        for path in write_plots(result, args.plot):
            console.print(f"wrote {path}")
    if args.json is not None:
        settings = {"model": model_dir, "dtype": dtype, "kv_cache_memory_bytes": kv_bytes,
                    "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
                    "working_set_tokens": largest, "device_tokens_estimate": device_tokens,
                    "plugin_config": plugin_config, "engine_cpus": engine_cpus, **sweep_json(sweep)}
        args.json.write_text(json.dumps(to_json(result, settings), indent=2))
        console.print(f"wrote {args.json}")
    return 0
