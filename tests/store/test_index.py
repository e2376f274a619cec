"""The scheduler-side index and the worker executors, in one process: hits, LRU, pins, spills, promotions,
remote puts, failures. Every load checks the bytes each rank gets back against the pattern it stored."""

import time
from pathlib import Path

import pytest

from lmcache_npu.store.index import remote_presence as index_module
from lmcache_npu.store.commands import Completion, Drop, Load, Promote, Put, Spill, Store, Tier
from lmcache_npu.store.disk import DiskTier
from lmcache_npu.store.envelope import sealed_bytes
from lmcache_npu.store.disk import disk_chunks_for_capacity
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.index.contract import DiskState, SlotState
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import Failure, TierResult

from .fakes import Cluster, MemoryRemote, PatternDevice, make_key

OBJECT_BYTES = 5000  # not a page multiple: slots are padded, objects are not


@pytest.fixture
def disks(tmp_path):
    tiers = [DiskTier(tmp_path / "kv", b"L" * 16) for _ in range(2)]
    yield tiers
    for tier in tiers:
        tier.close()


def test_store_then_lookup_and_load_return_the_same_bytes():
    cluster = Cluster(num_slots=8, object_bytes=OBJECT_BYTES)
    keys = [make_key(i) for i in range(5)]
    assert len(cluster.store("a", keys)) == 5
    result = cluster.index.lookup("b", keys + [make_key(99)])
    assert (result.hit_chunks, result.ready_chunks, result.pending) == (5, 5, False)
    cluster.index.release("b")
    assert cluster.load("b", keys) == 5
    assert not cluster.mismatches and len(cluster.devices[1].loaded) == 5
    assert cluster.store("c", keys) == []  # already held: nothing stored twice
    cluster.close()


def test_lookup_is_a_prefix_and_a_gap_ends_it():
    cluster = Cluster(num_slots=8, object_bytes=OBJECT_BYTES)
    keys = [make_key(i) for i in range(4)]
    cluster.store("a", [keys[0], keys[1], keys[3]])
    assert cluster.index.lookup("b", keys).hit_chunks == 2
    cluster.close()


def test_chunk_is_visible_only_after_every_rank_completed_its_store():
    index = ChunkIndex(num_slots=4, num_ranks=3)
    key = make_key(1)
    (store,) = index.prepare_store("a", [(0, key)])
    assert index.take_commands() == [store]
    assert index.lookup("b", [key]) == (index.lookup("b", [key]))
    assert index.lookup("b", [key]).pending  # being written counts as a hit that is not ready yet
    index.on_completions([Completion(store.cmd_id, 0, True), Completion(store.cmd_id, 2, True)])
    assert index.location(key)[1] is SlotState.WRITING
    index.on_completions([Completion(store.cmd_id, 1, True)])
    assert index.location(key)[1] is SlotState.READY
    index.check_invariants()


def test_one_failing_rank_fails_the_store_and_frees_the_slot():
    index = ChunkIndex(num_slots=1, num_ranks=2)
    key = make_key(1)
    (store,) = index.prepare_store("a", [(0, key)])
    index.on_completions([Completion(store.cmd_id, 0, True), Completion(store.cmd_id, 1, False, "device")])
    assert index.location(key) == (None, SlotState.FREE, DiskState.NONE)
    assert index.lookup("b", [key]).hit_chunks == 0
    assert index.counters["store_failed"] == 1
    index.check_invariants()


def test_unknown_and_duplicate_completions_are_ignored_and_counted():
    index = ChunkIndex(num_slots=2, num_ranks=1)
    (store,) = index.prepare_store("a", [(0, make_key(1))])
    index.on_completions([Completion(store.cmd_id, 0, True), Completion(store.cmd_id, 0, True),
                          Completion(12345, 0, True)])
    assert index.counters["unexpected_completions"] == 2
    index.check_invariants()


def test_lru_evicts_the_least_recently_used_unpinned_chunk():
    cluster = Cluster(num_slots=3, object_bytes=OBJECT_BYTES, num_ranks=1)
    a, b, c, d = (make_key(i) for i in range(4))
    cluster.store("r", [a, b, c])
    cluster.index.lookup("touch", [a])  # a is now reserved and recently used
    cluster.index.release("touch")
    cluster.store("r", [d])  # evicts b, the oldest untouched
    assert cluster.index.location(b)[0] is None
    assert all(cluster.index.location(k)[1] is SlotState.READY for k in (a, c, d))
    assert cluster.index.counters["evicted_lost"] == 1  # no disk tier: it vanishes, and the count says so
    cluster.close()


