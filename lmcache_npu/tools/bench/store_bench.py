"""`lmcache-npu store-bench`: put/get throughput of each store tier through the worker executor.

Every tier is measured the way the connector drives it: commands submitted to a `StoreExecutor` over a real
arena, timed until every completion is in. cpu: Store/Load between host "device" buffers and arena slots (the
index's bookkeeping included); disk: Spill (write-behind, fsync, rename) and Promote from disk (read + checksum;
the page cache is dropped first so reads come from the device); mooncake: Put and Promote from the remote store
(through the bounce buffer, as served by default: row "mooncake"; zero-copy from the registered arena with
`--mooncake-zero-copy on`: row "mooncake-zero-copy").
Every chunk travels sealed (object + envelope) and every promotion verifies its envelope, as in serving; every chunk
read back is compared with what was written.

With its own local master (no `--mooncake-master`), the CLI runs the whole bench in a new network namespace with only
`lo` up (`run_in_private_network`): the transfer engine's client ports listen on every interface whatever
`local_hostname` or MC_TCP_BIND_ADDRESS say, and with zero-copy they reach the registered arena, so they must be
reachable from nowhere. Where `unshare -n` is refused it says so and runs on the host's network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import xxhash

from ...store.arena import HostArena
from ...store.commands import Command, Completion, Promote, Put, Spill, Store, Tier
from ...store.executor import StoreExecutor
from ...store.routes.build import make_executor
from ...store.routes.context import Report
from ...store.index.chunk_index import ChunkIndex
from ...store.keys import ChunkKey
from ...store.tier import OK

logger = logging.getLogger(__name__)

TIERS = ("cpu", "disk", "mooncake")
BATCH_CHUNKS = 32  # commands per submit: about one prefill step's worth of chunks


@dataclass
class TierBench:
    tier: str
    chunks: int
    chunk_bytes: int
    put_s: float
    get_s: float
    failed: int  # commands that did not complete ok
    check: str  # "ok" or what differed
    notes: str = ""

    def _gbps(self, seconds: float) -> float:
        return self.chunks * self.chunk_bytes / seconds / 1e9 if seconds > 0 else 0.0

    @property
    def put_gbps(self) -> float:
        return self._gbps(self.put_s)

    @property
    def get_gbps(self) -> float:
        return self._gbps(self.get_s)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(put_gbps=round(self.put_gbps, 3), get_gbps=round(self.get_gbps, 3),
                    put_ops=round(self.chunks / self.put_s, 1) if self.put_s else 0.0,
                    get_ops=round(self.chunks / self.get_s, 1) if self.get_s else 0.0)
        return data


class HostCopyMover:
    """Stands in for the device: chunk i of a request lives in `sources[i]`; loads land in `sinks[i]`."""

    def __init__(self, sources: Sequence[torch.Tensor], sinks: Sequence[torch.Tensor]) -> None:
        self.sources = sources
        self.sinks = sinks

    def run(self, commands: Sequence[Any], objects: Sequence[torch.Tensor], report: Report) -> None:
        for command, obj in zip(commands, objects):
            if isinstance(command, Store):
                obj.copy_(self.sources[command.chunk_index])
            else:
                self.sinks[command.chunk_index].copy_(obj)
            report(command.cmd_id, OK)


class _Progress:
    """Counts chunks done per phase on a rich progress bar (or nowhere when quiet)."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True)

    @contextlib.contextmanager
    def phase(self, name: str, total: int) -> Iterator[Callable[[int], None]]:
        if self._bar is None:
            yield lambda n: None
            return
        task = self._bar.add_task(name, total=total)
        yield lambda n: self._bar.advance(task, n)
        self._bar.remove_task(task)

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _keys(count: int, salt: str) -> list[ChunkKey]:
    namespace = xxhash.xxh3_128_hexdigest(f"store-bench {salt} {time.time_ns()}".encode())
    return [ChunkKey(namespace, i.to_bytes(32, "little")) for i in range(count)]


