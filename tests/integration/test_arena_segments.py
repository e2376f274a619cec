"""Arena segments through the connector: each rank reports the slot ranges of its live segments, the scheduler's
index hands out only slots live on every rank, and a segment one rank could not register is never stored into."""

from __future__ import annotations

import itertools

import pytest

from lmcache_npu.platform.host_memory import SegmentPinning

from lmcache_npu.integration.vllm.metadata import LMCacheNPUWorkerMetadata
from lmcache_npu.store import arena as arena_module

from ..store.test_segments import FakeRegistrar
from .conftest import preset_engine, prompt


def test_worker_metadata_keeps_every_ranks_usable_slots_when_aggregated() -> None:
    a = LMCacheNPUWorkerMetadata([], {0: ((0, 4),)})
    b = LMCacheNPUWorkerMetadata([], {1: ((0, 2), (3, 4))})
    assert a.aggregate(b).usable_slots == {0: ((0, 4),), 1: ((0, 2), (3, 4))}
    assert a.aggregate(LMCacheNPUWorkerMetadata()).usable_slots == {0: ((0, 4),)}


def test_a_segment_one_rank_could_not_register_is_never_stored_into(make_engine, monkeypatch: pytest.MonkeyPatch):
    calls = itertools.count()
    registrars: list[FakeRegistrar] = []

    def pinning_for_rank(npu_host_memory: str = "auto") -> tuple[SegmentPinning, None]:
        # rank 0's arena registers every segment; rank 1's refuses its second one
        registrar = FakeRegistrar(refuse=frozenset({1}) if next(calls) == 1 else frozenset())
        registrars.append(registrar)
        return SegmentPinning([registrar]), None

    monkeypatch.setattr(arena_module, "device_pinning", pinning_for_rank)
    engine = preset_engine(make_engine, "llama3-8b", "ascend", world=2,
                           extra_config={"pinned": True, "cpu_bytes": "48MiB", "arena_segment_bytes": "8MiB"})
    arenas = [w.worker_half.executor.arena for w in engine.workers]
    for arena in arenas:
        assert arena.wait_ready(30)
    per_segment = arenas[0].memory.slots_per_segment
    assert len(arenas[0].memory.segments) >= 3 and per_segment >= 1
    left_out = range(per_segment, 2 * per_segment)
    assert arenas[1].usable_ranges()[0] == (0, per_segment), "rank 1 should have lost its second segment"
    index = engine.connector.scheduler_half.index
    for r in range(3 * index.num_slots):  # far more chunks than slots: every usable slot is used, some reused
        engine.add(prompt(2 * 128 + 5, seed=1000 + r), max_tokens=1, request_id=f"r{r}")
        engine.run()
        if index.usable_slots == index.num_slots - per_segment:
            break
    assert index.usable_slots == index.num_slots - per_segment
    held = {chunk.slot for chunk in index.chunks()}
    assert held and not held & set(left_out), f"left-out slots {sorted(held & set(left_out))} hold chunks"
    assert index.counters["stores"] > 0
    index.check_invariants()
    stats = engine.stats.data
    assert stats["segments_total"] == sum(len(a.memory.segments) for a in arenas)
    assert stats["segments_live"] == stats["segments_total"] - 1