def test_pinned_and_reserved_slots_are_never_evicted():
    index = ChunkIndex(num_slots=2, num_ranks=1)
    a, b, c = (make_key(i) for i in range(3))
    stores = index.prepare_store("r", [(0, a), (1, b)])
    index.on_completions([Completion(s.cmd_id, 0, True) for s in stores])
    (load,) = index.prepare_load("x", [(0, a)])  # a: a load is reading it
    assert index.location(a)[1] is SlotState.READING
    index.lookup("y", [b])  # b: reserved between lookup and load
    index.take_commands()
    assert index.prepare_store("r", [(2, c)]) == []
    assert index.counters["store_no_slot"] == 1
    index.on_completions([Completion(load.cmd_id, 0, True)])
    (store_c,) = index.prepare_store("r", [(2, c)])
    assert store_c.slot == stores[0].slot  # a was unpinned by its load's completion and is now the victim
    index.release("y")
    index.check_invariants()


def test_writing_slots_are_never_reused():
    index = ChunkIndex(num_slots=1, num_ranks=1)
    index.prepare_store("r", [(0, make_key(0))])
    assert index.prepare_store("r", [(1, make_key(1))]) == []


def test_begin_load_of_a_chunk_that_is_not_ready_names_it():
    index = ChunkIndex(num_slots=2, num_ranks=1)
    key = make_key(7)
    with pytest.raises(ValueError, match=f"request 'q' chunk 3: key {key.chunk_hash.hex()} is absent"):
        index.prepare_load("q", [(3, key)])
    index.prepare_store("r", [(0, key)])
    with pytest.raises(ValueError, match="is writing in the arena"):
        index.prepare_load("q", [(0, key)])


def test_eviction_spills_to_disk_before_the_slot_is_reused_and_promotion_brings_it_back(disks):
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=10)
    keys = [make_key(i) for i in range(6)]
    for start in (0, 2, 4):  # 2 slots, 6 chunks: the first four are spilled as later ones arrive
        cluster.store("a", keys[start:start + 2])
    kinds = [type(c) for c in cluster.issued]
    assert kinds.count(Spill) == 4
    for spill in (c for c in cluster.issued if isinstance(c, Spill)):
        reuse = next(i for i, c in enumerate(cluster.issued) if isinstance(c, Store) and c.slot == spill.slot
                     and i > cluster.issued.index(spill))
        assert cluster.issued.index(spill) < reuse
    assert [cluster.index.location(k)[2] for k in keys[:4]] == [DiskState.PRESENT] * 4
    for disk in disks:
        assert disk.flush(10)
    # the first two chunks come back from disk through promotions, bytes checked on both ranks
    result = cluster.index.lookup("b", keys[:2])
    assert (result.hit_chunks, result.ready_chunks) == (2, 0)
    promotes = [c for c in cluster.index.queued_commands() if isinstance(c, Promote)]
    assert [p.source for p in promotes] == [Tier.DISK, Tier.DISK]
    cluster.index.release("b")
    cluster.settle()
    assert cluster.load("b", keys[:2]) == 2
    assert not cluster.mismatches
    cluster.close()


def test_disk_capacity_drops_the_oldest_copies(disks):
    cluster = Cluster(num_slots=1, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=2)
    keys = [make_key(i) for i in range(5)]
    for key in keys:
        cluster.store("a", [key])
    drops = [c for c in cluster.issued if isinstance(c, Drop)]
    assert [d.key for d in drops] == keys[:2] and all(d.tier is Tier.DISK for d in drops)
    for disk in disks:
        disk.flush(10)
        assert not disk.exists(keys[0].storage_name(0 if disk is disks[0] else 1))
    assert cluster.index.lookup("b", keys).hit_chunks == 0
    cluster.index.release("b")
    assert [cluster.index.location(k)[2] for k in keys] == [DiskState.NONE] * 2 + [DiskState.PRESENT] * 2 + [
        DiskState.NONE]
    assert cluster.index.location(keys[4])[1] is SlotState.READY
    cluster.close()


