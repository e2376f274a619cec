"""Times `fingerprint_weights` on synthetic multi-shard safetensors checkpoints, cold and warm.

Checkpoints are sparse by default: each shard gets a real safetensors header, then is truncated to its full size,
so a 700 GB checkpoint costs no disk space. Reads of a hole never touch the device (the kernel hands back zero
pages), so a sparse run measures the fingerprint's own work (listing, header parsing, planning, ~100k preads and
their hashing, thread-pool overhead) and its byte counts, not device latency. `--dense` writes real bytes instead,
for checkpoints that fit the disk: then a cold run (page cache dropped with POSIX_FADV_DONTNEED) measures device
reads too, and /proc/self/io read_bytes shows what reached the device.

    python -m lmcache_npu.tools.bench.studies.fingerprint_bench  # 20 GB / 8 shards and a DeepSeek-V3-like one
    python -m lmcache_npu.tools.bench.studies.fingerprint_bench --preset custom --size-gb 24 --shards 163 \
        --tensors 91000 --dense
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from lmcache_npu.identity.weights import DEFAULT_MAX_READ_BYTES, DEFAULT_THREADS, fingerprint_weights


@dataclass(frozen=True)
class Shape:
    """A synthetic checkpoint: total bytes over `shards` shards holding `tensors` tensors in (weight, scale)
    pairs; `small_bytes` is each scale's size (3,584 B: a DeepSeek-V3 fp8 block scale, 16 x 56 float32)."""

    name: str
    total_bytes: int
    shards: int
    tensors: int
    small_bytes: int = 3584


PRESETS = {
    "20g": Shape("20 GB / 8 shards", 20 * 10 ** 9, 8, 8 * 146, small_bytes=8192),
    "dsv3": Shape("700 GB / 163 shards (DSv3-like)", 700 * 10 ** 9, 163, 91_000),
}