def _run(executor: StoreExecutor, commands: Sequence[Command],
         advance: Callable[[int], None]) -> tuple[float, list[Completion]]:
    """Seconds until every command completed (submitted in batches), and the completions."""
    done: list[Completion] = []
    start = time.perf_counter()
    for first in range(0, len(commands), BATCH_CHUNKS):
        batch = commands[first:first + BATCH_CHUNKS]
        executor.submit(batch)
        done += executor.drain(600)
        advance(len(batch))
    return time.perf_counter() - start, done


def _failed(*completions: Sequence[Completion]) -> int:
    return sum(not c.ok for done in completions for c in done)


def _reasons(*completions: Sequence[Completion]) -> str:
    """The failure reasons and how often, for the notes column."""
    counts: dict[str, int] = {}
    for done in completions:
        for c in done:
            if not c.ok:
                counts[c.reason] = counts.get(c.reason, 0) + 1
    return "; ".join(f"{n}x {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3])


def _compare(expected: Sequence[int], actual: Sequence[int]) -> str:
    wrong = [i for i, (a, b) in enumerate(zip(expected, actual)) if a != b]
    return "ok" if not wrong else f"{len(wrong)} chunks differ (first: chunk {wrong[0]})"


def _fill(arena: HostArena, chunks: int, seed: int) -> list[int]:
    """Random bytes in every slot; returns each slot's checksum."""
    rng = np.random.default_rng(seed)
    sums = []
    for slot in range(chunks):
        arena.slot_array(slot)[:] = rng.integers(0, 256, arena.object_bytes, dtype=np.uint8)
        sums.append(xxhash.xxh3_64_intdigest(arena.slot_view(slot)))
    return sums


def _slot_sums(arena: HostArena, chunks: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(arena.slot_view(slot)) for slot in range(chunks)]


def _put_then_get(tier: str, executor: StoreExecutor, arena: HostArena, keys: Sequence[ChunkKey],
                  put: Callable[[int, ChunkKey], Command], get: Callable[[int, ChunkKey], Command],
                  progress: _Progress, written: Sequence[int],
                  between: Callable[[], None] = lambda: None) -> tuple[float, float, list, list, str]:
    """Puts every filled slot through the tier, scrubs the slots, gets them back and compares checksums."""
    with progress.phase(f"{tier} put", len(keys)) as advance:
        put_s, put_done = _run(executor, [put(i, k) for i, k in enumerate(keys)], advance)
    between()
    for slot in range(len(keys)):
        arena.slot(slot).zero_()
    with progress.phase(f"{tier} get", len(keys)) as advance:
        get_s, get_done = _run(executor, [get(i, k) for i, k in enumerate(keys)], advance)
    return put_s, get_s, put_done, get_done, _compare(written, _slot_sums(arena, len(keys)))


def _tier_bench(tier: str, chunks: int, chunk_bytes: int, timings: tuple[float, float, list, list, str],
                notes: str) -> TierBench:
    put_s, get_s, put_done, get_done, check = timings
    failed = _failed(put_done, get_done)
    notes += f"; failures: {_reasons(put_done, get_done)}" if failed else ""
    return TierBench(tier, chunks, chunk_bytes, put_s, get_s, failed, check, notes)


def bench_cpu(chunk_bytes: int, chunks: int, progress: _Progress, seed: int = 0) -> TierBench:
    """Store/Load through the index and the executor: host buffers ↔ arena slots."""
    rng = torch.Generator().manual_seed(seed)
    sources = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=rng) for _ in range(chunks)]
    sinks = [torch.zeros(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]  # touched: no page faults timed
    arena = HostArena(chunks, chunk_bytes)
    executor = make_executor(0, arena, HostCopyMover(sources, sinks))
    index = ChunkIndex(chunks, 1)
    keys = _keys(chunks, "cpu")
    with progress.phase("cpu put", chunks) as advance:
        index.prepare_store("bench", list(enumerate(keys)))
        put_s, put_done = _run(executor, index.take_commands(), advance)
        index.on_completions(put_done)
    with progress.phase("cpu get", chunks) as advance:
        ready = index.lookup("bench", keys).ready_chunks
        index.prepare_load("bench", list(enumerate(keys[:ready])))
        get_s, get_done = _run(executor, index.take_commands(), advance)
        index.on_completions(get_done)
    loaded_ok = ready == chunks and all(torch.equal(a, b) for a, b in zip(sources, sinks))
    check = "ok" if loaded_ok else f"{ready} of {chunks} chunks ready, or loaded bytes differ"
    executor.close()
    return _tier_bench("cpu", chunks, chunk_bytes, (put_s, get_s, put_done, get_done, check),
                       f"{'pinned' if arena.pinned else 'pageable'} arena")


def _drop_page_cache(paths: Sequence[str]) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def bench_disk(chunk_bytes: int, chunks: int, progress: _Progress, disk_path: Optional[str] = None,
               seed: int = 0) -> TierBench:
    """Spill (arena → file, write-behind, fsync, rename) and Promote (file → arena, checksum verified)."""
    from ...store.disk import HEADER_BYTES, DiskTier

    with contextlib.ExitStack() as stack:
        root = disk_path or stack.enter_context(tempfile.TemporaryDirectory(prefix="lmcache-npu-store-bench-"))
        arena = HostArena(chunks, chunk_bytes)
        written = _fill(arena, chunks, seed)
        fingerprint = b"store-bench-v1\0\0"
        # Room for every put at once (sealed object + file header), so a slow disk never refuses one as queue full.
        disk = DiskTier(root, fingerprint, max_pending_bytes=chunks * (arena.sealed_bytes + HEADER_BYTES))
        executor = make_executor(0, arena, disk=disk)
        keys = _keys(chunks, "disk")
        dropped: list[bool] = []
        timings = _put_then_get(
            "disk", executor, arena, keys, lambda i, k: Spill(i + 1, k, i),
            lambda i, k: Promote(chunks + i + 1, k, i, Tier.DISK), progress, written,
            between=lambda: dropped.append(_drop_page_cache([disk.file_path(k.storage_name(0)) for k in keys])))
        for key in keys:
            disk.delete(key.storage_name(0))
        executor.close()
    reads = "after dropping the page cache" if dropped and dropped[0] else "may be cached"
    return _tier_bench("disk", chunks, chunk_bytes, timings, f"{root if disk_path else 'temp dir'}; reads {reads}")


def bench_mooncake(chunk_bytes: int, chunks: int, progress: _Progress, mooncake: Optional[dict] = None,
                   seed: int = 0, zero_copy: bool = False) -> TierBench:
    """Put (arena → Mooncake) and Promote from remote (Mooncake → arena): zero-copy on the registered arena, or
    through the tier's bounce buffer (`zero_copy` False)."""
    import dataclasses

    from ...store.mooncake import MooncakeConfig, MooncakeTier
    from ..mooncake_local import LocalMooncakeMaster

    with contextlib.ExitStack() as stack:
        segment = 2 * chunks * chunk_bytes + (256 << 20)  # Mooncake evicts near a full pool: leave headroom
        if mooncake is None:
            master = stack.enter_context(LocalMooncakeMaster())
            # zero-copy needs a trusted network: the bench's own master and client alone in a loopback-only namespace
            config = master.config(global_segment_bytes=segment, trusted_network=loopback_only_network())
            where = f"local mooncake_master {config.master}"
        else:
            config = MooncakeConfig.from_dict(mooncake)
            where = f"mooncake_master {config.master}"
        if zero_copy and not config.trusted_network:
            raise ValueError(f"store-bench: zero-copy registers the arena with a transfer engine whose ports listen on "
                             f"every interface, and {where} is on a network not known to be trusted (no loopback-only "
                             "namespace here, or a cluster's master); use --mooncake-zero-copy off")
        config = dataclasses.replace(config, zero_copy=zero_copy,
                                     bounce_bytes=max(config.bounce_bytes, chunk_bytes + (64 << 10)))
        tier = MooncakeTier(config)
        arena = HostArena(chunks, chunk_bytes)
        written = _fill(arena, chunks, seed)
        executor = make_executor(0, arena, remote=tier)
        keys = _keys(chunks, "mooncake")
        timings = _put_then_get("mooncake", executor, arena, keys, lambda i, k: Put(i + 1, k, i),
                                lambda i, k: Promote(chunks + i + 1, k, i, Tier.REMOTE), progress, written)
        path = ("zero-copy" if tier.counters["zero_copy_ops"] else
                f"bounce {config.bounce_bytes / 2**20:.0f} MiB" if tier.counters["bounce_ops"] else "copy")
        tier.delete([k.storage_name(0) for k in keys])
        executor.close()
    network = "loopback-only network" if loopback_only_network() else "host network"
    return _tier_bench("mooncake-zero-copy" if zero_copy else "mooncake", chunks, chunk_bytes, timings,
                       f"{where}, {config.protocol}, {path}, {network}")


def loopback_only_network() -> bool:
    """Whether this process's network namespace has no interface but `lo`, so none of its ports is reachable from
    another host (read from /proc/self/net/dev, which lists this namespace's interfaces)."""
    try:
        with open("/proc/self/net/dev") as table:
            lines = table.read().splitlines()[2:]  # two header lines
    except OSError:
        return False
    return {line.split(":", 1)[0].strip() for line in lines if ":" in line} <= {"lo"}


def run_in_private_network(argv: Sequence[str], what: str = "store-bench") -> Optional[int]:
    """Runs `argv` in a new network namespace with only `lo` up and MC_TCP_BIND_ADDRESS=127.0.0.1, its output not
    captured, and returns its exit status; None, with a note on stderr, where no namespace can be made here."""
    from ..mooncake_local import LOOPBACK, netns_available

    ok, why = netns_available()
    if not ok:
        print(f"{what}: no network namespace here ({why}): running on the host's network, where the Mooncake "
              "client's transfer-engine ports (15000-17000) listen on all interfaces while it runs; firewall them "
              "or run it where `unshare -n` is allowed (docs/deployment.md §6)", file=sys.stderr)
        return None
    ip = shutil.which("ip") or "/usr/sbin/ip"
    print(f"{what}: in a loopback-only network namespace (unshare -n): its Mooncake ports are reachable from "
          "nowhere else", file=sys.stderr)
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
    return subprocess.run(["unshare", "-n", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh", *argv],
                          env=env, check=False).returncode


def run_store_bench(tiers: Sequence[str], chunk_bytes: int, chunks: int, disk_path: Optional[str] = None,
                    mooncake: Optional[dict] = None, progress: bool = False, seed: int = 0,
                    mooncake_zero_copy: Sequence[bool] = (True,)) -> list[TierBench]:
    """One row per tier; the mooncake tier gets one row per `mooncake_zero_copy` setting."""
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        raise ValueError(f"unknown tier(s) {', '.join(unknown)}; choose from {', '.join(TIERS)}")
    if chunk_bytes < 1 or chunks < 1:
        raise ValueError(f"--chunk-bytes and --chunks must be >= 1 (got {chunk_bytes}, {chunks})")
    results = []
    with _Progress(progress) as bar:
        for tier in tiers:
            if tier == "cpu":
                results.append(bench_cpu(chunk_bytes, chunks, bar, seed))
            elif tier == "disk":
                results.append(bench_disk(chunk_bytes, chunks, bar, disk_path, seed))
            else:
                results.extend(bench_mooncake(chunk_bytes, chunks, bar, mooncake, seed, zero_copy)
                               for zero_copy in mooncake_zero_copy)
    return results


def render_store_bench(results: Sequence[TierBench]) -> Any:
    from rich.table import Table

    first = results[0]
    table = Table(title=f"store-bench: {first.chunks} chunks x {first.chunk_bytes / 2**20:.2f} MiB per tier")
    for column in ("tier", "put GB/s", "put ops/s", "get GB/s", "get ops/s", "failed", "check", "notes"):
        table.add_column(column, justify="right" if "/s" in column or column == "failed" else "left")
    for r in results:
        data = r.to_json()
        table.add_row(r.tier, f"{r.put_gbps:.2f}", f"{data['put_ops']:.0f}", f"{r.get_gbps:.2f}",
                      f"{data['get_ops']:.0f}", str(r.failed), r.check, r.notes)
    return table
