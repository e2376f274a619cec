"""Slow-tier admission from the cost model (issue 40 item 4): a chunk reaches disk or Mooncake only when the hits it
can expect save more compute than writing it costs. The model's rule with injected fits (no clock), then the index
obeying it, each with the control that writes every chunk (no admission, as `load_policy: load-all` runs)."""

from __future__ import annotations

from typing import Optional

import pytest

from lmcache_npu.store.commands import Completion, Persist, Put, Spill, Tier
from lmcache_npu.store.cost import CostModel, Path, SlowTierAdmission, StepShape, TransferSample
from lmcache_npu.store.cost.compute import MIN_STEPS
from lmcache_npu.store.index.chunk_index import ChunkIndex

from .fakes import make_key

CHUNK_TOKENS = 128
OBJECT_BYTES = 2 << 20


def fitted_model(per_token: float, per_context: float, step_s: float = 0.01) -> CostModel:
    """A model whose compute side learned `step_s + per_token x tokens + per_context x attention` from steps."""
    model = CostModel(budget=8192, object_bytes=OBJECT_BYTES)
    now = 0.0
    for i in range(4 * MIN_STEPS):
        shape = StepShape.of([(64 * (i % 7), 32 + 96 * (i % 5)), (1000 + i, 1)])
        step = model.on_schedule(shape, now)
        now += step_s + per_token * shape.tokens + per_context * shape.attention
        model.on_done([step], now)
    assert model.fitted
    return model


def teach(model: CostModel, path: Path, bytes_per_s: float) -> None:
    """Workers timed `path` at this bandwidth (no fixed latency)."""
    model.on_samples([TransferSample(path, n, n * OBJECT_BYTES, 0, n * OBJECT_BYTES / bytes_per_s, True)
                      for n in (4, 8, 16, 32) * 10])


def test_a_tier_slower_than_computing_is_declined_and_a_faster_one_admitted():
    model = fitted_model(per_token=1e-4, per_context=1e-9)  # 12.8 ms per chunk of compute
    admission = SlowTierAdmission(model, CHUNK_TOKENS)
    teach(model, Path.DISK, 0.1e9)  # 21 ms to read a chunk back
    teach(model, Path.REMOTE, 2e9)  # 1 ms
    assert admission.saving_s(Tier.DISK, 0) < 0 < admission.saving_s(Tier.REMOTE, 0)
    assert not admission.pays(Tier.DISK, 0, reuses=0)
    assert admission.pays(Tier.REMOTE, 0, reuses=0)
    assert not admission.pays(Tier.DISK, 0, reuses=50)  # no reuse makes a negative saving pay


def test_one_declined_write_in_probe_every_is_admitted_so_the_tier_stays_measurable():
    """A tier that turned slow still gets one write in PROBE_EVERY, per tier: it keeps chunks whose reads (the cut's
    probes) measure it again. The faster tier's admissions do not count towards the slow one's probes."""
    from lmcache_npu.store.cost.admission import PROBE_EVERY

    model = fitted_model(per_token=1e-4, per_context=1e-9)
    admission = SlowTierAdmission(model, CHUNK_TOKENS)
    teach(model, Path.DISK, 0.1e9)
    teach(model, Path.REMOTE, 2e9)
    answers = []
    for _ in range(2 * PROBE_EVERY):
        answers.append(admission.pays(Tier.DISK, 0, reuses=0))
        assert admission.pays(Tier.REMOTE, 0, reuses=0)
    assert [i for i, admitted in enumerate(answers) if admitted] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]


def test_until_fitted_and_while_the_read_path_is_only_seeded_every_chunk_is_admitted():
    unfitted = CostModel(budget=8192, object_bytes=OBJECT_BYTES)
    teach(unfitted, Path.DISK, 0.01e9)
    assert SlowTierAdmission(unfitted, CHUNK_TOKENS).pays(Tier.DISK, 0, reuses=0)
    seeded = fitted_model(per_token=1e-7, per_context=0.0)  # computing is nearly free: any read loses to it
    admission = SlowTierAdmission(seeded, CHUNK_TOKENS)
    assert admission.saving_s(Tier.DISK, 0) < 0 and admission.pays(Tier.DISK, 0, reuses=0)  # never from a seed
    teach(seeded, Path.DISK, 1e9)
    assert not admission.pays(Tier.DISK, 0, reuses=0)  # the control: once measured, the same figures decline it


