"""Arena eviction policies (`store/policies/`) and the slow tiers' reuse gate: eviction orders computed by hand, scan
resistance with LRU as the negative control, pins under every policy, and a gate that keeps one-off chunks off disk
and Mooncake while a chunk found again reaches them (its bytes checked when another instance loads it)."""

from typing import Optional

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from lmcache_npu.store.commands import Completion, Put, Spill
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.policies import POLICIES, ArcPolicy, LruPolicy, S3FifoPolicy, make_policy

from .fakes import Cluster, MemoryRemote, make_key

OBJECT_BYTES = 3000


def evict_all(policy, pinned=frozenset()) -> list:
    """The order a policy gives up its unpinned chunks, one victim at a time."""
    order = []
    while (key := policy.victim(lambda k: k not in pinned)) is not None:
        policy.remove(key, evicted=True)
        order.append(key)
    return order


def settle(index: ChunkIndex, remote: Optional[set] = None) -> list:
    """Completes every command at once on one rank (puts land in `remote`); returns the commands."""
    issued = []
    while commands := index.take_commands():
        issued += commands
        for command in commands:
            if isinstance(command, Put) and remote is not None:
                remote.add(command.key)
        index.on_completions([Completion(c.cmd_id, 0, True) for c in commands])
    return issued


# ---- eviction order, by hand ----

def test_lru_gives_up_the_least_recently_used_first():
    lru = LruPolicy(4)
    for key in (1, 2, 3):
        lru.insert(key)
    lru.touch(1, reuse=False)
    assert list(lru) == [2, 3, 1]
    assert evict_all(lru) == [2, 3, 1]


def test_arc_evicts_once_seen_chunks_first_and_adapts_on_a_ghost_hit():
    arc = ArcPolicy(3)
    for key in (1, 2, 3):
        arc.insert(key)
    arc.touch(1, reuse=True)  # 1 moves to the frequent list; target for recent is 0
    assert arc.victim(lambda k: True) == 2  # recent (2, 3) exceeds its target: its oldest goes
    arc.remove(2, evicted=True)  # 2 becomes a recent ghost
    arc.insert(4)  # recent: 3, 4
    assert arc.victim(lambda k: True) == 3
    arc.remove(3, evicted=True)  # ghosts: 2, 3
    arc.insert(2)  # a ghost hit: recent was too small, its target grows by max(1, 0 / 1) = 1
    assert arc.target_recent == 1.0
    assert list(arc) == [1, 2, 4]  # recent (4) holds no more than its target: frequent (1, 2) goes first
    assert evict_all(arc) == [1, 2, 4]


def test_arc_negative_control_a_wrong_order_is_noticed():
    arc = ArcPolicy(3)
    for key in (1, 2, 3):
        arc.insert(key)
    arc.touch(1, reuse=True)
    assert evict_all(arc) != [1, 2, 3]  # LRU's answer for the same sequence


def test_s3fifo_probation_main_and_ghost_by_hand():
    s3 = S3FifoPolicy(10)  # small queue target: 1 slot
    for key in (1, 2, 3):
        s3.insert(key)
    s3.touch(2, reuse=True)
    assert s3.victim(lambda k: True) == 1  # small's head, never found again
    s3.remove(1, evicted=True)  # remembered in the ghost
    assert s3.victim(lambda k: True) == 3  # 2 was found again: it moved to main, 3 is small's next head
    s3.remove(3, evicted=True)
    s3.insert(1)  # a ghost: straight into main, behind 2
    assert list(s3) == [2, 1]
    s3.touch(2, reuse=True)
    assert evict_all(s3) == [1, 2]  # 2 has a use left: it gets another lap, 1 goes first


def test_policies_refuse_bad_capacity_and_unknown_names():
    with pytest.raises(ValueError, match=r"capacity \(slots\) must be an integer >= 1, got 0"):
        ArcPolicy(0)
    with pytest.raises(ValueError, match="eviction_policy must be one of arc, lru, s3fifo, got 'mru'"):
        make_policy("mru", 4)
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        StoreConfig.from_dict({"eviction_policy": "fifo"})
    with pytest.raises(ValueError, match="remote_admit_hits must be an integer from 0"):
        StoreConfig.from_dict({"remote_admit_hits": -1})
    with pytest.raises(ValueError, match="disk_admit_hits must be an integer from 0"):
        StoreConfig.from_dict({"disk_admit_hits": True})
    with pytest.raises(ValueError, match="empty EvictionPolicy of 4 slots"):
        ChunkIndex(4, eviction_policy=LruPolicy(5))


# ---- scan resistance through the real index ----

@pytest.mark.parametrize("policy,hot_kept", [("lru", 0), ("arc", 4), ("s3fifo", 4)])
def test_a_scan_of_one_off_chunks_evicts_the_hot_set_only_under_lru(policy, hot_kept):
    index = ChunkIndex(10, eviction_policy=policy)
    hot = [make_key(i) for i in range(4)]
    index.prepare_store("w", list(enumerate(hot)))
    settle(index)
    for reader in ("a", "b"):  # the hot set is looked up again by two requests
        assert index.lookup(reader, hot).ready_chunks == 4
        index.release(reader)
    for i in range(20):  # a burst of one-off prompts, each stored once
        index.prepare_store(f"scan{i}", [(0, make_key(100 + i))])
        settle(index)
    kept = sum(index.location(key)[0] is not None for key in hot)
    assert kept == hot_kept
    index.check_invariants()


# ---- pins under every policy ----

@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)),
       ops=st.lists(st.tuples(st.sampled_from(["store", "lookup", "load", "release", "settle"]),
                              st.sampled_from(["r0", "r1", "r2"]),
                              st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True)), max_size=60))
