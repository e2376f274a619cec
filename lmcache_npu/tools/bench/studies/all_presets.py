"""Runs `lmcache-npu bench` over every preset and prints one summary table (optionally JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from lmcache_npu.tools.bench.presets import PRESETS
from lmcache_npu.tools.bench.runner import default_family, run_bench
from lmcache_npu.tools.presets.catalog import MODELS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device-family", choices=["ascend", "cuda"], default=None,
                        help="preset tensor shapes (default: cuda for the cuda backend, ascend otherwise)")
    args = parser.parse_args()
    reports = []
    family = args.device_family or default_family(args.backend)
    for name in track([p for p in PRESETS if family in MODELS[p].families], description="presets"):
        options = {"soc": "310p"} if name.endswith("310p") and args.backend == "emu" else {}
        reports.append(run_bench(name, args.backend, chunks=args.chunks, check=True, repeats=args.repeats,
                                 progress=False, device_family=family, **options))
    table = Table(title=f"all presets, {args.chunks} chunks each")
    for col in ("preset", "backend", "groups", "planes moved", "object B", "naive B", "DMA ops/chunk",
                "store GB/s", "load GB/s", "check"):
        table.add_column(col, justify="right")
    for r in reports:
        store, load = r.rows
        table.add_row(r.preset, r.backend, str(r.groups), f"{r.moved_planes}/{r.planes}", f"{r.object_bytes:,}",
                      f"{r.naive_object_bytes:,}", "-" if store.dma_ops is None else f"{store.dma_ops / r.chunks:.0f}",
                      f"{store.gb_per_s:.2f}", f"{load.gb_per_s:.2f}", str(r.check))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in reports], indent=2))
    return 0 if all(r.check == "ok" for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
