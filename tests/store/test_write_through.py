"""Disk write-through (`disk_write_through`): every chunk stored, or promoted from the remote store, is also written
to disk in the background, so a restarted engine finds what its arena held and not only what it evicted. Each
comparison has a control without write-through; every load checks each rank's bytes against the pattern stored."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from lmcache_npu.store.commands import ARENA_TO_DISK, Command, Drop, Persist, Promote, Put, Spill, Tier
from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.disk import HEADER_BYTES, DiskTier
from lmcache_npu.store.envelope import ENVELOPE_BYTES, Sealer, verify
from lmcache_npu.store.executor import StoreExecutor
from lmcache_npu.store.factory import build_index
from lmcache_npu.transfer.pipeline import build_executor
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.index.contract import DiskState, SlotState
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import OK, Failure, TierResult

from .fakes import Cluster, MemoryRemote, PatternDevice, chunk_payload, make_key

OBJECT_BYTES = 5000  # not a page multiple: slots are padded, objects and files are not
FINGERPRINT = b"W" * 16


@pytest.fixture
def disks(tmp_path):
    tiers = [DiskTier(tmp_path / "kv", FINGERPRINT) for _ in range(2)]
    yield tiers
    for tier in tiers:
        tier.close()


class HeldWrites:
    """A disk tier whose write-throughs (copy=False) of the names in `hold` wait for `release`, as on a disk too slow
    to keep up; spills and other names go straight to the real tier."""

    def __init__(self, tier: DiskTier, hold: set[str]) -> None:
        self.tier = tier
        self.hold = hold
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tier, name)

    def write_async(self, name: str, data, done: Optional[Callable] = None, copy: bool = True,
                    urgent: bool = False) -> TierResult:
        if copy or name not in self.hold:
            return self.tier.write_async(name, data, done, copy=copy, urgent=urgent)

        def later() -> None:
            self.release.wait(30)
            queued = self.tier.write_async(name, data, done, copy=False)
            if not queued.ok:
                done(queued)

        threading.Thread(target=later, daemon=True).start()
        return OK


class FailingWrites(HeldWrites):
    """A disk tier whose write-throughs fail on the writer thread, after being accepted (as an I/O error would)."""

    def __init__(self, tier: DiskTier) -> None:
        super().__init__(tier, set())

    def write_async(self, name: str, data, done: Optional[Callable] = None, copy: bool = True,
                    urgent: bool = False) -> TierResult:
        if copy:
            return self.tier.write_async(name, data, done)
        threading.Thread(target=done, args=(TierResult.fail(Failure.IO, "injected"),), daemon=True).start()
        return OK


def step_past(cluster: Cluster, held: Callable[[Command], bool]) -> list[Command]:
    """One scheduler step that waits for the answers to every command except the `held` ones (Cluster.step waits
    for all); answers to held commands that arrive meanwhile are passed on too."""
    commands = cluster.index.take_commands()
    cluster.issued.extend(commands)
    for executor in cluster.executors:
        executor.submit(commands)
    wanted = {(c.cmd_id, rank) for c in commands if not held(c) for rank in range(len(cluster.executors))}
    done = []
    deadline = time.monotonic() + 30
    while wanted - {(c.cmd_id, c.rank) for c in done}:
        assert time.monotonic() < deadline, "commands did not complete"
        time.sleep(0.005)
        done += [c for executor in cluster.executors for c in executor.poll()]
    cluster.index.on_completions(done)
    cluster.index.check_invariants()
    return commands


def settle_past(cluster: Cluster, held: Callable[[Command], bool]) -> None:
    """Steps until nothing but `held` commands is in flight."""
    for _ in range(10):
        step_past(cluster, held)
        if not cluster.index.queued_commands() and not any(cluster.index.is_pending(c.cmd_id) and not held(c)
                                                 for c in cluster.issued):
            return
    raise AssertionError("commands still in flight")


def file_payload(disk: DiskTier, key: ChunkKey, rank: int) -> Optional[bytes]:
    """The chunk object a disk file holds, after its envelope was checked for this key and rank (a file whose
    envelope does not verify reads as its reason, which never equals a payload)."""
    path = Path(disk.file_path(key.storage_name(rank)))
    if not path.exists():
        return None
    sealed = bytearray(path.read_bytes()[HEADER_BYTES:])
    why = verify(sealed, key, rank, Sealer())
    return why.encode() if why is not None else bytes(sealed[:-ENVELOPE_BYTES])


@pytest.mark.parametrize("write_through", [True, False])
def test_a_stored_chunk_is_on_disk_after_settle_without_any_eviction(disks, write_through):
    cluster = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=8,
                      disk_write_through=write_through)
    keys = [make_key(i) for i in range(3)]
    cluster.store("a", keys)
    for disk in disks:
        assert disk.flush(10)
    assert cluster.index.counters["evictions"] == 0 and not any(isinstance(c, Spill) for c in cluster.issued)
    for key in keys:
        slot, state, on_disk = cluster.index.location(key)
        assert slot is not None and state is SlotState.READY
        payloads = [file_payload(disk, key, rank) for rank, disk in enumerate(disks)]
        if write_through:
            assert on_disk is DiskState.PRESENT
            assert payloads == [chunk_payload(key, rank, OBJECT_BYTES).tobytes() for rank in range(2)]
        else:  # control: the same run without write-through leaves nothing on disk
            assert on_disk is DiskState.NONE and payloads == [None, None]
    assert cluster.index.counters["persists"] == (3 if write_through else 0)
    assert cluster.load("b", keys) == 3 and not cluster.mismatches  # the arena copies are untouched
    cluster.close()


def test_the_slot_stays_pinned_while_its_persist_is_in_flight(tmp_path):
    a, b, c, d = (make_key(i) for i in range(4))
    tiers = [DiskTier(tmp_path / "kv", FINGERPRINT) for _ in range(2)]
    held = [HeldWrites(tier, {a.storage_name(rank)}) for rank, tier in enumerate(tiers)]
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, disks=held, disk_chunks=8, disk_write_through=True)
    index = cluster.index

    def persist_of_a(command: Command) -> bool:
        return isinstance(command, Persist) and command.key == a

    index.prepare_store("r", [(0, a)])
    settle_past(cluster, persist_of_a)
    (persist,) = [x for x in cluster.issued if persist_of_a(x)]
    slot_a = persist.slot
    assert index.is_pending(persist.cmd_id)
    assert index.location(a) == (slot_a, SlotState.READING, DiskState.WRITING)
    index.prepare_store("r", [(1, b)])
    settle_past(cluster, persist_of_a)
    assert index.location(b)[1:] == (SlotState.READY, DiskState.PRESENT)
    # a is the least recently used chunk, yet its persist pins it: c takes b's slot (b is on disk: no spill)
    (store_c,) = index.prepare_store("r", [(2, c)])
    assert store_c.slot != slot_a and index.location(b) == (None, SlotState.FREE, DiskState.PRESENT)
    assert index.prepare_store("r", [(3, d)]) == []  # a pinned, c being written: no slot at all
    assert index.counters["store_no_slot"] == 1
    settle_past(cluster, persist_of_a)
    assert index.is_pending(persist.cmd_id) and index.location(a)[:2] == (slot_a, SlotState.READING)
    for disk in held:
        disk.release.set()
    cluster.settle()
    assert index.location(a) == (slot_a, SlotState.READY, DiskState.PRESENT)
    assert not any(isinstance(x, Spill) for x in cluster.issued)
    (store_d,) = index.prepare_store("r", [(3, d)])  # control: unpinned, a is the LRU victim it was not before
    assert store_d.slot == slot_a
    cluster.settle()
    for key in (a, b, c, d):  # a and b come back from their files (a's written from the slot while it was pinned)
        assert cluster.load("q", [key]) == 1
    assert not cluster.mismatches
    cluster.close()
    for tier in tiers:
        tier.close()


@pytest.mark.parametrize("write_through", [True, False])
def test_evicting_a_written_through_chunk_spills_nothing_and_it_comes_back_from_disk(disks, write_through):
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=10,
                      disk_write_through=write_through)
    keys = [make_key(i) for i in range(6)]
    for start in (0, 2, 4):  # 2 slots, 6 chunks: the first four are evicted
        cluster.store("a", keys[start:start + 2])
    kinds = [type(c) for c in cluster.issued]
    assert cluster.index.counters["evictions"] == 4
    # control: without write-through the same evictions spill
    assert (kinds.count(Spill), kinds.count(Persist)) == ((0, 6) if write_through else (4, 0))
    assert [cluster.index.location(k)[2] for k in keys[:4]] == [DiskState.PRESENT] * 4
    result = cluster.index.lookup("b", keys[:2])
    assert (result.hit_chunks, result.ready_chunks) == (2, 0)
    assert [p.source for p in cluster.index.queued_commands() if isinstance(p, Promote)] == [Tier.DISK] * 2
    cluster.index.release("b")
    cluster.settle()
    assert cluster.load("b", keys[:2]) == 2 and not cluster.mismatches
    assert sum(isinstance(c, Persist) for c in cluster.issued) == kinds.count(Persist)  # a disk copy is not rewritten
    cluster.close()


def test_a_persist_that_fails_on_one_rank_drops_every_ranks_copy(disks):
    cluster = Cluster(num_slots=1, object_bytes=OBJECT_BYTES, disks=[disks[0], FailingWrites(disks[1])],
                      disk_chunks=4, disk_write_through=True)
    a, b = make_key(1), make_key(2)
    cluster.index.prepare_store("s", [(0, a)])
    cluster.step()  # the store; its persist goes out with the next step
    cluster.step()  # the persist: written on rank 0, failed on rank 1
    assert cluster.index.counters["persist_failed"] == 1
    assert [(type(c), c.key, c.tier) for c in cluster.index.queued_commands()] == [(Drop, a, Tier.DISK)]
    assert cluster.index.location(a)[1:] == (SlotState.READY, DiskState.NONE)
    assert file_payload(disks[0], a, 0) is not None  # rank 0's copy landed: the drop below has something to remove
    cluster.step()
    assert file_payload(disks[0], a, 0) is None and not disks[0].exists(a.storage_name(0))
    assert cluster.load("r", [a]) == 1 and not cluster.mismatches  # the arena copy stays good
    cluster.store("s", [b])  # evicts a: with no disk copy left it is spilled, which rank 1 can still do
    assert [c.key for c in cluster.issued if isinstance(c, Spill)] == [a]
    assert cluster.index.location(a) == (None, SlotState.FREE, DiskState.PRESENT)
    assert cluster.load("r", [a]) == 1 and not cluster.mismatches
    cluster.close()


def test_the_persists_of_a_batch_follow_its_puts(disks):
    cluster = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=disks, disk_chunks=8, remote=MemoryRemote(),
                      disk_write_through=True)
    keys = [make_key(i) for i in range(3)]
    cluster.index.prepare_store("a", list(enumerate(keys)))
    cluster.step()  # three stores answered in one batch
    assert [(type(c), c.key) for c in cluster.index.queued_commands()] == [(Put, k) for k in keys] + [(Persist, k) for k in keys]
    cluster.settle()
    assert [cluster.index.location(k)[1:] for k in keys] == [(SlotState.READY, DiskState.PRESENT)] * 3
    assert len(cluster.remote.objects) == 6
    cluster.close()


def test_a_chunk_promoted_from_the_remote_store_is_written_through(tmp_path):
    shared: dict[str, bytes] = {}
    keys = [make_key(i) for i in range(2)]
    writer = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, remote=MemoryRemote(shared))
    writer.store("a", keys)
    writer.close()
    tiers = [DiskTier(tmp_path / "kv", FINGERPRINT) for _ in range(2)]
    reader = Cluster(num_slots=4, object_bytes=OBJECT_BYTES, disks=tiers, disk_chunks=8, remote=MemoryRemote(shared),
                     disk_write_through=True)
    assert reader.load("b", keys) == 2 and not reader.mismatches
    assert [p.source for p in reader.issued if isinstance(p, Promote)] == [Tier.REMOTE] * 2
    assert [p.key for p in reader.issued if isinstance(p, Persist)] == keys
    assert not any(isinstance(c, Put) for c in reader.issued)  # it came from there
    for tier in tiers:
        assert tier.flush(10)
    for key in keys:
        assert reader.index.location(key)[2] is DiskState.PRESENT
        assert [file_payload(t, key, r) for r, t in enumerate(tiers)] == [
            chunk_payload(key, r, OBJECT_BYTES).tobytes() for r in range(2)]
    reader.close()
    for tier in tiers:
        tier.close()


def _start(config: StoreConfig, namespace: str) -> tuple[ChunkIndex, list[StoreExecutor]]:
    index = build_index(config, OBJECT_BYTES, 2, namespace, FINGERPRINT)
    workers = [build_executor(config, rank, OBJECT_BYTES, FINGERPRINT, PatternDevice(rank), namespace)
               for rank in range(2)]
    return index, workers


def _settle(index: ChunkIndex, workers: list[StoreExecutor]) -> None:
    for _ in range(10):
        commands = index.take_commands()
        for worker in workers:
            worker.submit(commands)
        index.on_completions([c for worker in workers for c in worker.drain(30)])
        index.check_invariants()
        if index.in_flight == 0 and not index.queued_commands():
            return
    raise AssertionError("commands still in flight")


@pytest.mark.parametrize("write_through", [True, False])
def test_a_restart_finds_every_stored_chunk_including_those_never_evicted(tmp_path, write_through):
    namespace = "cd" * 16
    config = StoreConfig.from_dict({"cpu_bytes": 2 * 8192, "pinned": False, "disk_path": str(tmp_path / "kv"),
                                    "disk_bytes": 16 * (OBJECT_BYTES + HEADER_BYTES),
                                    "disk_write_through": write_through})
    keys = [make_key(i, namespace) for i in range(5)]
    index, workers = _start(config, namespace)
    assert index.num_slots == 2
    for key in keys:
        index.prepare_store("w", [(0, key)])
        _settle(index, workers)
    never_evicted = [k for k in keys if index.location(k)[0] is not None]
    assert len(never_evicted) == 2
    for worker in workers:
        worker.close()  # flushes the disk tier's queue, as a clean shutdown does

    index, workers = _start(config, namespace)  # a new scheduler and new workers over the same directory
    found = [k for k in keys if index.location(k)[2] is DiskState.PRESENT]
    if write_through:
        assert found == keys
    else:  # control: without write-through the chunks the arena held at shutdown are gone
        assert found == [k for k in keys if k not in never_evicted]
    for key in found:  # two slots: one chunk at a time, each promoted from its files
        assert index.lookup("r", [key]).hit_chunks == 1
        _settle(index, workers)
        index.prepare_load("r", [(0, key)])
        _settle(index, workers)
        index.release("r")
    assert index.lookup("r", never_evicted).hit_chunks == (2 if write_through else 0)
    index.release("r")
    devices = [worker.mover for worker in workers]
    assert [len(device.loaded) for device in devices] == [len(found)] * 2
    assert not any(device.mismatches for device in devices)
    for worker in workers:
        worker.close()


def test_a_persist_is_answered_once_without_a_disk_and_when_the_tier_raises():
    cluster = Cluster(num_slots=2, object_bytes=OBJECT_BYTES, num_ranks=1)
    executor = cluster.executors[0]
    executor.submit([Persist(1, make_key(1), 0)])
    assert [(c.cmd_id, c.ok, c.reason) for c in executor.drain(10)] == [(1, False, "no disk tier")]

    class Raising:
        def write_async(self, name, data, done=None, copy=True, urgent=False):
            raise OSError("device gone")

    executor.disk = Raising()
    executor.submit([Persist(2, make_key(1), 0), Persist(3, make_key(2), 1)])
    done = sorted(executor.drain(10), key=lambda c: c.cmd_id)
    assert [(c.cmd_id, c.ok) for c in done] == [(2, False), (3, False)]
    assert all("device gone" in c.reason for c in done)
    cluster.close()


@pytest.mark.parametrize("copy", [False, True])
def test_a_write_without_copy_reads_the_callers_buffer_when_it_is_written(tmp_path, copy):
    tier = DiskTier(tmp_path / "kv", FINGERPRINT, writer_threads=1)
    blocking, unblock = threading.Event(), threading.Event()

    def hold_the_writer(result: TierResult) -> None:  # runs on the only writer thread: the next write waits
        blocking.set()
        unblock.wait(30)

    assert tier.write_async("first", b"x" * 10, hold_the_writer) == OK
    assert blocking.wait(30)
    buffer = bytearray(b"a" * 4000)
    answers: list[TierResult] = []
    assert tier.write_async("second", buffer, answers.append, copy=copy) == OK
    buffer[:] = b"b" * 4000  # after queueing, before the writer reads it
    unblock.set()
    assert tier.flush(10) and answers == [OK]
    written = Path(tier.file_path("second")).read_bytes()[HEADER_BYTES:]
    assert written == (b"a" * 4000 if copy else b"b" * 4000)  # control: copy=True wrote the bytes it was given
    tier.close()


def test_a_write_without_copy_still_counts_against_the_pending_bound(tmp_path):
    tier = DiskTier(tmp_path / "kv", FINGERPRINT, max_pending_bytes=1000)
    assert tier.write_async("big", bytearray(2000), copy=False) == TierResult.fail(Failure.QUEUE_FULL)
    assert tier.counters["queue_full"] == 1
    tier.close()



@pytest.mark.parametrize("num_slots", [4, 64])
def test_persists_that_pin_an_eighth_of_the_arena_wait_for_no_idle_core(tmp_path, num_slots):
    """A persist pins its slot until written; once persists (and one per yielding thread, which may hold one) could
    pin more than 1/PINNED_SHARE of the arena, they are urgent (the rescuer runs them and their disk writes at once)
    so stores find room. The large arena is the control: its persists wait for an idle core."""
    from lmcache_npu.store.routes.disk import PINNED_SHARE

    cluster = Cluster(num_slots=num_slots, object_bytes=OBJECT_BYTES, num_ranks=1)
    executor = cluster.executors[0]
    executor.disk = DiskTier(tmp_path / "kv", FINGERPRINT, writer_threads=1)
    kinds: list[str] = []
    for kind in ("submit", "submit_urgent"):
        real = getattr(executor.context.background, kind)
        setattr(executor.context.background, kind, lambda fn, *args, real=real, kind=kind: kinds.append(kind) or real(fn, *args))
    executor.submit([Persist(1, make_key(1), 0)])
    assert [c.ok for c in executor.drain(10)] == [True]
    may_pin = 1 + executor.context.background.workers
    assert kinds == (["submit_urgent"] if may_pin * PINNED_SHARE > num_slots else ["submit"])
    assert not executor.route(ARENA_TO_DISK).pinning  # answered: it pins nothing any more
    executor.disk.close()
    cluster.close()