def _header(entries: list[tuple[str, str, list[int], int, int]]) -> bytes:
    body: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, dtype, shape, begin, end in entries:
        body[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text


def build(shape: Shape, root: Path, dense: bool) -> None:
    """Writes the checkpoint: per shard, (weight, scale) pairs whose weights share what the scales leave."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "synthetic", "shards": shape.shards}))
    block = os.urandom(16 << 20) if dense else b""
    per_shard = shape.tensors // shape.shards
    for s in range(shape.shards):
        count = per_shard + (1 if s < shape.tensors % shape.shards else 0)
        pairs = max(1, count // 2)
        data_bytes = shape.total_bytes // shape.shards
        weight_bytes = max(1, (data_bytes - pairs * shape.small_bytes) // pairs)
        entries, offset = [], 0
        for p in range(pairs):
            entries.append((f"layers.{s}.experts.{p}.weight", "F8_E4M3", [weight_bytes], offset, offset + weight_bytes))
            offset += weight_bytes
            if len(entries) < count:
                n = shape.small_bytes // 4
                entries.append((f"layers.{s}.experts.{p}.weight_scale_inv", "F32", [n], offset, offset + 4 * n))
                offset += 4 * n
        header = _header(entries)
        path = root / f"model-{s + 1:05d}-of-{shape.shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(header)
            if dense:
                left = offset
                while left:
                    left -= f.write(block[:min(left, len(block))])
            else:
                f.truncate(len(header) + offset)  # a hole: no blocks allocated


def drop_cache(root: Path) -> None:
    """Evicts the checkpoint's pages so the next run is cold (no root needed: it is advice on our own files)."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped, so write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_io() -> dict[str, int]:
    """rchar and read_bytes of this process (empty where /proc/self/io is missing or unreadable)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def measure(root: Path, cold: bool, repeats: int, max_read_bytes: int, threads: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        if cold:
            drop_cache(root)
        before = proc_io()
        start = time.perf_counter()
        fp = fingerprint_weights(root, max_read_bytes=max_read_bytes, threads=threads)
        wall = time.perf_counter() - start
        after = proc_io()
        runs.append({"seconds": wall, "fingerprint": fp.describe(),
                     "rchar": after.get("rchar", 0) - before.get("rchar", 0) if before else None,
                     "read_bytes": after.get("read_bytes", 0) - before.get("read_bytes", 0) if before else None})
    digests = {r["fingerprint"]["digest"] for r in runs}
    if len(digests) != 1:
        raise RuntimeError(f"fingerprint changed between runs of the same checkpoint: {sorted(digests)}")
    first = runs[0]["fingerprint"]
    return {"cold": cold, "repeats": repeats, "median_s": statistics.median(r["seconds"] for r in runs),
            "max_s": max(r["seconds"] for r in runs), "bytes_read": first["bytes_read"], "samples": first["samples"],
            "tensors": first["tensors"], "tensor_sample_bytes": first["tensor_sample_bytes"],
            "spread_samples": first["spread_samples"], "weight_bytes": first["weight_bytes"],
            "rchar": runs[-1]["rchar"], "device_read_bytes": runs[-1]["read_bytes"], "digest": first["digest"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=[*PRESETS, "custom"],
                        help="checkpoints to build (repeatable; default: 20g and dsv3)")
    parser.add_argument("--size-gb", type=float, default=20.0, help="custom: total size in GB (1e9 bytes)")
    parser.add_argument("--shards", type=int, default=8, help="custom: shard count")
    parser.add_argument("--tensors", type=int, default=1000, help="custom: tensor count")
    parser.add_argument("--dense", action="store_true", help="write real bytes instead of sparse files")
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="leave the built checkpoints in place")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-read-mib", type=int, default=DEFAULT_MAX_READ_BYTES >> 20)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = []
    for name in args.preset or ["20g", "dsv3"]:
        shapes.append(Shape(f"{args.size_gb:g} GB / {args.shards} shards", int(args.size_gb
                            * 10 ** 9), args.shards, args.tensors) if name == "custom" else PRESETS[name])
    base: Optional[Path] = args.dir
    owned = base is None
    base = Path(tempfile.mkdtemp(prefix="fingerprint-bench-")) if base is None else base
    console = Console(width=max(Console().width, 160))  # the table is wide; never fold it to an 80-column pipe
    rows = []
    try:
        for i, shape in enumerate(shapes):
            root = base / f"ckpt{i}"
            start = time.perf_counter()
            build(shape, root, args.dense)
            console.log(f"built {shape.name} ({'dense' if args.dense else 'sparse'}) in "
                        f"{time.perf_counter() - start:.1f} s at {root}")
            for cold in (True, False):
                result = measure(root, cold, args.repeats, args.max_read_mib << 20, args.threads)
                rows.append({"checkpoint": shape.name, "dense": args.dense, "threads": args.threads,
                             "max_read_bytes": args.max_read_mib << 20, **result})
            if not args.keep:
                shutil.rmtree(root)
    finally:
        if owned and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    table = Table(title=f"fingerprint_weights, budget {args.max_read_mib} MiB, {args.threads} threads, "
                        f"{'dense' if args.dense else 'sparse (no device reads)'} files")
    for col in ("checkpoint", "cache", "median s", "max s", "tensors", "sample B", "spread", "reads",
                "bytes read", "rchar", "device read_bytes"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["checkpoint"], "cold" if r["cold"] else "warm", f"{r['median_s']:.3f}", f"{r['max_s']:.3f}",
                      f"{r['tensors']:,}", str(r["tensor_sample_bytes"]), f"{r['spread_samples']:,}",
                      f"{r['samples']:,}", f"{r['bytes_read'] / 2 ** 20:,.1f} MiB",
                      "-" if r["rchar"] is None else f"{r['rchar'] / 2 ** 20:,.1f} MiB",
                      "-" if r["device_read_bytes"] is None else f"{r['device_read_bytes'] / 2 ** 20:,.1f} MiB")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
