"""store/index/reuse_gate.py alone: a chunk reaches a gated tier only once N later requests asked for it (a request
polling while its chunks are promoted counts once), within a bounded table that forgets the longest unasked keys."""

from __future__ import annotations

from lmcache_npu.store.commands import Tier
from lmcache_npu.store.index.reuse_gate import SEEN_MIN, SEEN_PER_SLOT, ReuseGate
from lmcache_npu.store.keys import ChunkKey


def key(n: int) -> ChunkKey:
    return ChunkKey("0" * 32, n.to_bytes(4, "big"))


def test_a_chunk_reaches_a_gated_tier_after_n_later_requests_asked_for_it() -> None:
    gate = ReuseGate(8, remote_admit_hits=2, disk_admit_hits=0)
    for request in ("first", "second"):
        gate.count(request, [key(1)])
        assert not gate.admits(key(1), Tier.REMOTE)
    gate.count("third", [key(1)])
    assert gate.reuses(key(1)) == 2 and gate.admits(key(1), Tier.REMOTE)


def test_negative_control_one_request_asking_again_and_again_counts_once() -> None:
    gate = ReuseGate(8, remote_admit_hits=1, disk_admit_hits=1)
    assert gate.count("polling", [key(1), key(2)]) == [True, True]
    for _ in range(5):
        assert gate.count("polling", [key(1), key(2)]) == [False, False]
    assert gate.reuses(key(1)) == 0 and not gate.admits(key(1), Tier.DISK)


def test_a_forgotten_request_counts_again() -> None:
    gate = ReuseGate(8, remote_admit_hits=1, disk_admit_hits=1)
    gate.count("request", [key(1)])
    gate.forget("request")
    assert gate.count("request", [key(1)]) == [True] and gate.reuses(key(1)) == 1


def test_zero_admits_every_chunk_and_gates_nothing() -> None:
    gate = ReuseGate(8, remote_admit_hits=0, disk_admit_hits=3)
    assert not gate.gates(Tier.REMOTE) and gate.admits(key(9), Tier.REMOTE)
    assert gate.gates(Tier.DISK) and not gate.admits(key(9), Tier.DISK)


def test_the_table_is_bounded_and_forgets_the_longest_unasked_key() -> None:
    gate = ReuseGate(SEEN_MIN, remote_admit_hits=1, disk_admit_hits=1)
    assert gate.capacity == SEEN_PER_SLOT * SEEN_MIN
    gate.count("a", [key(0)])
    gate.count("b", [key(0)])  # key 0: one reuse, then left unasked
    gate.count("c", [key(n) for n in range(1, gate.capacity)])
    gate.count("d", [key(1)])  # key 1 is asked again: now the most recent
    assert len(gate) == gate.capacity and gate.reuses(key(0)) == 1
    gate.count("e", [key(gate.capacity)])
    assert len(gate) == gate.capacity and gate.reuses(key(0)) == 0 and gate.reuses(key(1)) == 1
