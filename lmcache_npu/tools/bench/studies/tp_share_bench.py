"""The load path of replicated KV at TP=2 (docs/storage.md "Replicated KV"), through the plugin's own exchange
(`ShareExchange`, `ShareLayout.assemble`): "device", each rank copies its share of the chunk objects host -> device
and the shares are all-gathered over the device fabric into full objects in device memory (`tp_share_exchange:
device`); "host", the shares are all-gathered with gloo in host memory and each rank copies whole objects host ->
device (`tp_share_exchange: host`); "whole", every rank holds whole objects and copies them (no sharing, the floor
of "host"). The scatter into KV pages that follows is the same kernel on the same full objects in all three, so it
is left out. Geometries: the deepseek-v3 and deepseek-v4-flash presets in CUDA
layout, whose planes are all replicated across TP, read from lmcache_npu/tools/bench/geometries/cuda/ (written by
`python -m lmcache_npu.tools.bench.studies.export_geometry --device-family cuda --out
lmcache_npu/tools/bench/geometries/cuda deepseek-v3 deepseek-v4-flash`), since a GPU machine may have no vLLM to build presets from.

    python -m lmcache_npu.tools.bench.studies.tp_share_bench                               # 2 GPUs, NCCL
    python -m lmcache_npu.tools.bench.studies.tp_share_bench --backend gloo --device cpu   # on CPU (tests run this)

Every variant first checks that each rank ends with every byte of the whole objects, then times `--reps` rounds
(median, after `--warmup`). Prints a table; `--json PATH` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRESETS = ("deepseek-v3", "deepseek-v4-flash")


GEOMETRIES = Path(__file__).resolve().parents[1] / "geometries" / "cuda"  # package data of tools.bench


def geometry(name: str, tp_size: int) -> dict[str, int]:
    """Bytes per chunk of the preset's exported CUDA geometry (a GPU machine has no vLLM to build presets;
    tests/bench/test_tp_share_bench.py checks the files against the presets), and each rank's share of them."""
    from lmcache_npu.tools.bench.geometry import load_geometry, materialize
    from lmcache_npu.layout.discovery import replicated_across_tp
    from lmcache_npu.layout.specs import SpecKind
    from lmcache_npu.transfer.shares import ShareLayout

    exported = load_geometry(GEOMETRIES / f"{name}.json")
    plan = materialize(exported, 1, torch.device("cpu")).plan
    # exported group names are "<spec kind>#<index>" (layout discovery names them so)
    kinds = [SpecKind(g.name.split("#")[0]) for g in exported.groups]
    if not all(replicated_across_tp(kind, tp_size, None) for kind in kinds):
        raise ValueError(f"{name}: groups {[k.value for k in kinds]} are not all replicated across TP; the bench "
                         "models all-latent presets")
    share = ShareLayout(plan.object_bytes, 0, 0, tp_size)
    return {"object_bytes": plan.object_bytes, "share_bytes": share.share_bytes, "chunk_tokens": plan.chunk_tokens}