def test_pinned_and_writing_slots_survive_every_policy(policy, ops):
    index = ChunkIndex(4, eviction_policy=policy)
    looked: dict[str, list] = {}
    for op, request, picks in ops:
        keys = [make_key(i) for i in picks]
        held = {c.key: c.slot for c in index.chunks()
                if c.slot is not None and (c.readers or c.reservations or c.slot_state.value == "writing")}
        if op == "store":
            index.prepare_store(request, list(enumerate(keys)))
        elif op == "lookup":
            looked[request] = keys[:index.lookup(request, keys).ready_chunks]
        elif op == "load" and looked.get(request):
            ready = [k for k in looked.pop(request) if index.location(k)[1].value in ("ready", "reading")]
            index.prepare_load(request, list(enumerate(ready)))
        elif op == "release":
            index.release(request)
            looked.pop(request, None)
        elif op == "settle":
            settle(index)
        if op == "store":  # the only step that evicts here: whatever the policy proposed, held chunks kept slots
            for key, slot in held.items():
                assert index.location(key)[0] == slot, f"{policy} evicted a pinned or writing chunk"
        index.check_invariants()


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), keys=st.lists(st.integers(0, 30), min_size=1, max_size=30),
       pinned=st.sets(st.integers(0, 30)), reuses=st.lists(st.integers(0, 30), max_size=20))
def test_a_policy_proposes_only_evictable_chunks_and_none_only_when_all_are_pinned(policy, keys, pinned, reuses):
    chosen = make_policy(policy, 8)
    resident = []
    for key in keys:
        if key in chosen:
            continue
        if len(resident) == 8:
            victim = chosen.victim(lambda k: True)
            chosen.remove(victim, evicted=True)
            resident.remove(victim)
        chosen.insert(key)
        resident.append(key)
    for key in reuses:
        if key in chosen:
            chosen.touch(key, reuse=True)
    victim = chosen.victim(lambda k: k not in pinned)
    if all(key in pinned for key in resident):
        assert victim is None
    else:
        assert victim in resident and victim not in pinned
    assert sorted(chosen) == sorted(resident) and len(chosen) == len(resident)


# ---- the reuse gate ----

def gated_index(gate: int, remote: set) -> ChunkIndex:
    return ChunkIndex(2, disk_chunks=8, remote_exists=lambda ks: [k in remote for k in ks],
                      remote_admit_hits=gate, disk_admit_hits=gate)


@pytest.mark.parametrize("gate,puts,spills", [(1, 0, 0), (0, 6, 4)])  # gate 0: the negative control, today's path
def test_the_gate_writes_nothing_for_one_off_chunks(gate, puts, spills):
    remote: set = set()
    index = gated_index(gate, remote)
    issued = []
    for i in range(6):  # each looked up once (a miss), stored, then evicted by the next ones
        key = make_key(i)
        index.lookup(f"q{i}", [key])
        issued += settle(index, remote)
        index.prepare_store(f"q{i}", [(0, key)])
        issued += settle(index, remote)
        index.release(f"q{i}")
    kinds = [type(c) for c in issued]
    assert (kinds.count(Put), kinds.count(Spill)) == (puts, spills)
    assert index.counters["evicted_not_reused"] == (4 if gate else 0)
    index.check_invariants()


def test_the_gate_puts_a_chunk_when_it_is_found_again_and_spills_it_when_evicted():
    remote: set = set()
    index = gated_index(1, remote)
    key = make_key(1)
    index.lookup("first", [key])
    index.prepare_store("first", [(0, key)])
    assert not [c for c in settle(index, remote) if isinstance(c, Put)]
    assert index.lookup("first", [key]).ready_chunks == 1  # the same request asking again is not a reuse
    assert index.reuses(key) == 0 and not index.take_commands()
    index.release("first")
    assert index.lookup("second", [key]).ready_chunks == 1  # a later request: the put goes out with this lookup
    (put,) = index.take_commands()
    assert isinstance(put, Put) and put.key == key and index.reuses(key) == 1
    index.on_completions([Completion(put.cmd_id, 0, True)])
    index.release("second")
    for i in (2, 3):  # two more chunks evict the reused one: it is spilled, the gate let it in
        index.prepare_store("w", [(0, make_key(i))])
        spilled = [c for c in settle(index, remote) if isinstance(c, Spill)]
        if spilled:
            assert [c.key for c in spilled] == [key]
    assert index.location(key)[2].value == "present"
    index.check_invariants()


def test_a_chunk_admitted_by_reuse_loads_byte_exact_on_another_instance():
    objects: dict = {}
    writer = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, num_ranks=2, remote=MemoryRemote(objects))
    reader = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, num_ranks=2, remote=MemoryRemote(objects))
    for cluster in (writer, reader):  # the same index with the Mooncake gate on
        cluster.index = ChunkIndex(4, 2, remote_exists=cluster.remote_exists, remote_admit_hits=1)
    try:
        once, twice = make_key(10), make_key(11)
        for key in (once, twice):
            writer.index.lookup("w1", [key])
            writer.store("w1", [key])
        writer.index.release("w1")
        assert not objects  # nothing reused yet: nothing in Mooncake
        writer.load("w2", [twice])  # found again on the writer: put now
        writer.settle()
        assert sorted(objects) == sorted(twice.storage_name(rank) for rank in range(2))
        assert reader.load("r", [twice]) == 1  # promoted from Mooncake, loaded, bytes checked on every rank
        assert reader.load("r", [once]) == 0
        assert not writer.mismatches and not reader.mismatches
        assert [len(device.loaded) for device in reader.devices] == [1, 1]
    finally:
        writer.close()
        reader.close()