def test_a_corrupt_file_on_one_rank_is_a_miss_never_a_load(disks):
    cluster = Cluster(num_slots=1, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=4)
    a, b = make_key(1), make_key(2)
    cluster.store("s", [a])
    cluster.store("s", [b])  # a spilled
    disks[1].flush(10)
    path = Path(disks[1].file_path(a.storage_name(1)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cluster.load("r", [a]) == 0
    assert cluster.index.counters["promote_failed"] == 1
    assert cluster.index.location(a) == (None, SlotState.FREE, DiskState.NONE)
    assert disks[1].counters["rejected"] == 1  # the envelope names the damage (disk format 2 hashes no payload)
    assert not disks[0].exists(a.storage_name(0))  # the healthy rank's copy is dropped too: useless alone
    assert not cluster.mismatches
    cluster.close()


def test_restart_adopts_what_every_rank_has_on_disk(tmp_path):
    path = tmp_path / "kv"
    first = [DiskTier(path, b"L" * 16) for _ in range(2)]
    cluster = Cluster(num_slots=1, object_bytes=OBJECT_BYTES, disks=first, disk_chunks=8)
    keys = [make_key(i) for i in range(4)]
    for key in keys:
        cluster.store("a", [key])
    cluster.close()
    for tier in first:
        tier.close()
    # a new scheduler and new workers: the index is rebuilt from the file names every rank has
    second = [DiskTier(path, b"L" * 16) for _ in range(2)]
    from lmcache_npu.store.disk import scan_disk_directory

    ranks_holding: dict[ChunkKey, set[int]] = {}
    for entry in scan_disk_directory(path, b"L" * 16):
        key, rank = ChunkKey.from_storage_name(entry.name)
        ranks_holding.setdefault(key, set()).add(rank)
    restarted = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=second, disk_chunks=8)
    assert restarted.index.adopt_disk([k for k, r in ranks_holding.items() if r == {0, 1}]) == 3
    assert restarted.load("r", keys[:3]) == 3
    assert not restarted.mismatches
    restarted.close()
    for tier in second:
        tier.close()


def test_stored_chunks_are_put_to_the_remote_store_and_another_instance_finds_them():
    shared: dict[str, bytes] = {}
    first = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    keys = [make_key(i) for i in range(3)]
    first.store("a", keys)
    assert sum(isinstance(c, Put) for c in first.issued) == 3
    assert len(shared) == 3 * 2  # one object per chunk and rank
    second = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    result = second.index.lookup("b", keys)
    assert (result.hit_chunks, result.ready_chunks) == (3, 0)
    second.index.release("b")
    assert second.load("b", keys) == 3
    assert all(p.source is Tier.REMOTE for p in second.issued if isinstance(p, Promote))
    assert not second.mismatches
    first.close()
    second.close()


def test_a_remote_store_that_is_down_turns_into_misses():
    remote = MemoryRemote()
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=remote)
    keys = [make_key(i) for i in range(2)]
    remote.down = True
    cluster.store("a", keys)
    assert cluster.index.counters["put_failed"] == 2
    assert cluster.load("b", keys) == 2  # the arena copies are untouched
    other = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=remote)
    assert other.index.lookup("c", keys).hit_chunks == 0
    cluster.close()
    other.close()


def test_a_remote_chunk_gone_between_lookup_and_promotion_is_a_miss():
    shared: dict[str, bytes] = {}
    Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared)).store("a", [make_key(1)])
    reader = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    assert reader.index.lookup("b", [make_key(1)]).hit_chunks == 1
    shared.pop(make_key(1).storage_name(1))
    reader.settle()
    assert reader.index.counters["promote_failed"] == 1
    reader.index.release("b")
    assert reader.load("b", [make_key(1)]) == 0
    assert not reader.mismatches
    reader.close()


def test_a_remote_chunk_that_fails_to_promote_is_a_miss_for_a_while_then_tried_again(monkeypatch):
    shared: dict[str, bytes] = {}
    Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared)).store("a", [make_key(1)])
    remote = MemoryRemote(shared)
    reader = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, remote=remote)
    listed_but_unreadable = remote.get_into
    remote.get_into = lambda names, buffers: [TierResult.fail(Failure.CORRUPT)] * len(names)
    assert reader.index.lookup("b", [make_key(1)]).hit_chunks == 1
    reader.settle()
    reader.index.release("b")
    assert reader.index.counters["promote_failed"] == 1
    promotes = sum(isinstance(c, Promote) for c in reader.issued)
    for request in ("c", "d"):  # the store still lists it: without the memory every lookup would promote again
        result = reader.index.lookup(request, [make_key(1)])
        assert result.hit_chunks == 0 and not reader.index.is_pending(request)
        reader.settle()
    assert sum(isinstance(c, Promote) for c in reader.issued) == promotes
    remote.get_into = listed_but_unreadable
    later = time.monotonic() + index_module.REMOTE_MISS_AFTER_FAILURE_S + 1
    monkeypatch.setattr(index_module.time, "monotonic", lambda: later)
    assert reader.index.lookup("e", [make_key(1)]).hit_chunks == 1
    reader.settle()
    reader.index.release("e")
    assert reader.load("e", [make_key(1)]) == 1
    assert not reader.mismatches
    reader.close()


