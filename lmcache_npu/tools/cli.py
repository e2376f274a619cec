"""`lmcache-npu`: the command line (replay, bench, inspect, store-bench, bench-scheduler, bench-connector, doctor, bench-serve,
status; the node cache's commands are node_commands.py's)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..ops import BACKEND_NAMES, BackendUnavailable
from .cores import add_mode_options


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .bench.geometry import load_geometry
    from .bench.runner import render, run_bench

    console = Console(stderr=False)
    if args.chunks < 1 or args.repeats < 1:
        raise ValueError("--chunks and --repeats must be >= 1")
    _quiet_vllm()
    source = load_geometry(args.geometry) if args.geometry else args.preset
    options: dict[str, object] = {}
    if args.backend == "auto" and args.soc:  # --soc names the emulator; auto on a host would pick memcpy
        args.backend = "emu"
    if args.backend == "emu":
        options = {k: v for k, v in (("soc", args.soc), ("cores", args.cores), ("ub_bytes", args.ub_bytes)) if v}
    if args.backend == "host" and args.threads:
        options = {"threads": args.threads}
    if args.backend == "cuda":
        options = {k: v for k, v in (("path", args.path), ("blocks", args.blocks), ("threads", args.threads)) if v}
        if args.pipeline is not None:
            options["pipeline"] = args.pipeline == "on"
    if args.overlap:
        return _overlap(args, source, options)
    report = run_bench(source, args.backend, chunks=args.chunks, chunk_tokens=args.chunk_tokens, check=args.check,
                       repeats=args.repeats, seed=args.seed, progress=sys.stderr.isatty(),
                       device_family=args.device_family, **options)
    console.print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    if args.check and report.check != "ok":
        console.print(f"[red]round trip check failed: {report.check}[/red]")
        return 1
    return 0


def _overlap(args: argparse.Namespace, source, options: dict[str, object]) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from .bench.cuda_baselines import overlap, pinned_copy_overlap
    from .bench.runner import materialize_source
    from ..ops import ChunkBatch, Direction, get_backend

    if args.backend != "cuda":
        raise ValueError("--overlap measures the cuda backend next to a matmul loop; use --backend cuda")
    backend = get_backend("cuda", **options)
    m, name = materialize_source(source, args.chunks, torch.device("cuda"), args.seed, args.chunk_tokens,
                                 args.device_family or "cuda")
    objects = torch.zeros((args.chunks, m.plan.object_bytes), dtype=torch.uint8, pin_memory=True)
    table = Table(title=f"{name}: {args.chunks} chunks on a side stream during bf16 8192^3 matmuls")
    for col in ("direction", "path", "stream priority", "matmul slowdown %", "transfer GB/s", "kernel ms/batch",
                "transfers"):
        table.add_column(col, justify="right")
    results = []
    for direction in (Direction.STORE, Direction.LOAD):
        batch = ChunkBatch.build(m.plan, m.slots, objects, direction)
        for path in ("mapped", "staging"):
            for priority in (0, -1):
                r = overlap(batch, backend, path, priority=priority)
                results.append({"direction": direction.name.lower(), **r.__dict__,
                                "slowdown_percent": r.slowdown_percent})
                table.add_row(direction.name.lower(), path, "high" if priority else "default",
                              f"{r.slowdown_percent:.1f}", f"{r.transfer_gb_per_s:.2f}", f"{r.kernel_ms:.3f}",
                              str(r.transfers))
        r = pinned_copy_overlap(batch.payload_bytes, direction, m.plan.device)  # what PCIe gives during the matmuls
        results.append({"direction": direction.name.lower(), **r.__dict__, "slowdown_percent": r.slowdown_percent})
        table.add_row(direction.name.lower(), r.path, "default", f"{r.slowdown_percent:.1f}",
                      f"{r.transfer_gb_per_s:.2f}", "", str(r.transfers))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _quiet_vllm() -> None:
    """vLLM logs INFO lines to stdout when the presets import it; keep our tables and --json clean."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _status(args: argparse.Namespace) -> int:
    from .status import engine_status, fetch_metrics, parse_metrics, render, to_json

    try:
        statuses = engine_status(parse_metrics(fetch_metrics(args.url, args.timeout)))
    except (ConnectionError, ValueError) as exc:
        print(f"lmcache-npu status: {exc}", file=sys.stderr)
        return 2
    print(to_json(statuses) if args.json else render(statuses))
    return 0