def _timed(fn: Any, device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _host(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def run_rank(rank: int, size: int, args: argparse.Namespace, out: Optional[str]) -> list[dict[str, Any]]:
    from lmcache_npu.transfer.share_mover import ShareExchange
    from lmcache_npu.transfer.shares import ShareLayout

    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for name in args.presets:
        g = geometry(name, size)
        full, share, chunks = g["object_bytes"], g["share_bytes"], args.chunks
        generator = torch.Generator().manual_seed(11)
        whole_host = _host(chunks * full, device)
        whole_host.copy_(torch.randint(0, 256, (chunks * full,), dtype=torch.uint8, generator=generator))
        # rank r holds bytes [r * share, (r + 1) * share) of every chunk object, zero padded at the end
        padded = torch.zeros(chunks, size * share, dtype=torch.uint8)
        padded[:, :full] = whole_host.view(chunks, full)
        share_host = _host(chunks * share, device)
        share_host.copy_(padded[:, rank * share:(rank + 1) * share].reshape(-1))
        layout = ShareLayout(full, 0, rank, size)  # all planes replicated: no own part
        stored = list(share_host.view(chunks, share))  # the rank's stored objects: its share of each chunk
        host_exchange = ShareExchange(dist.group.WORLD)
        device_exchange = ShareExchange(dist.group.WORLD, dist.group.WORLD, device)
        whole_dev = torch.empty(chunks * full, dtype=torch.uint8, device=device)
        full_host = _host(chunks * full, device).view(chunks, full)
        gathered = torch.empty(size * chunks * share, dtype=torch.uint8, device=device)
        objects = torch.empty(chunks, full, dtype=torch.uint8, device=device)

        def whole() -> None:
            whole_dev.copy_(whole_host, non_blocking=True)

        def host() -> None:
            layout.assemble(stored, host_exchange.gather(share_host, size), full_host)
            whole_dev.copy_(full_host.view(-1), non_blocking=True)

        def on_device() -> None:
            layout.assemble(stored, device_exchange.gather(share_host, size, out=gathered), objects)

        for variant, fn, result in (("whole", whole, whole_dev), ("host", host, whole_dev),
                                    ("device", on_device, objects)):
            result.zero_()
            fn()
            if not torch.equal(result.reshape(-1).cpu(), whole_host):
                raise AssertionError(f"rank {rank} {name} {variant}: the loaded objects differ from the stored ones")
        for variant, fn, pcie, fabric in (("whole", whole, chunks * full, 0),
                                          ("host", host, chunks * full, (size - 1) * chunks * share),
                                          ("device", on_device, chunks * share, (size - 1) * chunks * share)):
            seconds = _timed(fn, device, args.reps, args.warmup)
            rows.append({"preset": name, "variant": variant, "rank": rank, "tp": size, "chunks": chunks,
                         "chunk_tokens": g["chunk_tokens"], "object_bytes": full,
                         "stored_bytes_per_rank": chunks * (full if variant == "whole" else share),
                         "pcie_bytes_per_rank": pcie, "exchanged_bytes_per_rank": fabric,
                         "exchanged_over": {"whole": "", "host": "gloo (host memory)",
                                            "device": args.backend if device.type == "cuda" else "gloo"}[variant],
                         "seconds": seconds, "GBps_per_rank": chunks * full / seconds / 1e9})
    if out is not None:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
    return rows


def _spawned(rank: int, size: int, args: argparse.Namespace, init: str, out: str) -> None:
    # gloo for host tensors (the host exchange), the device backend for device tensors
    backend = "cpu:gloo,cuda:nccl" if args.backend == "nccl" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                            device_id=torch.device(f"cuda:{rank}") if args.device == "cuda" else None)
    try:
        run_rank(rank, size, args, out)
    finally:
        dist.destroy_process_group()


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tp", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--chunks", type=int, default=16, help="chunks per load batch")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    if args.tp < 2 or args.chunks < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--tp must be >= 2, --chunks and --reps >= 1, --warmup >= 0")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    return args


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'preset':<18} {'variant':<7} {'chunks':>6} {'PCIe MB/rank':>12} {'exchanged MB/rank':>17} "
             f"{'ms (slowest rank)':>17} {'GB/s/rank':>9}"]
    keyed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        keyed.setdefault((row["preset"], row["variant"]), []).append(row)
    for (preset, variant), group in keyed.items():
        slowest = max(group, key=lambda r: r["seconds"])
        lines.append(f"{preset:<18} {variant:<7} {slowest['chunks']:>6} {slowest['pcie_bytes_per_rank'] / 1e6:>12.1f} "
                     f"{slowest['exchanged_bytes_per_rank'] / 1e6:>17.1f} {slowest['seconds'] * 1e3:>17.3f} "
                     f"{slowest['GBps_per_rank']:>9.2f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.tp, args, f"file://{tmp}/rendezvous", tmp), nprocs=args.tp, join=True)
        rows = [row for r in range(args.tp) for row in json.load(open(os.path.join(tmp, f"rank{r}.json")))]
    sys.stdout.write(table(rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