def test_prefetched_remote_answers_serve_the_next_lookup_of_that_thread_once(monkeypatch):
    shared: dict[str, bytes] = {}
    Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared)).store("a", [make_key(1)])
    reader = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    asked: list[int] = []
    exists = reader.index._remote._exists
    reader.index._remote._exists = lambda keys: asked.append(len(keys)) or exists(keys)
    keys = [make_key(1), make_key(2)]
    reader.index.prefetch_remote(keys)
    assert asked == [2]
    assert reader.index.lookup("b", keys).hit_chunks == 1 and asked == [2]  # answered from the prefetch
    reader.index.release("b")
    assert reader.index.presence(keys) == [True, False] and asked == [2, 1]  # taken once: asked again
    reader.index.prefetch_remote([make_key(3)])
    assert reader.index.presence(keys) == [True, False] and asked == [2, 1, 1, 1]  # key 2 not prefetched: asked
    reader.index.prefetch_remote(keys)
    later = time.monotonic() + index_module.PREFETCH_TTL_S + 1
    monkeypatch.setattr(index_module.time, "monotonic", lambda: later)
    assert reader.index.presence(keys) == [True, False] and asked == [2, 1, 1, 1, 1, 1]  # too old: asked again
    reader.close()


def test_a_holder_reserves_and_loads_at_most_its_cap_of_distinct_chunks():
    cluster = Cluster(num_slots=8, object_bytes=OBJECT_BYTES, num_ranks=1)
    index = cluster.index
    index.limit_holders(lambda request_id: request_id.split("/")[0], 3)
    keys = [make_key(i) for i in range(8)]
    cluster.store("w", keys)
    assert index.lookup("a/1", keys).hit_chunks == 3  # the cap ends the hit
    assert index.lookup("a/2", keys[:3]).hit_chunks == 3  # a chunk its holder holds already costs nothing
    assert index.lookup("b/1", keys).hit_chunks == 3
    assert index.holders.held_by("a") == 3 and index.holders.held_by("b") == 3
    loads = index.prepare_load("a/1", list(enumerate(keys[:2])))
    index.release("a/1")
    index.release("a/2")
    assert index.holders.held_by("a") == 2  # its loads hold what its reservations held, until every rank answered
    index.take_commands()
    index.on_completions([Completion(load.cmd_id, 0, True) for load in loads])
    assert index.holders.held_by("a") == 0
    index.check_invariants()  # the holders' counts agree with the chunks'
    index.limit_holders(lambda request_id: "?", None)  # later calls only change the cap
    assert index.lookup("a/3", keys).hit_chunks == 8
    index.check_invariants()
    cluster.close()


def test_executor_reports_every_command_even_without_tiers():
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, num_ranks=1)
    key = make_key(3)
    executor = cluster.executors[0]
    executor.submit([Spill(1, key, 0), Promote(2, key, 1, Tier.DISK), Promote(3, key, 1, Tier.REMOTE),
                     Put(4, key, 0), Drop(5, key, Tier.DISK), Drop(6, key, Tier.REMOTE)])
    done = {c.cmd_id: c for c in executor.drain(10)}
    assert sorted(done) == [1, 2, 3, 4, 5, 6]
    assert done[1].reason == "no disk tier" and done[3].reason == "no remote tier" and done[5].ok
    executor.mover = None
    executor.submit([Load(7, key, 0, "r", 0)])
    assert executor.drain(10)[0].reason == "no device mover"
    cluster.close()


def test_a_device_mover_that_raises_fails_its_commands_instead_of_hanging():
    class Broken:
        def run(self, commands, objects, report):
            report(commands[0].cmd_id, TierResultOk)
            raise ValueError("slot table out of range")

    from lmcache_npu.store.tier import OK as TierResultOk

    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, num_ranks=1)
    executor = cluster.executors[0]
    executor.mover = Broken()
    executor.submit([Store(1, make_key(1), 0, "r", 0), Store(2, make_key(2), 1, "r", 1)])
    done = sorted(executor.drain(10), key=lambda c: c.cmd_id)
    assert [(c.ok, c.reason) for c in done] == [(True, ""), (False, "device: slot table out of range")]
    cluster.close()


