"""Per-step host time of the page fence with a store held on the copy stream (issue 23, item 5).

Each step: the model writes a chunk's pages, a store of them is queued and its kernel is held on the store lane's
stream for `--hold-ms` (a device spin; on the host, a sleep), then the next step starts and is timed on the host:
the fence (`KVMover.release_pages`, what `handle_preemptions` runs), a load queued as `start_load_kv` queues it, and
the compute stream's synchronize that vllm-ascend does before every ACL graph replay and piecewise forward. Cases:
the step writes none of the store's pages (the narrow fence adds no wait), the step writes one (the fence waits),
and the fence as it was before (every queued store, every step). Prints the median and worst host time per case.

    PYTHONPATH=. python3 -m lmcache_npu.tools.bench.studies.fence_host_time \
        [--device cuda|cpu] [--hold-ms 20] [--repeats 15] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from rich.console import Console
from rich.table import Table

from lmcache_npu.layout.discovery import LayoutPolicy, discover_layout
from lmcache_npu.ops import ChunkBatch, Direction, TransferStats, get_backend
from lmcache_npu.ops.transfer_backend import AfterKernel
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.transfer import BlockWindow, DeviceMove, KVMover, StreamKit

BLOCK, BLOCKS, CHUNK, LAYERS = 16, 64, 256, 8
CASES = (("writes other pages", "none"), ("writes the store's pages", "named"), ("every store (before)", "all"))


class FullAttentionSpec:  # read by class name and attributes, as layout discovery reads vLLM's specs
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size, self.dtype = BLOCK, 8, 128, torch.bfloat16
        self.sliding_window = None


class HeldStore:
    """The store lane's backend, its kernel held behind `hold` on the lane's stream."""

    def __init__(self, inner: Any, hold: Callable[[], None]) -> None:
        self.inner, self.hold, self.name = inner, hold, inner.name

    def prepare(self, plan: Any) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: ChunkBatch, after_kernel: Optional[AfterKernel] = None) -> TransferStats:
        if batch.direction == Direction.STORE:
            self.hold()
        return self.inner.transfer(batch, after_kernel)


def spin_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per millisecond, measured with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(1000)  # the spin kernel's first launch loads it
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


class Bench:
    def __init__(self, device: torch.device, hold_ms: float) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        group = SimpleNamespace(layer_names=names, kv_cache_spec=FullAttentionSpec())
        config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])
        self.caches = {n: torch.zeros((BLOCKS, 2, BLOCK, 8, 128), dtype=torch.bfloat16, device=device) for n in names}
        self.layout = discover_layout(config, self.caches, LayoutPolicy(chunk_tokens=CHUNK))
        backend = "cuda" if self.cuda else "emu"
        self.mover = KVMover(self.layout, lambda: get_backend(backend), lambda: StreamKit.for_device(device), 0, 0,
                             TierCounters())
        self.arena = HostArena(2, self.layout.plan.object_bytes)
        cycles = spin_cycles_per_ms(device) * hold_ms if self.cuda else 0.0
        hold = (lambda: torch.cuda._sleep(int(cycles))) if self.cuda else (lambda: time.sleep(hold_ms / 1e3))
        self.mover.set_backend(Direction.STORE, HeldStore(self.mover.backends[Direction.STORE], hold))
        per_chunk = CHUNK // BLOCK
        self.store_window = BlockWindow((0,), (tuple(range(1, 1 + per_chunk)),))
        self.load_window = BlockWindow((0,), (tuple(range(1 + per_chunk, 1 + 2 * per_chunk)),))
        self.store_index = torch.tensor(self.store_window.block_ids[0], device=device)
        self._ids = iter(range(1, 1 << 30))

    def _queue(self, direction: Direction, window: BlockWindow, slot: int) -> tuple[int, threading.Event]:
        cmd_id = next(self._ids)
        done = threading.Event()
        key = ChunkKey("0" * 32, cmd_id.to_bytes(8, "little"))
        if direction == Direction.STORE:
            move = DeviceMove(Store(cmd_id, key, slot, "r", 0), window)
        else:
            move = DeviceMove(Load(cmd_id, key, slot, "r", 0), window, 0, CHUNK)
        self.mover.run([move], [self.arena.slot(slot)], lambda c, r: done.set())
        return cmd_id, done

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def step(self, case: str) -> tuple[float, int]:
        """One held store, then the next step's host time (ms) and the waits its fence added."""
        for cache in self.caches.values():
            cache.index_fill_(0, self.store_index, 5)  # this step's forward computed the chunk
        store, stored = self._queue(Direction.STORE, self.store_window, 0)
        time.sleep(0.002)  # the lane launches the held kernel, as it would during the rest of the step
        began = time.perf_counter()
        named = {"none": [store + 1_000_000], "named": [store], "all": None}[case]
        waits = self.mover.release_pages(named)  # handle_preemptions
        _, loaded = self._queue(Direction.LOAD, self.load_window, 1)  # start_load_kv
        self._synchronize()  # vllm-ascend, before the graph replay
        host_ms = (time.perf_counter() - began) * 1e3
        assert stored.wait(60) and loaded.wait(60), "a transfer never reported"
        self._synchronize()
        return host_ms, waits

    def close(self) -> None:
        self.mover.close()
        self.arena.close()


def run(device: torch.device, hold_ms: float, repeats: int) -> list[dict[str, Any]]:
    bench = Bench(device, hold_ms)
    try:
        bench.step("all")  # first transfers allocate staging memory
        rows = []
        for label, case in CASES:
            times, waits = [], []
            for _ in range(repeats):
                ms, added = bench.step(case)
                times.append(ms)
                waits.append(added)
            rows.append({"case": label, "fence": case, "hold_ms": hold_ms, "median_ms": statistics.median(times),
                         "max_ms": max(times), "waits_per_step": statistics.mean(waits)})
        return rows
    finally:
        bench.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--hold-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.hold_ms <= 0 or args.repeats < 1:
        parser.error("--hold-ms must be > 0 and --repeats >= 1")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rows = run(device, args.hold_ms, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host"
    table = Table(title=f"host time of one step's fence + load queue + pre-replay sync, store held {args.hold_ms} ms "
                        f"({name})")
    for column in ("the step", "median ms", "max ms", "waits per step"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["case"], f"{row['median_ms']:.3f}", f"{row['max_ms']:.3f}", f"{row['waits_per_step']:.2f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