def _selftest(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .selftest import FAIL, run_selftest, to_json

    items = run_selftest(npu_host_memory=args.npu_host_memory)
    if args.json:
        print(to_json(items))
    else:
        table = Table(title="lmcache-npu doctor --selftest")
        for column in ("item", "verdict", "detail"):
            table.add_column(column, overflow="fold")
        for item in items:
            table.add_row(item.name, item.verdict, item.detail)
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 1 if any(item.verdict == FAIL for item in items) else 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import DoctorOptions, blocking, render, run_doctor, to_json

    _quiet_vllm()
    if args.selftest:
        return _selftest(args)
    checks = run_doctor(DoctorOptions(args.device, args.kv_transfer_config,
                                      str(args.model_config) if args.model_config else None,
                                      str(args.disk_path) if args.disk_path else None, args.model,
                                      tensor_parallel_size=args.tensor_parallel_size,
                                      data_parallel_size=args.data_parallel_size,
                                      prefix_caching_hash_algo=args.prefix_caching_hash_algo))
    if args.json:
        print(to_json(checks))
    else:
        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 200).print(render(checks))
    return 1 if blocking(checks) else 0


def _inspect(args: argparse.Namespace) -> int:
    _quiet_vllm()
    from rich.console import Console

    from .presets import preset_layout
    from .layout_report import render_layout

    skip = tuple(args.skip_spec_kinds.split(",")) if args.skip_spec_kinds is not None else None
    options = {} if skip is None else {"skip_spec_kinds": tuple(k for k in skip if k)}
    layout, preset = preset_layout(args.preset, args.device_family, args.chunk_tokens, **options)
    weights = _weights_fingerprint(args.model) if args.model else None
    if args.json:
        data = {"preset": args.preset, "device_family": args.device_family, **layout.to_json()}
        if weights is not None:
            data["weights"] = weights
        print(json.dumps(data, indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 200)
    title = f"{args.preset} on {args.device_family}: {len(preset.kv_cache_config.kv_cache_groups)} scheduler groups"
    for item in render_layout(layout, f"{title}, {preset.model.notes}"):
        console.print(item)
    if weights is not None:
        console.print(f"weights of {args.model}: " + ", ".join(f"{k} {v}" for k, v in weights.items()))
    return 0


def _weights_fingerprint(model: str) -> dict[str, Any]:
    """The content fingerprint of a model's weights and what it was made of (the namespace's weights part)."""
    from ..identity.weights import find_model_dir, fingerprint_weights

    model_dir = find_model_dir(model)
    if model_dir is None:
        raise SystemExit(f"--model {model!r} is neither a local directory nor a cached hub snapshot")
    weights = fingerprint_weights(model_dir)
    return {**weights.describe(), "digest": f"sha256:{weights.digest.hex()}"}


def _store_bench_argv(args: argparse.Namespace) -> list[str]:
    """The command line that repeats this store-bench run (in a network namespace)."""
    argv = (["-v"] if args.verbose else []) + [
        "store-bench", "--tiers", args.tiers, "--chunk-bytes", args.chunk_bytes, "--chunks", str(args.chunks),
        "--mooncake-segment-bytes", args.mooncake_segment_bytes, "--mooncake-zero-copy", args.mooncake_zero_copy,
        "--seed", str(args.seed)]
    if args.disk_path:
        argv += ["--disk-path", str(args.disk_path)]
    if args.json:
        argv += ["--json", str(args.json)]
    return argv


def _store_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .bench.store_bench import (loopback_only_network, render_store_bench, run_in_private_network,
                                    run_store_bench)
    from ..store.config import parse_bytes

    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    mooncake = None
    if args.mooncake_master or args.mooncake_metadata:
        if not (args.mooncake_master and args.mooncake_metadata):
            raise ValueError("--mooncake-master and --mooncake-metadata go together (or neither: a local "
                             "mooncake_master is started on 127.0.0.1)")
        mooncake = {"master": args.mooncake_master, "metadata": args.mooncake_metadata,
                    "global_segment_bytes": parse_bytes("--mooncake-segment-bytes", args.mooncake_segment_bytes)}
    if "mooncake" in tiers and mooncake is None and not loopback_only_network():
        # the local client's transfer-engine ports ignore the bind address: run where nothing can reach them
        status = run_in_private_network([sys.executable, "-m", "lmcache_npu.tools.cli", *_store_bench_argv(args)])
        if status is not None:
            return status
    zero_copy = {"on": (True,), "off": (False,), "both": (True, False)}[args.mooncake_zero_copy]
    results = run_store_bench(tiers, parse_bytes("--chunk-bytes", args.chunk_bytes), args.chunks,
                              disk_path=args.disk_path, mooncake=mooncake, progress=sys.stderr.isatty(),
                              seed=args.seed, mooncake_zero_copy=zero_copy)
    Console(width=None if sys.stdout.isatty() else 200).print(render_store_bench(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2))
    bad = [r.tier for r in results if r.check != "ok" or r.failed]
    if bad:
        print(f"lmcache-npu: store-bench: {', '.join(bad)} lost or changed chunks", file=sys.stderr)
        return 1
    return 0


def _bench_scheduler(args: argparse.Namespace) -> int:
    _quiet_vllm()
    from rich.console import Console

    from .bench.scheduler_bench import INDEXES, render_scheduler_bench, run_scheduler_bench

    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    indexes = {"both": INDEXES, "in-process": INDEXES[:1], "node": INDEXES[1:]}[args.index]
    results = run_scheduler_bench(args.repeats, indexes)
    Console(width=None if sys.stdout.isatty() else 200).print(render_scheduler_bench(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2))
    return 0


def _bench_connector(args: argparse.Namespace) -> int:
    _quiet_vllm()
    from rich.console import Console

    from .bench.connector_path import render_connector_path, run_connector_path
    from .bench.geometry import load_geometry

    source = load_geometry(args.geometry) if args.geometry else args.preset
    reports = []
    for chunks in args.chunks:
        report = run_connector_path(source, args.backend, chunks=chunks, repeats=args.repeats,
                                    device_family=args.device_family, seed=args.seed, starts=args.start)
        Console(width=None if sys.stdout.isatty() else 200).print(render_connector_path(report))
        reports.append(report)
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in reports], indent=2))
    return 0 if all(r.same_bytes for r in reports) else 1