def test_capacity_conversions():
    assert disk_chunks_for_capacity(10 * (4096 + 64), 4096) == 10
    assert disk_chunks_for_capacity(0, 4096) == 0


def test_a_prefix_mixing_remote_and_local_chunks_keeps_every_slot_accounted_for():
    shared: dict[str, bytes] = {}
    keys = [make_key(i) for i in range(4)]
    Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared)).store("a", keys)
    local = Cluster(num_slots=6, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    local.store("b", [keys[1], keys[3]])  # held here; 0 and 2 only in the remote store
    result = local.index.lookup("c", keys)
    assert (result.hit_chunks, result.ready_chunks) == (4, 0)
    assert [p.key for p in local.index.queued_commands() if isinstance(p, Promote)] == [keys[0], keys[2]]
    local.index.check_invariants()
    local.index.release("c")
    assert local.load("c", keys) == 4 and not local.mismatches
    local.close()


def _complete_all(index: ChunkIndex, remote: set) -> list:
    commands = index.take_commands()
    remote.update(c.key for c in commands if isinstance(c, Put))
    index.on_completions([Completion(c.cmd_id, 0, True) for c in commands])
    return commands


def test_a_remote_promotion_whose_eviction_drops_its_own_disk_copy_keeps_the_slot_owned():
    present: set = set()
    index = ChunkIndex(num_slots=1, num_ranks=1, disk_chunks=1, remote_exists=lambda ks: [k in present for k in ks])
    a, b = make_key(1), make_key(2)
    index.prepare_store("r1", [(0, a)])
    _complete_all(index, present)
    _complete_all(index, present)  # store A, then put A
    index.prepare_store("r2", [(0, b)])  # evicts A: its spill stays in flight
    spill, store_b = index.take_commands()
    index.on_completions([Completion(store_b.cmd_id, 0, True)])
    _complete_all(index, present)  # put B
    # A: disk copy still writing, so the lookup takes it from remote; its eviction of B drops A's disk copy
    assert index.lookup("r3", [a]).hit_chunks == 1
    index.check_invariants()
    _complete_all(index, present)
    index.on_completions([Completion(spill.cmd_id, 0, True)])
    assert index.location(a)[1] is SlotState.READY
    index.release("r3")
    index.check_invariants()
    assert len(index.prepare_store("r4", [(0, make_key(9))])) == 1  # the slot is usable again


def test_a_lookup_never_evicts_its_own_later_hits(disks):
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=8)
    a, b, c = make_key(1), make_key(2), make_key(3)
    for key in (a, b, c):
        cluster.store("r", [key])  # arena: B, C; A spilled
    result = cluster.index.lookup("q", [a, b])
    assert (result.hit_chunks, result.ready_chunks) == (2, 0)
    assert cluster.index.location(b)[1] is SlotState.READY and cluster.index.location(c)[0] is None
    cluster.index.release("q")
    assert cluster.load("q", [a, b]) == 2 and not cluster.mismatches
    cluster.close()


def test_lookup_does_not_keep_reservations_past_its_hit_prefix():
    index = ChunkIndex(num_slots=3, num_ranks=1)
    keys = [make_key(i) for i in range(3)]
    stores = index.prepare_store("s", [(0, keys[0]), (2, keys[2])])
    index.on_completions([Completion(s.cmd_id, 0, True) for s in stores])
    assert index.lookup("q", keys).hit_chunks == 1
    assert {c.key for c in index.chunks() if "q" in c.reservations} == {keys[0]}  # keys[2] lies past the gap: not held for this request
    index.check_invariants()


def test_begin_load_issues_nothing_when_any_chunk_is_not_ready():
    index = ChunkIndex(num_slots=2, num_ranks=1)
    ready, writing = make_key(1), make_key(2)
    (store,) = index.prepare_store("s", [(0, ready)])
    index.on_completions([Completion(store.cmd_id, 0, True)])
    index.prepare_store("s", [(1, writing)])
    index.take_commands()
    with pytest.raises(ValueError, match="is writing in the arena"):
        index.prepare_load("q", [(0, ready), (1, writing)])
    assert index.take_commands() == [] and index.in_flight == 1  # only the store still in flight