def test_reuse_pays_for_a_slow_write():
    model = fitted_model(per_token=1e-4, per_context=0.0)
    admission = SlowTierAdmission(model, CHUNK_TOKENS)
    teach(model, Path.DISK, 1e9)  # saving per hit: 12.8 - 2.1 - 0.1 ms, about 10.5 ms
    teach(model, Path.DISK_WRITE, 0.05e9)  # writing it: 42 ms
    saving, write = admission.saving_s(Tier.DISK, 0), admission.write_s(Tier.DISK)
    first = next(r for r in range(100) if (1 + r) * saving > write)
    assert 2 <= first <= 5
    assert not admission.pays(Tier.DISK, 0, reuses=first - 1) and admission.pays(Tier.DISK, 0, reuses=first)


def test_a_deep_chunk_pays_where_the_first_does_not():
    model = fitted_model(per_token=0.0, per_context=1e-7)  # attention only: 0.8 ms at chunk 0, 27 ms at chunk 16
    admission = SlowTierAdmission(model, CHUNK_TOKENS)
    teach(model, Path.DISK, 0.2e9)  # 10.5 ms to read
    assert not admission.pays(Tier.DISK, 0, reuses=0)
    assert not admission.pays(Tier.DISK, None, reuses=0)  # no position known: judged as the first chunk
    assert admission.pays(Tier.DISK, 16, reuses=0)


def test_a_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        SlowTierAdmission(CostModel(budget=8), 0)


# ---- the index obeys it ----------------------------------------------------------------------------------------

def _index(admission, write_through: bool, remote: set) -> ChunkIndex:
    index = ChunkIndex(2, disk_chunks=8, remote_exists=lambda ks: [k in remote for k in ks],
                       disk_write_through=write_through)
    index.admission = admission
    return index


def _serve(index: ChunkIndex, remote: set, count: int) -> list:
    """`count` one-chunk requests stored one after another (each evicts an older one from the 2-slot arena)."""
    issued = []
    for i in range(count):
        key = make_key(i)
        index.lookup(f"q{i}", [key])
        index.prepare_store(f"q{i}", [(i, key)])
        while commands := index.take_commands():
            issued += commands
            remote.update(c.key for c in commands if isinstance(c, Put))
            index.on_completions([Completion(c.cmd_id, 0, True) for c in commands])
        index.release(f"q{i}")
    return issued


def _kinds(issued: list) -> tuple[int, int, int]:
    kinds = [type(c) for c in issued]
    return kinds.count(Put), kinds.count(Spill), kinds.count(Persist)


@pytest.mark.parametrize("write_through", [False, True])
def test_the_index_writes_only_what_the_model_admits(write_through):
    asked: list[tuple[Tier, Optional[int], int]] = []

    def deep_disk_only(tier: Tier, chunk_index: Optional[int], reuses: int) -> bool:
        asked.append((tier, chunk_index, reuses))
        return tier is Tier.DISK and chunk_index is not None and chunk_index >= 3

    remote: set = set()
    index = _index(deep_disk_only, write_through, remote)
    puts, spills, persists = _kinds(_serve(index, remote, 6))
    assert puts == 0 and index.counters["cost_declined_remote_puts"] == 6
    disk_writes = persists if write_through else spills
    assert disk_writes == (3 if write_through else 1)  # chunks 3, 4, 5 written through; only 3 evicted by 4 and 5
    assert persists + spills == disk_writes
    # chunks 0, 1, 2: asked at write-through and again at eviction
    assert index.counters["cost_declined_disk_writes"] == (6 if write_through else 3)
    assert {c for t, c, _ in asked if t is Tier.DISK} <= set(range(6))
    if not write_through:
        assert index.counters["evicted_lost"] == 3  # declined chunks are gone once evicted
    index.check_invariants()


def test_negative_control_without_admission_every_chunk_is_written():
    remote: set = set()
    index = _index(None, True, remote)
    assert _kinds(_serve(index, remote, 6)) == (6, 0, 6)
    assert index.counters["cost_declined_disk_writes"] == index.counters["cost_declined_remote_puts"] == 0
    assert "cost_declined_disk_writes" not in index.counters and "spills" not in index.counters
