"""Two processes: each stores only its share of replicated planes (plus its own head-split plane) and loads the
whole chunk back through the exchange, byte for byte; a share missing or wrong on one rank is seen by both (the load
fails on both, no row is written) or by the byte comparison. Every case runs with the host exchange (gloo, host
memory) and the device exchange's code path (gloo standing in for NCCL/HCCL, the CPU for the device); with two GPUs
the device exchange also runs for real, over NCCL into GPU memory (`cuda` marker)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmcache_npu.ops import ChunkBatch, Direction, GroupSpec, Plane, TransferPlan
from lmcache_npu.ops.backend import get_backend
from lmcache_npu.ops.torch_backend import TorchBackend
from lmcache_npu.store.commands import BlockWindow, DeviceMove, Load, Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import OK, TierCounters
from lmcache_npu.transfer.share_mover import ShareExchange, SharedMover
from lmcache_npu.transfer.shares import ShareLayout

BLOCKS, ROWS_PER_BLOCK, CHUNK = 12, 16, 32  # a chunk is two blocks
SOURCE = [[0, 1], [2, 3]]  # blocks the two chunks are stored from
TARGET = [[6, 7], [8, 9]]  # blocks they are loaded into
SENTINEL = 0xA5
NO_WINDOW = BlockWindow((0,), ((),))  # WholeObjectMover places chunks by SOURCE/TARGET, not by a block window


class WholeObjectMover:
    """The rank's device side: the reference backend moving whole chunk objects between pages and objects."""

    def __init__(self, plan: TransferPlan, blocks: Sequence[Sequence[int]]) -> None:
        # the oracle on the CPU; on a GPU the CUDA backend, which reads device objects on its own path
        self.backend = get_backend("cuda") if plan.device.type == "cuda" else TorchBackend()
        self.plan, self.blocks = plan, blocks
        self.seen: list[torch.Tensor] = []  # the objects it was handed

    def run(self, commands: Sequence[Any], objects: Sequence[torch.Tensor], report: Any) -> None:
        direction = Direction.STORE if commands[0].is_store else Direction.LOAD
        self.seen.extend(objects)
        rows = np.array([[b * ROWS_PER_BLOCK + r for b in self.blocks[c.chunk_index] for r in range(ROWS_PER_BLOCK)]
                         for c in commands], dtype=np.int64)
        self.backend.transfer(ChunkBatch.build(self.plan, [rows], list(objects), direction))
        for command in commands:
            report(command.cmd_id, OK)


def _plan(rank: int, device: torch.device = torch.device("cpu"), team: int = 0) -> TransferPlan:
    """An MLA-like latent and rope plane (the same bytes on every rank of a share group, `team`) and one head-split
    plane (the rank's own)."""
    shared = torch.Generator().manual_seed(7 + team)
    own = torch.Generator().manual_seed(100 + rank)

    def pages(row_bytes: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, 256, (BLOCKS, ROWS_PER_BLOCK * row_bytes), dtype=torch.uint8, generator=gen).to(device)

    planes = [Plane(pages(96, shared), 0, ROWS_PER_BLOCK, 96, name="latent", replicated=True),
              Plane(pages(32, shared), 0, ROWS_PER_BLOCK, 32, name="rope", replicated=True),
              Plane(pages(40, own), 0, ROWS_PER_BLOCK, 40, name="heads")]
    return TransferPlan([GroupSpec(ROWS_PER_BLOCK)], planes, CHUNK)


def _rows(plan: TransferPlan, blocks: Sequence[int]) -> list[bytes]:
    return [bytes(p.pages[blocks].flatten().cpu().tolist()) for p in plan.moved_planes]


def _exchange(kind: str, rank: int, group: Any) -> ShareExchange:
    if kind == "host":
        return ShareExchange(group)
    if kind == "device-cpu":  # the device exchange's path, with gloo and host memory standing in
        return ShareExchange(group, group, torch.device("cpu"))
    return ShareExchange(group, group, torch.device(f"cuda:{rank}"))  # NCCL routes cuda tensors