def test_restart_counts_each_ranks_own_files_and_drops_partial_chunks(tmp_path):
    from lmcache_npu.store.config import StoreConfig
    from lmcache_npu.store.factory import build_index
    from lmcache_npu.transfer.pipeline import build_executor

    namespace = "ab" * 16
    config = StoreConfig.from_dict({"cpu_bytes": 2 * 8192, "pinned": False, "disk_path": str(tmp_path / "kv"),
                                    "disk_bytes": 4 * (sealed_bytes(OBJECT_BYTES) + 64)})
    index = build_index(config, OBJECT_BYTES, 2, namespace, b"L" * 16)
    workers = [build_executor(config, rank, OBJECT_BYTES, b"L" * 16, PatternDevice(rank), namespace)
               for rank in range(2)]
    keys = [make_key(i, namespace) for i in range(6)]

    def settle(target=index):
        for _ in range(5):
            commands = target.take_commands()
            for w in workers:
                w.submit(commands)
            target.on_completions([c for w in workers for c in w.drain(30)])

    for key in keys:  # 2 slots, disk for 4: the disk fills up
        index.prepare_store("w", [(0, key)])
        settle()
    assert [w.disk.used_bytes // (sealed_bytes(OBJECT_BYTES) + 64) for w in workers] == [4, 4]
    for w in workers:
        w.close()
    # a crash mid-spill left one chunk on rank 0 only
    stray = make_key(99, namespace)
    stray_tier = DiskTier(tmp_path / "kv", b"L" * 16)
    stray_tier.write_async(stray.storage_name(0), bytes(sealed_bytes(OBJECT_BYTES)))
    stray_tier.close()
    restarted = build_index(config, OBJECT_BYTES, 2, namespace, b"L" * 16)
    workers = [build_executor(config, rank, OBJECT_BYTES, b"L" * 16, PatternDevice(rank), namespace)
               for rank in range(2)]
    file_bytes = sealed_bytes(OBJECT_BYTES) + 64
    assert [w.disk.used_bytes // file_bytes for w in workers] == [5, 4]  # own files only, stray included
    settle(restarted)  # the stray is dropped by the first step's commands
    assert [w.disk.used_bytes // (sealed_bytes(OBJECT_BYTES) + 64) for w in workers] == [4, 4]
    for i in range(6, 10):  # the disk keeps working after a restart with a full disk
        restarted.prepare_store("w", [(0, make_key(i, namespace))])
        settle(restarted)
    assert restarted.counters["spill_failed"] == 0
    for w in workers:
        w.close()


def test_a_command_naming_a_slot_outside_the_arena_fails_alone():
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, num_ranks=1)
    executor = cluster.executors[0]
    executor.submit([Store(1, make_key(1), 7, "r", 0), Store(2, make_key(2), 1, "r", 1)])
    done = {c.cmd_id: c for c in executor.drain(10)}
    assert "arena slot 7 out of range (the arena has 2" in done[1].reason and done[2].ok
    cluster.close()


def test_locate_answers_what_a_lookup_would_without_reserving_or_promoting_anything():
    """The cut decides on `locate` before the lookup moves anything: the same hit, ready part and tier per chunk
    (arena, disk and remote mixed), one remote existence batch shared with the lookup that follows, no command and
    no reservation. The lookup after it (the control) promotes the same chunks."""
    shared: dict[str, bytes] = {}
    keys = [make_key(i) for i in range(5)]
    Cluster(num_slots=8, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared)).store("a", keys[:4])
    asked: list[int] = []
    remote = MemoryRemote(shared)
    local = Cluster(num_slots=8, object_bytes=OBJECT_BYTES, remote=remote)
    exists = local.index._remote._exists
    local.index._remote._exists = lambda ks: (asked.append(len(ks)), exists(ks))[1]
    local.store("b", [keys[0], keys[2]])  # arena: 0 and 2; remote only: 1 and 3; nowhere: 4
    located = local.index.locate(keys)
    assert (located.hit_chunks, located.ready_chunks) == (4, 1)
    assert located.sources == (Tier.ARENA, Tier.REMOTE, Tier.ARENA, Tier.REMOTE)
    assert not local.index.queued_commands() and not any(v.reservations for v in local.index.chunks())
    result = local.index.lookup("c", keys)
    assert (result.hit_chunks, result.ready_chunks, result.sources) == (4, 1, located.sources)
    assert [p.key for p in local.index.queued_commands() if isinstance(p, Promote)] == [keys[1], keys[3]]
    assert asked == [4]  # the lookup took the locate's remote answers
    local.index.release("c")
    local.close()
