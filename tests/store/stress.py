"""Store stress run: ≥ 10,000 distinct chunks through one index and two ranks, every tier in play.

Requests replay random prefixes of random "documents" (chunk sequences sharing prefixes, like multi-turn chats):
each looks up its chunks, waits for promotions, loads the ready prefix and stores the rest. The arena is small, so
chunks are evicted and spilled to disk; the disk is smaller than the working set, so the oldest files are dropped;
every stored chunk is also put to the remote store, so dropped chunks come back from there. Every load compares
each rank's bytes with that chunk's checksum recorded at store time (and its full pattern).

Run in-process with an in-memory remote (`--remote memory`) or, inside a loopback-only network namespace, against
a real mooncake_master (`--remote mooncake`); prints one JSON line of totals and exits 1 on any wrong byte.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from typing import Sequence, Union

import torch
import xxhash

from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.disk import DiskTier
from lmcache_npu.store.routes.context import Report
from lmcache_npu.store.tier import OK, Failure, TierResult

from .fakes import Cluster, chunk_payload, make_key


class ChecksumDevice:
    """Stores write the chunk's pattern and record its checksum; loads verify the checksum, then the bytes."""

    def __init__(self, rank: int, checksums: dict) -> None:
        self.rank = rank
        self.checksums = checksums
        self.loaded: list = []
        self.mismatches: list = []

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        for command, obj in zip(commands, objects):
            if isinstance(command, Store):
                obj.copy_(torch.from_numpy(chunk_payload(command.key, self.rank, obj.numel())))
                self.checksums[(command.key, self.rank)] = xxhash.xxh3_64_intdigest(obj.numpy())
                report(command.cmd_id, OK)
                continue
            expected = self.checksums.get((command.key, self.rank))
            good = expected == xxhash.xxh3_64_intdigest(obj.numpy()) and torch.equal(
                obj, torch.from_numpy(chunk_payload(command.key, self.rank, obj.numel())))
            (self.loaded if good else self.mismatches).append(command.key)
            report(command.cmd_id, OK if good else TierResult.fail(Failure.DEVICE, "checksum mismatch"))


def run(chunks: int, remote_kind: str, seed: int = 0, object_bytes: int = 4096) -> dict:
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="lmcache-npu-stress-")
    fingerprint = b"S" * 16
    disks = [DiskTier(root, fingerprint) for _ in range(2)]
    if remote_kind == "mooncake":
        from lmcache_npu.store.mooncake import MooncakeTier
        from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

        master = LocalMooncakeMaster()
        master.__enter__()
        segment = 2 * chunks * object_bytes + (64 << 20)
        remotes = [MooncakeTier(master.config(global_segment_bytes=segment)) for _ in range(3)]
    else:
        from .fakes import MemoryRemote

        shared: dict = {}
        remotes = [MemoryRemote(shared) for _ in range(3)]
    cluster = Cluster(num_slots=256, object_bytes=object_bytes, disks=disks, disk_chunks=2000, remote=remotes[0])
    for rank, executor in enumerate(cluster.executors):  # each rank talks to the store through its own client
        executor.remote = remotes[1 + rank]
        executor.remote.register(executor.arena.base_address, executor.arena.total_bytes)
    checksums: dict = {}
    cluster.devices = [ChecksumDevice(rank, checksums) for rank in range(2)]
    for executor, device in zip(cluster.executors, cluster.devices):
        executor.mover = device
    # documents share prefixes: each extends a random earlier one, so lookups hit partially
    documents: list[list] = [[make_key(0)]]
    next_key = 1
    requests = 0
    start = time.perf_counter()
    while next_key < chunks:
        base = rng.choice(documents)
        grow = rng.randint(1, 24)
        doc = base[:rng.randint(1, len(base))] + [make_key(i) for i in range(next_key, next_key + grow)]
        next_key += grow
        documents.append(doc)
        for replay in (doc, rng.choice(documents)):  # a new turn, and a revisit of some older conversation
            request = f"q{requests}"
            requests += 1
            for _ in range(6):
                result = cluster.index.lookup(request, replay)
                if not result.pending:
                    break
                cluster.settle()
            cluster.index.prepare_load(request, list(enumerate(replay[:result.ready_chunks])))
            cluster.index.release(request)
            cluster.index.prepare_store(request, list(enumerate(replay[result.ready_chunks:], result.ready_chunks)))
            cluster.settle()
    counters = cluster.index.counters.snapshot()
    totals = {
        "chunks": next_key,
        "requests": requests,
        "seconds": round(time.perf_counter() - start, 1),
        "loads_verified": sum(len(d.loaded) for d in cluster.devices),
        "mismatches": sum(len(d.mismatches) for d in cluster.devices),
        "stored": len(cluster.stored),
        **{k: counters.get(k, 0) for k in ("promotions_disk", "promotions_remote", "spills", "disk_evictions",
                                             "evictions", "promote_failed", "put_failed", "spill_failed")},
        "remote": remote_kind,
    }
    cluster.close()
    for disk in disks:
        disk.close()
    for remote in remotes:
        if hasattr(remote, "close"):
            remote.close()
    if remote_kind == "mooncake":
        master.__exit__(None, None, None)
    shutil.rmtree(root, ignore_errors=True)
    return totals


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--remote", choices=["memory", "mooncake"], default="memory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    totals = run(args.chunks, args.remote, args.seed)
    print(json.dumps(totals))
    return 1 if totals["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
