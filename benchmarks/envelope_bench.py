"""Cost of the chunk envelope (issue 21): seal and verify per chunk for each candidate digest, against the time of
a real Mooncake get of the same chunk on this machine (local mooncake_master on 127.0.0.1, zero-copy into a
registered arena, as `lmcache-npu store-bench` runs it).

    python benchmarks/envelope_bench.py                      # llama3-8b, deepseek-v3, deepseek-v4-flash, gpt-oss-120b
    python benchmarks/envelope_bench.py --repeats 20 --json out.json

The target is verify <= 5% of the get. Rows: one per preset and digest (xxh3-128 without a secret, the
cryptographic ones with a secret, i.e. HMAC-SHA256 on top); times are medians over `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from rich.console import Console
from rich.table import Table

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.envelope import Sealer, seal, verify
from lmcache_npu.store.keys import ChunkKey

PRESETS = ("llama3-8b", "deepseek-v3", "deepseek-v4-flash", "gpt-oss-120b")
DIGESTS = (("xxh3-128", False), ("blake3", True), ("blake2b", True), ("sha256", True))
SECRET = b"envelope-bench-secret-0123456789"
KEY = ChunkKey("ab" * 16, bytes(range(32)))


def object_bytes_of(preset: str) -> int:
    from lmcache_npu.layout.presets import preset_layout

    layout, _ = preset_layout(preset, "ascend", None)
    return int(layout.plan.object_bytes)


def median_s(work: Callable[[], Any], repeats: int) -> float:
    work()  # warm: page faults and first-call costs out of the numbers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mooncake_get_s(object_bytes: int, repeats: int) -> Optional[float]:
    """Median seconds of one zero-copy get of a sealed chunk of `object_bytes` from a local master (None when no
    Mooncake client or master is available here)."""
    try:
        from lmcache_npu.store.mooncake import MooncakeTier
        from lmcache_npu.store.mooncake_local import LocalMooncakeMaster
    except ImportError:
        return None
    try:
        with LocalMooncakeMaster() as master:
            arena = HostArena(2, object_bytes, pinned=False)
            tier = MooncakeTier(master.config(global_segment_bytes=4 * arena.slot_bytes + (64 << 20)))
            if not tier.register(arena.base_address, arena.total_bytes):
                return None
            arena.slot_array(0)[:] = np.random.default_rng(0).integers(0, 256, object_bytes, dtype=np.uint8)
            seal(arena.sealed_view(0), KEY, 0, Sealer())
            name = KEY.storage_name(0)
            assert tier.put([name], [arena.sealed_view(0)])[0].ok
            target = [arena.sealed_view(1)]
            seconds = median_s(lambda: tier.get_into([name], target), repeats)
            assert bytes(arena.sealed_view(1)) == bytes(arena.sealed_view(0))
            tier.close()
            return seconds
    except (FileNotFoundError, RuntimeError) as exc:
        logging.getLogger(__name__).warning("no Mooncake get timing: %s", exc)
        return None


def bench(presets: tuple[str, ...], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for preset in presets:
        size = object_bytes_of(preset)
        get_s = mooncake_get_s(size, repeats)
        chunk = np.random.default_rng(1).integers(0, 256, size + 256, dtype=np.uint8)
        for digest, keyed in DIGESTS:
            sealer = Sealer(SECRET if keyed else None, digest=digest)
            seal_s = median_s(lambda: seal(chunk, KEY, 0, sealer), repeats)
            assert verify(chunk, KEY, 0, sealer) is None
            verify_s = median_s(lambda: verify(chunk, KEY, 0, sealer), repeats)
            rows.append({"preset": preset, "object_bytes": size, "digest": digest, "mac": keyed,
                         "seal_us": round(seal_s * 1e6, 1), "verify_us": round(verify_s * 1e6, 1),
                         "seal_verify_gbps": round(2 * size / (seal_s + verify_s) / 1e9, 2),
                         "verify_us_per_gib": round(verify_s * 1e6 * 2**30 / size, 1),
                         "mooncake_get_us": None if get_s is None else round(get_s * 1e6, 1),
                         "verify_pct_of_get": None if get_s is None else round(100 * verify_s / get_s, 1)})
    return rows


def render(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="chunk envelope: seal and verify vs a Mooncake get of the same chunk (medians)")
    for column in ("preset", "object MiB", "digest", "MAC", "seal µs", "verify µs", "seal+verify GB/s",
                   "verify µs/GiB", "get µs", "verify % of get"):
        table.add_column(column, justify="left" if column in ("preset", "digest", "MAC") else "right")
    for r in rows:
        table.add_row(r["preset"], f"{r['object_bytes'] / 2**20:.2f}", r["digest"], "yes" if r["mac"] else "no",
                      f"{r['seal_us']:.0f}", f"{r['verify_us']:.0f}", f"{r['seal_verify_gbps']:.2f}",
                      f"{r['verify_us_per_gib']:.0f}", "-" if r["mooncake_get_us"] is None else
                      f"{r['mooncake_get_us']:.0f}", "-" if r["verify_pct_of_get"] is None else
                      f"{r['verify_pct_of_get']:.1f}")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per number (median)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = bench(tuple(p.strip() for p in args.presets.split(",") if p.strip()), args.repeats)
    Console(width=200).print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
