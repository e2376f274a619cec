"""CUDA kernel store/load GB/s into store-arena slots (cudaHostRegister) vs torch pinned objects, same plan.

Run on a CUDA machine with lmcache_npu._cuda built, from the repository root (it reads tests/ops/oracle.py):
`PYTHONPATH=. python3 -m lmcache_npu.tools.bench.studies.arena_cuda [--json F]`."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lmcache_npu.ops import GroupSpec, get_backend
from lmcache_npu.store.arena import HostArena
from tests.ops.oracle import Geometry, allocate


def measure(backend, plan, slots, objects, repeats: int = 10) -> tuple[float, float]:
    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    nbytes = len(objects) * plan.object_bytes
    store = timed(lambda: backend.store(plan, slots, objects))
    load = timed(lambda: backend.load(plan, slots, objects))
    return nbytes / store / 1e9, nbytes / load / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chunks, layers = 16, 32
    g = torch.Generator().manual_seed(0)
    # llama3-8b-like: 32 layers x (K, V), 256-token chunks, 1 KiB rows (8 KV heads x 128 x bf16), 16-row blocks
    planes = [allocate(chunks * 16 + 8, 16, 1024, 0, 0, g) for _ in range(2 * layers)]
    for rp in planes:
        rp.raw = rp.raw.cuda()
    plan = Geometry([GroupSpec(16)], planes, 256).plan()
    slots = [np.arange(chunks * 256).reshape(chunks, 256)]
    arena = HostArena(chunks, plan.object_bytes)
    pinned = torch.zeros((chunks, plan.object_bytes), dtype=torch.uint8, pin_memory=True)
    rows = []
    for path in ("mapped", "staging"):
        backend = get_backend("cuda", path=path)
        for name, objects in (("arena (cudaHostRegister)", [arena.slot(i) for i in range(chunks)]),
                              ("torch pinned", [pinned[i] for i in range(chunks)])):
            store, load = measure(backend, plan, slots, objects)
            rows.append({"path": path, "objects": name, "store_gbps": round(store, 2), "load_gbps": round(load, 2),
                         "chunk_bytes": plan.object_bytes, "chunks": chunks})
    for row in rows:
        print(f"{row['path']:8s} {row['objects']:26s} store {row['store_gbps']:6.2f} GB/s  "
              f"load {row['load_gbps']:6.2f} GB/s  ({chunks} x {plan.object_bytes / 2**20:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
