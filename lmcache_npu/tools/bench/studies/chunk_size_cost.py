"""What a smaller automatic chunk costs the scheduler half: `lmcache-npu bench-scheduler`'s lookups and metadata builds
with the automatic chunk size aimed at each target (256 tokens, the old default; 128, the new), and the index's
memory per entry (and so per cached token) measured with tracemalloc.

    PYTHONPATH=. .venv/bin/python -m lmcache_npu.tools.bench.studies.chunk_size_cost \
        [--targets 256 128] [--repeats 50] [--json out.json]

Prints one table; the scheduler bench needs vLLM's classes (the main venv's light vLLM is enough).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import tracemalloc
from dataclasses import asdict
from typing import Any, Iterator

from lmcache_npu.layout import discovery
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.keys import ChunkKey

logger = logging.getLogger(__name__)

INDEX_ENTRIES = 20_000


@contextlib.contextmanager
def automatic_target(tokens: int) -> Iterator[None]:
    """The automatic chunk size aims at `tokens` while inside (the function's default argument, restored after)."""
    function = discovery.default_chunk_tokens
    saved = function.__defaults__
    assert saved is not None
    function.__defaults__ = (*saved[:-1], tokens)
    try:
        yield
    finally:
        function.__defaults__ = saved


def index_bytes_per_entry(entries: int = INDEX_ENTRIES) -> float:
    """Bytes one stored chunk's index entry takes (its key, entry, policy and slot bookkeeping)."""
    keys = [ChunkKey("0" * 32, hashlib.sha256(i.to_bytes(8, "little")).digest()) for i in range(entries)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = ChunkIndex(num_slots=entries)
    index.allocate_store("r", list(enumerate(keys)))
    index.take_commands()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / entries


def measure(targets: list[int], repeats: int) -> list[dict[str, Any]]:
    from lmcache_npu.tools.bench.scheduler_bench import run_scheduler_bench

    per_entry = index_bytes_per_entry()
    rows = []
    for target in targets:
        with automatic_target(target):
            for timing in run_scheduler_bench(repeats):
                rows.append({"target": target, **asdict(timing)})
        logger.info("target %d done", target)
    return [{**row, "index_bytes_per_entry": per_entry} for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    rows = measure(args.targets, args.repeats)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scheduler half per automatic chunk target; index entry "
                  f"{rows[0]['index_bytes_per_entry']:.0f} B (per cached token: that / chunk tokens)")
    keys = [k for k in rows[0] if k not in ("index_bytes_per_entry",)]
    for key in keys:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    Console(width=250).print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