def _worker(rank: int, size: int, init: str, out: str, fault: str, kind: str, share_ranks: int) -> None:
    device = torch.device(f"cuda:{rank}") if kind == "device-cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=size)
    try:
        # share groups of consecutive ranks (every rank makes every group, in order, as torch requires)
        groups = [dist.new_group(list(range(first, first + share_ranks))) for first in range(0, size, share_ranks)]
        team = rank // share_ranks
        plan = _plan(rank, device, team)
        layout = ShareLayout(plan.object_bytes, plan.replicated_offset, rank % share_ranks, share_ranks)
        counters = TierCounters()
        reports: dict[int, Any] = {}
        key = ChunkKey("0" * 32, b"k")
        exchange = _exchange(kind, rank, groups[team])
        mover = SharedMover(stores := WholeObjectMover(plan, SOURCE), layout, exchange, counters,
                            pin=device.type == "cuda")
        if rank == 1 and fault == "no_device_memory":
            mover._device_buffers = lambda count: None  # this rank's device is full: the group exchanges on the host
        arena = [torch.zeros(layout.object_bytes, dtype=torch.uint8) for _ in SOURCE]
        mover.run([DeviceMove(Store(i, key, i, "r", i), NO_WINDOW) for i in range(len(SOURCE))], arena,
                  lambda cmd_id, result: reports.__setitem__(cmd_id, result.ok))
        for p in plan.moved_planes:
            p.pages[sum(TARGET, [])] = SENTINEL
        if rank == 1 and fault == "missing":
            arena[0] = arena[0][:0]  # chunk 0's share is gone on rank 1 only
        if rank == 1 and fault == "wrong_byte":
            arena[0][layout.own_bytes] ^= 0xFF  # the first byte of rank 1's share of chunk 0
        mover.inner = loads = WholeObjectMover(plan, TARGET)
        mover.run([DeviceMove(Load(10 + i, key, i, "r", i), NO_WINDOW) for i in range(len(TARGET))], arena,
                  lambda cmd_id, result: reports.__setitem__(cmd_id, result.ok))
        loaded = [_rows(plan, t) == _rows(_plan(rank, torch.device("cpu"), team), s) for s, t in zip(SOURCE, TARGET)]
        untouched = [all(set(p.pages[t].flatten().cpu().tolist()) == {SENTINEL} for p in plan.moved_planes)
                     for t in TARGET]
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "reports": {str(k): v for k, v in reports.items()}, "loaded": loaded, "untouched": untouched,
            "object_bytes": layout.object_bytes, "full_bytes": plan.object_bytes, "counters": counters.snapshot(),
            "loaded_from": sorted({o.device.type for o in loads.seen}),
            "stored_from": sorted({o.device.type for o in stores.seen})}))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, fault: str, kind: str, size: int = 2, share_ranks: int = 2) -> list[dict[str, Any]]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(size, f"file://{tmp_path}/rendezvous", str(tmp_path), fault, kind, share_ranks),
             nprocs=size, join=True)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(size)]


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                              or not torch.distributed.is_nccl_available(), reason="needs two CUDA GPUs and NCCL")
KINDS = ["host", "device-cpu", pytest.param("device-cuda", marks=[pytest.mark.cuda, two_gpus])]