def _replay_workload(args: argparse.Namespace, vocab: int) -> tuple[list, str]:
    from .replay.workload import load_trace, multi_turn_chat, prefix_repetition

    if args.trace is not None:
        return load_trace(args.trace, vocab, args.seed), f"trace {args.trace}"
    if args.workload == "chat":
        conversations = multi_turn_chat(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                        args.output_tokens, vocab, args.seed)
        return conversations, (f"{args.conversations} conversations x {args.turns} turns after a "
                               f"{args.system_tokens}-token system prompt")
    prefixes = args.prefix_repetition_num_prefixes
    if args.num_prompts < prefixes:
        raise ValueError(f"--num-prompts ({args.num_prompts}) must be at least --prefix-repetition-num-prefixes "
                         f"({prefixes})")
    conversations = prefix_repetition(prefixes, args.num_prompts // prefixes, args.prefix_repetition_prefix_len,
                                      args.prefix_repetition_suffix_len, args.prefix_repetition_output_len, vocab,
                                      args.seed)
    return conversations, (f"prefix_repetition: {len(conversations)} prompts over {prefixes} prefixes of "
                           f"{args.prefix_repetition_prefix_len} tokens")


def _replay_plugin_config(args: argparse.Namespace, disk_dir: Optional[str]) -> dict[str, object]:
    from ..config import read_config_file
    from .cores import parse_cpus

    config: dict[str, object] = read_config_file(str(args.config)) if args.config else {}
    config.update({k: v for k, v in (("backend", args.backend), ("chunk_tokens", args.chunk_tokens),
                                     ("cpu_bytes", args.cpu_bytes), ("load_slices", args.load_slices))
                   if v is not None})
    transfer_cpus = parse_cpus("--transfer-cpus", args.transfer_cpus)
    if transfer_cpus is not None:
        config["transfer_cpus"] = list(transfer_cpus)
    if disk_dir is not None:
        config.update(disk_path=disk_dir, disk_bytes=args.disk_bytes)
    return config


