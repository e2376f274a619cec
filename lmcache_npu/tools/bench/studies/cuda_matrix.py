"""The CUDA benchmark matrix of docs/performance.md in one run: presets x chunks x path, a chunk sweep
for the plot, and the overlap benchmark. Writes one JSON file."""

from __future__ import annotations

import argparse
import importlib.util
import dataclasses
import json
import platform
import subprocess
from pathlib import Path
from typing import Union

import torch
from rich.console import Console

from lmcache_npu.tools.bench.cuda_baselines import overlap
from lmcache_npu.tools.bench.geometry import Geometry, load_geometry
from lmcache_npu.tools.bench.runner import materialize_source, render, run_bench
from lmcache_npu.ops import ChunkBatch, Direction, get_backend

PRESETS = ["llama3-8b", "deepseek-v3", "deepseek-v4-flash", "gpt-oss-120b"]
GEOMETRIES = Path(__file__).resolve().parents[1] / "geometries"


def source_of(preset: str, device_family: str) -> Union[Geometry, str, None]:
    """The preset by name where vLLM builds it; else its exported geometry (a GPU machine may have no vLLM), or None
    when none was exported for this family."""
    if importlib.util.find_spec("vllm") is not None:  # presets are built from vLLM's spec classes
        return preset
    path = GEOMETRIES / ("cuda" if device_family == "cuda" else "") / f"{preset}.json"
    return load_geometry(path) if path.exists() else None


def environment() -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "nvidia_smi": smi, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep-preset", default="llama3-8b")
    parser.add_argument("--overlap-preset", default="llama3-8b")
    parser.add_argument("--device-family", default="ascend", choices=["ascend", "cuda"],
                        help="preset tensor shapes (docs/performance.md was measured with the ascend shapes)")
    args = parser.parse_args()
    console = Console()
    out: dict = {"environment": environment(), "matrix": [], "sweep": [], "overlap": []}
    console.print(out["environment"])
    variants = {"mapped": dict(path="mapped"), "staging": dict(path="staging", pipeline=False),
                "staging+pipeline": dict(path="staging", pipeline=True)}
    for preset in PRESETS:
        source = source_of(preset, args.device_family)
        if source is None:
            console.print(f"{preset}: no vLLM to build it and no exported {args.device_family} geometry; skipped")
            continue
        for chunks in (1, 8):
            for name, options in variants.items():
                report = run_bench(source, "cuda", chunks=chunks, check=True, repeats=args.repeats,
                                   progress=False, device_family=args.device_family, **options)
                console.print(render(report))
                out["matrix"].append({**report.to_json(), "variant": name})
    for chunks in (1, 2, 4, 8, 16, 32):
        for name, options in variants.items():
            report = run_bench(source_of(args.sweep_preset, args.device_family) or args.sweep_preset, "cuda", chunks=chunks, repeats=args.repeats,
                               progress=False, device_family=args.device_family, **options)
            out["sweep"].append({**report.to_json(), "variant": name})
    backend = get_backend("cuda")
    m, _ = materialize_source(source_of(args.overlap_preset, args.device_family) or args.overlap_preset, 8, torch.device("cuda"), device_family=args.device_family)
    objects = torch.zeros((8, m.plan.object_bytes), dtype=torch.uint8, pin_memory=True)
    for direction in (Direction.STORE, Direction.LOAD):
        batch = ChunkBatch.build(m.plan, m.slots, objects, direction)
        for name, options in variants.items():
            for priority in (0, -1):
                backend.tuning = dataclasses.replace(backend.tuning, blocks=None, pipeline=options.get("pipeline"))
                r = overlap(batch, backend, options["path"], priority=priority)
                row = {"preset": args.overlap_preset, "direction": direction.name.lower(),
                       **r.__dict__, "variant": name, "slowdown_percent": r.slowdown_percent}
                console.print(row)
                out["overlap"].append(row)
    args.json.write_text(json.dumps(out, indent=2))
    failed = [f"{m['preset']} x{m['chunks']} {m['variant']}: {m['check']}" for m in out["matrix"] if m["check"] != "ok"]
    for line in failed:
        console.print(f"[red]byte check failed: {line}[/red]")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