@pytest.mark.parametrize("kind", KINDS)
def test_shares_round_trip_byte_exact(tmp_path: Path, kind: str) -> None:
    ranks = _run(tmp_path, "none", kind)
    for r in ranks:
        assert all(r["reports"].values()) and len(r["reports"]) == 4
        assert r["loaded"] == [True, True]
        # each rank stores its own 40 B rows whole and half of the 128 B replicated rows
        plan = _plan(0)
        half = -(-(plan.object_bytes - plan.replicated_offset) // 2 // 64) * 64
        assert plan.replicated_offset == CHUNK * 40 and r["object_bytes"] == plan.replicated_offset + half
        assert r["counters"]["share_exchanged_bytes"] > 0
        # the device exchange hands the kernels objects in device memory; the host one, host objects
        assert r["loaded_from"] == r["stored_from"] == (["cuda"] if kind == "device-cuda" else ["cpu"])
        assert "share_host_fallbacks" not in r["counters"]


@pytest.mark.parametrize("kind", KINDS)
def test_share_missing_on_one_rank_fails_the_load_on_both(tmp_path: Path, kind: str) -> None:
    ranks = _run(tmp_path, "missing", kind)
    for r in ranks:
        assert r["reports"]["10"] is False and r["reports"]["11"] is True
        assert r["untouched"] == [True, False]  # chunk 0 wrote no row on either rank
        assert r["loaded"] == [False, True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_byte_in_one_share_is_seen_on_every_rank(tmp_path: Path, kind: str) -> None:
    ranks = _run(tmp_path, "wrong_byte", kind)
    for r in ranks:
        assert r["loaded"] == [False, True]  # the byte came from rank 1's share, rank 0 received it too


@pytest.mark.parametrize("kind", KINDS[1:])
def test_a_rank_without_device_memory_moves_the_whole_group_to_the_host_exchange(tmp_path: Path, kind: str) -> None:
    ranks = _run(tmp_path, "no_device_memory", kind)  # a rank that skipped the device gather alone would hang
    for r in ranks:
        assert all(r["reports"].values()) and r["loaded"] == [True, True]
        assert r["counters"]["share_host_fallbacks"] == 1
        assert r["loaded_from"] == ["cpu"]


def test_share_groups_inside_a_tp_group_exchange_apart(tmp_path: Path) -> None:
    """TP=4 with two KV heads: ranks {0,1} and {2,3} each hold one head and share it; a share lost on rank 1 fails
    chunk 0 in its pair only, and each pair rebuilds its own bytes, not the other pair's."""
    ranks = _run(tmp_path, "missing", "device-cpu", size=4, share_ranks=2)
    for r in ranks[:2]:
        assert r["reports"]["10"] is False and r["reports"]["11"] is True and r["loaded"] == [False, True]
    for r in ranks[2:]:
        assert all(r["reports"].values()) and r["loaded"] == [True, True]
        assert r["counters"]["share_exchanged_bytes"] > 0


def test_a_store_without_device_memory_uses_host_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(0)
    layout = ShareLayout(plan.object_bytes, plan.replicated_offset, 0, 2)

    def store() -> tuple[list[torch.Tensor], dict[int, bool], TierCounters]:
        counters, reports = TierCounters(), {}
        mover = SharedMover(WholeObjectMover(plan, SOURCE), layout,
                            ShareExchange(None, object(), torch.device("cpu")), counters)
        arena = [torch.full((layout.object_bytes,), 0xEE, dtype=torch.uint8) for _ in SOURCE]
        key = ChunkKey("0" * 32, b"k")
        mover.run([DeviceMove(Store(i, key, i, "r", i), NO_WINDOW) for i in range(len(SOURCE))], arena,
                  lambda cmd_id, result: reports.__setitem__(cmd_id, result.ok))
        return arena, reports, counters

    expected, _, counters = store()  # the device scratch (the CPU standing in for the device)
    assert "share_store_host_scratch" not in counters.snapshot()
    zeros = torch.zeros

    def full_device(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            raise torch.OutOfMemoryError("device full")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", full_device)
    arena, reports, counters = store()
    assert reports == {0: True, 1: True} and counters.snapshot()["share_store_host_scratch"] == 1
    assert all(torch.equal(a, b) for a, b in zip(arena, expected))  # the same shares, packed from host scratch
    assert not any(set(a.tolist()) == {0xEE} for a in arena)  # control: every slot was written