def _replay(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from .run_log import RunLog

    # vLLM logs at INFO into the run log, where an engine that failed to start has its reason
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PYTHONHASHSEED", "20261127")  # disk-tier chunk keys (vLLM reads it); 0 is refused
    path = args.log_file
    if path is None:
        fd, name = tempfile.mkstemp(prefix="lmcache-npu-replay-", suffix=".log")
        os.close(fd)
        path = Path(name)
    with RunLog(path, until_exit=True) as run_log:
        run_log.console_err.write(f"engine logs (vLLM, torch, Mooncake, progress bars): {run_log.path}\n")
        return _replay_in(args, run_log)


def _replay_in(args: argparse.Namespace, run_log: Any) -> int:
    """The replay, with the engines' output in `run_log` and the tool's on its console streams."""
    import dataclasses
    import os
    import tempfile

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .replay.configs import named_configs
    from .replay.connectors import connector_services
    from .replay.engine import EngineSettings, engine_available
    from .replay.models import VOCAB, make_model, model_vocab, recipe_from_config_file, resolve_recipe
    from .replay.replay import render_report, run_replay
    from .replay.sizing import kv_bytes_per_token, kv_memory_for, longest_request_tokens, working_set_tokens
    from ..store.config import parse_bytes

    missing = engine_available()
    if missing:
        raise ValueError(f"replay needs a real vLLM engine: {missing}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    from .cores import check_apart, parse_cpus, pin_engine_here

    engine_cpus = parse_cpus("--engine-cpus", args.engine_cpus)
    check_apart(engine_cpus, parse_cpus("--transfer-cpus", args.transfer_cpus))
    if engine_cpus is not None:  # before any engine starts: its threads inherit this thread's cores
        pin_engine_here(engine_cpus)
    out, err = run_log.console_out, run_log.console_err
    console = Console(file=out, width=None if out.isatty() else 120)  # the demo's report is laid out for 120 columns
    if args.model_config is not None:
        recipe = recipe_from_config_file(args.model_config)
        model_dir, label = str(make_model(recipe, progress=console.log)), f"{args.model_config}"
    elif os.path.isdir(args.model):
        recipe, model_dir, label = None, args.model, args.model
    else:
        recipe = resolve_recipe(args.model)
        model_dir, label = str(make_model(recipe, progress=console.log)), f"{recipe.name} ({recipe.exercises})"
    vocab = model_vocab(model_dir, VOCAB)
    conversations, workload = _replay_workload(args, vocab)
    # the restart phase sends one more turn: room for the longest history plus its next message and answer
    longest = longest_request_tokens(conversations) + max(len(c.turns[-1].user) + c.turns[-1].output_tokens
                                                          for c in conversations)
    overrides: dict[str, object] = {"max_num_seqs": args.max_num_seqs, "seed": args.seed,
                                    "max_model_len": -(-longest // 256) * 256,
                                    "prefix_caching": args.vllm_prefix_cache == "on"}
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    settings = (EngineSettings.for_recipe(recipe, model_dir, **overrides) if recipe is not None
                else EngineSettings(model_dir=model_dir, **overrides))  # type: ignore[arg-type]
    if args.kv_cache_memory == "auto":  # the working set `--working-set-ratio` times what the device holds
        kv_bytes = kv_memory_for(conversations, args.working_set_ratio, kv_bytes_per_token(model_dir, settings.dtype),
                                 settings.max_model_len)
    else:
        kv_bytes = parse_bytes("--kv-cache-memory", args.kv_cache_memory)
    settings = dataclasses.replace(settings, kv_cache_memory_bytes=kv_bytes)
    turns = sum(len(c.turns) for c in conversations)
    names = [n.strip() for n in args.configs.split(",") if n.strip()] + (["peer"] if args.peer else [])
    with tempfile.TemporaryDirectory(prefix="lmcache-npu-replay-") as scratch, \
            connector_services(named_configs(names, {})) as services:
        disk_dir = None if args.no_disk else (str(args.disk_path) if args.disk_path else scratch)
        configs = named_configs(names, _replay_plugin_config(args, disk_dir))
        for name, reason in services.unavailable.items():
            console.print(f"[yellow]{name} does not run: {reason}[/yellow]")
        configs = services.runnable(configs)
        restarts = not args.no_restart and any(c.plugin for c in configs)
        total = args.repeats * len(configs) * turns + (2 * len(conversations) if restarts else 0)
        live = err.isatty()  # off a terminal a bar cannot redraw: each phase is a line instead
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(file=err), transient=not live, disable=not live) as progress:
            task = progress.add_task("requests", total=total)

            def on_turn(run: str, turn) -> None:
                progress.update(task, advance=len(turn.completions), description=f"{run}: turn {turn.turn + 1} done")

            def on_phase(text: str) -> None:
                progress.update(task, description=text)
                if not live:
                    err.write(f"{text}\n")

            report = run_replay(label, conversations, workload, settings, configs, vocab, repeats=args.repeats,
                                working_set_tokens=working_set_tokens(conversations), restart=not args.no_restart,
                                on_turn=on_turn, on_phase=on_phase,
                                services=services)
    report.settings["kv_cache_memory_bytes"] = kv_bytes
    for item in render_report(report):
        console.print(item)
    if args.plot is not None:
        from .replay.plots import write_plots

        for path in write_plots(report, args.plot):
            console.print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.all_match else 1


def _add_chunk_source(parser: argparse.ArgumentParser, default_preset: str) -> None:
    """--backend and where the chunks' shapes come from: a preset (needs vLLM's spec classes) or a geometry file."""
    from .presets import DEVICE_FAMILIES, preset_names

    parser.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=preset_names(), default=default_preset,
                        help="a model built through layout discovery (see `lmcache-npu inspect`)")
    source.add_argument("--geometry", type=Path, help="JSON file with chunk_tokens and groups (see docs/kernels.md); "
                        "what a machine without vLLM benchmarks")
    parser.add_argument("--device-family", choices=DEVICE_FAMILIES, default=None,
                        help="shape the preset like vllm-ascend or like vLLM on CUDA (default: cuda for the cuda "
                             "backend, ascend otherwise)")


def build_parser() -> argparse.ArgumentParser:
    from .presets import DEVICE_FAMILIES, preset_names

    parser = argparse.ArgumentParser(prog="lmcache-npu", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="a multi-turn workload on a real vLLM engine, vLLM alone and with the "
                            "plugin (prefix cache on in both), repeated: tokens by source, TTFT, prefill and wall "
                            "time per turn, identical tokens; then a restart on the disk tier")
    replay.add_argument("--model", default="gemma3-demo",
                        help="a model recipe made on this machine (gemma3-demo, llama, gemma3, gpt-oss, qwen3-next, "
                             "deepseek-mla) or a model directory (default gemma3-demo)")
    replay.add_argument("--model-config", type=Path, help="a Hugging Face config.json: a model of that "
                        "architecture with random weights is made and served")
    replay.add_argument("--dtype", help="the engine's dtype (default: the recipe's, or the model's)")
    replay.add_argument("--workload", choices=["chat", "prefix-repetition"], default="chat")
    replay.add_argument("--trace", type=Path, help="JSONL conversations, one per line: {\"system\": S, \"turns\": "
                        "[{\"user\": U, \"output\": N}, ...]} (S, U: token ids or lengths); replaces --workload")
    replay.add_argument("--conversations", type=int, default=16)
    replay.add_argument("--turns", type=int, default=4)
    replay.add_argument("--system-tokens", type=int, default=512, help="the system prompt all conversations share")
    replay.add_argument("--user-tokens", type=int, default=128, help="each turn's new user message")
    replay.add_argument("--output-tokens", type=int, default=32, help="tokens generated per turn")
    replay.add_argument("--num-prompts", type=int, default=32, help="prefix-repetition: prompts in all")
    replay.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    replay.add_argument("--prefix-repetition-prefix-len", type=int, default=1024)
    replay.add_argument("--prefix-repetition-suffix-len", type=int, default=128)
    replay.add_argument("--prefix-repetition-output-len", type=int, default=32)
    replay.add_argument("--backend", choices=list(BACKEND_NAMES), help="the plugin's transfer backend "
                        "(default auto: memcpy, the host backend, on a host-only machine)")
    replay.add_argument("--chunk-tokens", type=int, help="tokens per stored chunk (default: the plugin's choice)")
    replay.add_argument("--cpu-bytes", default="2GiB", help="the plugin's host arena (default 2GiB: the workloads "
                        "here fit; the plugin's own default, 8GiB, takes seconds to touch)")
    replay.add_argument("--disk-path", type=Path, help="the plugin's disk tier (default: a temporary directory); "
                        "each timed run with the plugin gets an empty run-N directory under it")
    replay.add_argument("--disk-bytes", default="4GiB", help="the disk tier's capacity (default 4GiB)")
    replay.add_argument("--no-disk", action="store_true", help="host arena only")
    replay.add_argument("--config", type=Path, help="a YAML file of more plugin config keys (e.g. mooncake); "
                        "the options above override it")
    replay.add_argument("--kv-cache-memory", default="auto", help="vLLM's device KV cache, or auto (default): "
                        "sized so the workload's working set is --working-set-ratio times what it holds")
    replay.add_argument("--working-set-ratio", type=float, default=4.0, help="with --kv-cache-memory auto: the "
                        "working set over the device KV capacity (default 4: the regime offload exists for)")
    replay.add_argument("--max-num-seqs", type=int, default=16)
    replay.add_argument("--vllm-prefix-cache", choices=["on", "off"], default="on", help="vLLM's own prefix cache "
                        "in every run (default on, as vLLM ships; off: every hit is the plugin's)")
    replay.add_argument("--repeats", type=int, default=3, help="runs of each configuration, the order alternating; "
                        "tables show medians and min-max (default 3)")
    replay.add_argument("--no-restart", action="store_true", help="skip the restart phase (the next turn on a "
                        "fresh engine over the last run's disk tier, against a cold restart without the plugin)")
    replay.add_argument("--configs", default="baseline,plugin", help="the configurations compared, comma-separated: "
                        "baseline (vLLM alone, always), plugin, plugin-async, plugin-sliced (the plugin with "
                        "load_mode async or sliced; plugin keeps --config's, auto by default), peer (vLLM's own "
                        "MooncakeStoreConnector on a loopback mooncake_master); default baseline,plugin")
    add_mode_options(replay, "pin the engine (this process's threads, torch's intra-op threads: one per CPU) to "
                             "these CPU ids, e.g. 0 (default: not pinned)")
    replay.add_argument("--peer", action="store_true", help="adds the peer (same as --configs ...,peer); when it "
                        "cannot start here (no Mooncake, a vLLM without the connector) the replay says why and runs "
                        "without it")
    replay.add_argument("--plot", type=Path, help="write replay-ttft.png and replay-sources.png into this directory")
    replay.add_argument("--seed", type=int, default=0)
    replay.add_argument("--json", type=Path, help="write the report as JSON")
    replay.add_argument("--log-file", type=Path, help="where the engines' output goes (vLLM's log, progress bars, "
                        "torch and Mooncake lines; default: a new file in the temporary directory); its path is "
                        "printed")
    replay.set_defaults(func=_replay)

    bench = sub.add_parser("bench", help="store and load N chunks of a model's KV geometry and report bandwidth")
    _add_chunk_source(bench, default_preset="deepseek-v4-flash")
    bench.add_argument("--chunks", type=int, default=4)
    bench.add_argument("--chunk-tokens", type=int, default=None, help="override the geometry's chunk_tokens")
    bench.add_argument("--check", action="store_true", help="verify every byte; exit 1 on any mismatch")
    bench.add_argument("--json", type=Path, help="write the report as JSON")
    bench.add_argument("--repeats", type=int, default=1, help="runs per direction; the fastest is reported")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--soc", choices=["a2", "a3", "310p"], help="emu: the SoC to emulate")
    bench.add_argument("--cores", type=int, help="emu: vector cores to launch")
    bench.add_argument("--ub-bytes", type=int, help="emu: UB capacity per core")
    bench.add_argument("--path", choices=["auto", "mapped", "staging"], help="cuda: how host objects are reached")
    bench.add_argument("--pipeline", choices=["on", "off"], help="cuda staging: overlap kernel and copy engine "
                       "by slices inside the one launch (default: on for store, off for load)")
    bench.add_argument("--blocks", type=int, help="cuda: thread blocks per launch")
    bench.add_argument("--threads", type=int, help="cuda: threads per block; host: copy threads (default 1)")
    bench.add_argument("--overlap", action="store_true",
                       help="cuda: matmul slowdown and transfer GB/s with transfers on a side stream")
    bench.set_defaults(func=_bench)

    inspect = sub.add_parser("inspect", help="show how a model's KV-cache groups become a transfer plan")
    inspect.add_argument("--preset", choices=preset_names(), required=True)
    inspect.add_argument("--device-family", choices=DEVICE_FAMILIES, default="ascend")
    inspect.add_argument("--chunk-tokens", type=int, default=None,
                         help="tokens per chunk (default 128 (one CPU/Ascend block), or the mamba state interval for recurrent models)")
    inspect.add_argument("--skip-spec-kinds", default=None,
                         help="comma-separated spec kinds to skip, e.g. compressor_state (default: none; state "
                              "windows are never stored whole, only the boundary rows an exact restore reads)")
    inspect.add_argument("--model", help="also fingerprint this model directory's weights (what the namespace's "
                         "weights part is made of)")
    inspect.add_argument("--json", action="store_true", help="print the layout as JSON")
    inspect.set_defaults(func=_inspect)

    store = sub.add_parser("store-bench", help="put/get throughput of the store tiers (host arena, disk, Mooncake)")
    store.add_argument("--tiers", default="cpu,disk", help="comma-separated: cpu, disk, mooncake (default cpu,disk)")
    store.add_argument("--chunk-bytes", default="4MiB", help="bytes per chunk object (e.g. 8MiB; default 4MiB)")
    store.add_argument("--chunks", type=int, default=256, help="chunks per tier (default 256)")
    store.add_argument("--disk-path", default=None, help="directory for the disk tier (default: a temp directory)")
    store.add_argument("--mooncake-master", default=None,
                       help="host:port of a running mooncake_master (default: start one on 127.0.0.1, and run "
                            "in a loopback-only network namespace where one can be made)")
    store.add_argument("--mooncake-metadata", default=None, help="its metadata server, e.g. http://host:8080/metadata")
    store.add_argument("--mooncake-segment-bytes", default="2GiB",
                       help="memory this client contributes to a running cluster (default 2GiB)")
    store.add_argument("--mooncake-zero-copy", choices=("on", "off", "both"), default="off",
                       help="mooncake.zero_copy: off (the default, as in serving) moves bytes through a bounce buffer "
                            "and checks each get in its slot, on registers the arena (a trusted network only), both "
                            "prints a row each")
    store.add_argument("--json", type=Path, help="write the results as JSON")
    store.add_argument("--seed", type=int, default=0)
    store.set_defaults(func=_store_bench)

    doctor = sub.add_parser("doctor", help="check this machine before serving: versions, CANN and SoC, native modules, "
                            "devices, locked memory, disk, Mooncake, the kv-transfer-config, a model's layout")
    doctor.add_argument("--device", choices=["auto", "npu", "cuda", "cpu"], default="auto",
                        help="what you will serve on (default: what is visible); a missing one is then blocking")
    doctor.add_argument("--kv-transfer-config", help="the JSON you pass to vllm serve (default: $KV_TRANSFER_CONFIG)")
    doctor.add_argument("--model-config", type=Path, help="a model's config.json: the plan layout discovery makes")
    doctor.add_argument("--disk-path", type=Path, help="check this disk tier directory (default: the config's)")
    doctor.add_argument("--model", help="the model directory (or cached hub id) you will serve: prints the content "
                        "fingerprint its weights give the chunk namespace")
    doctor.add_argument("--tensor-parallel-size", type=int, default=1, metavar="TP",
                        help="the --tensor-parallel-size you pass to vllm serve: the device memory estimate counts "
                        "the TP share exchange's HCCL communicator when it is above 1")
    doctor.add_argument("--data-parallel-size", type=int, default=1, metavar="DP",
                        help="the --data-parallel-size you pass to vllm serve: each rank's disk directory is checked")
    doctor.add_argument("--prefix-caching-hash-algo", default="sha256",
                        help="the --prefix-caching-hash-algo you pass to vllm serve (default sha256, vLLM's)")
    doctor.add_argument("--selftest", action="store_true",
                        help="on an Ascend card, in under a minute: the arena's host-memory path and what ACL says of "
                        "it, a 32 MiB copy against torch's pinned copy, a kernel round trip byte-checked against the "
                        "torch oracle, a matmul with and without transfers in flight (docs/testing.md)")
    doctor.add_argument("--npu-host-memory", default="auto",
                        help="with --selftest: the npu_host_memory path to test (default auto)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=_doctor)

    status = sub.add_parser("status", help="a running engine's store: tiers, capacity and use, hit rates per tier, "
                            "namespace, arena segments (from the /metrics vLLM already serves); or the node cache's, "
                            "with its engines' leases")
    status.add_argument("--url", default="http://localhost:8000",
                        help="the vLLM server, or a node cache's --metrics-port address (its /metrics is read; "
                        "default http://localhost:8000)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=_status)

    from .node_commands import add_node_commands  # node-cache, node-ping, bench-node-restart

    add_node_commands(sub)

    sched = sub.add_parser("bench-scheduler", help="host time the connector adds to vLLM's scheduler: lookups of a "
                           "128K-token prompt, connector metadata for 64 running requests")
    sched.add_argument("--repeats", type=int, default=200, help="calls per lookup measurement (default 200)")
    sched.add_argument("--index", choices=["both", "in-process", "node"], default="both",
                       help="the scheduler half's index: in process, the node cache's client (a service in a "
                       "thread), or both side by side (default)")
    sched.add_argument("--json", type=Path, help="write the results as JSON")
    sched.set_defaults(func=_bench_scheduler)

    worker = sub.add_parser("bench-connector", help="chunks stored and loaded through the connector's worker path "
                            "(store executor, transfer lanes) next to the bench's transfer of the same chunks")
    _add_chunk_source(worker, default_preset="llama3-8b")
    worker.add_argument("--chunks", type=int, nargs="+", default=[1, 8], help="chunks per transfer (default 1 8)")
    worker.add_argument("--repeats", type=int, default=10, help="transfers per path and direction; best reported")
    worker.add_argument("--start", nargs="+", choices=["idle", "queued"], default=["idle"],
                        help="idle: each transfer starts on an idle GPU; queued: behind 1 ms of the model's GPU work, "
                             "as in serving (CUDA)")
    worker.add_argument("--seed", type=int, default=0)
    worker.add_argument("--json", type=Path, help="write the reports as JSON")
    worker.set_defaults(func=_bench_connector)

    from .servebench.command import add_bench_serve_parser  # bench-serve: vllm serve under vLLM's own load generator

    add_bench_serve_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (ValueError, BackendUnavailable) as exc:
        print(f"lmcache-npu: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
