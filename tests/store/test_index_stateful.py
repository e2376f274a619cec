"""Random interleavings of store / lookup / load / release / worker steps / disk corruption / remote outages,
driving one index and two real executors (real arena, real disk tier, in-memory remote) against a simple model:
what was stored. Evictions, spills, disk drops and promotions happen because the arena and disk are small. Each run
draws whether stored chunks are also written through to disk (`disk_write_through`).

Checked after every rule: the index's own invariants; every load's bytes on every rank (a wrong byte is a
mismatch); a lookup's ready prefix holds only chunks whose store completed; and, in the lossless machine (disk
large enough for every chunk), a chunk once stored is found again whenever nothing pins the arena.

Each machine runs once per arena eviction policy (LRU, ARC, S3-FIFO); the lossy one also draws the slow tiers' reuse
gates (a chunk reaches Mooncake or, evicted, the disk only after a later lookup), which may lose chunks but never
loads a wrong byte."""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmcache_npu.store.disk import DiskTier
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.index.contract import DiskState, SlotState
from lmcache_npu.store.policies import POLICIES

from .fakes import Cluster, MemoryRemote, make_key

KEYS = [make_key(i) for i in range(10)]
REQUESTS = ["r0", "r1", "r2"]
OBJECT_BYTES = 3000


class IndexMachine(RuleBasedStateMachine):
    lossless = True
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="lmcache-npu-index-")
        self.disks = [DiskTier(self.root, b"F" * 16) for _ in range(2)]
        self.remote = None if self.lossless else MemoryRemote()
        self.cluster = None
        self.write_through = False
        self.corrupted: set = set()  # chunks whose disk file we damaged: they may be lost, never loaded wrong
        self.lookups: dict[str, list] = {}

    @initialize(write_through=st.booleans(), remote_gate=st.integers(0, 1), disk_gate=st.integers(0, 1))
    def start(self, write_through, remote_gate, disk_gate):
        self.write_through = write_through
        disk_chunks = len(KEYS) if self.lossless else 1
        num_slots = 3 if self.lossless else 4
        self.cluster = Cluster(num_slots=num_slots, object_bytes=OBJECT_BYTES, disks=self.disks,
                               disk_chunks=disk_chunks, remote=self.remote, disk_write_through=write_through)
        # the same index with this machine's policy and gates (a lossless disk takes every evicted chunk)
        self.cluster.index = ChunkIndex(num_slots, 2, disk_chunks=disk_chunks,
                                        remote_exists=self.cluster.remote_exists,
                                        disk_write_through=write_through, eviction_policy=self.policy,
                                        remote_admit_hits=remote_gate,
                                        disk_admit_hits=0 if self.lossless else disk_gate)
        self.index = self.cluster.index
        self.stored = self.cluster.stored  # chunks whose store completed on every rank

    def teardown(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        for disk in self.disks:
            disk.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(request=st.sampled_from(REQUESTS), picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4,
                                                            unique=True))
    def store(self, request, picks):
        self.index.prepare_store(request, list(enumerate(picks)))

    @rule()
    def step(self):
        self.cluster.step()

    @rule()
    def settle(self):
        self.cluster.settle()

    @rule(request=st.sampled_from(REQUESTS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5,
                                                           unique=True))
    def lookup(self, request, keys):
        result = self.index.lookup(request, keys)
        assert result.ready_chunks <= result.hit_chunks <= len(keys)
        for key in keys[:result.ready_chunks]:
            assert key in self.stored, "a ready chunk that was never stored"
        self.lookups[request] = keys[:result.ready_chunks]

    @precondition(lambda self: any(self.lookups.values()))
    @rule(request=st.sampled_from(REQUESTS))
    def load(self, request):
        loadable = (SlotState.READY, SlotState.READING)
        keys = [k for k in self.lookups.pop(request, []) if self.index.location(k)[1] in loadable]
        self.index.prepare_load(request, list(enumerate(keys)))

    @rule(request=st.sampled_from(REQUESTS))
    def release(self, request):
        self.index.release(request)
        self.lookups.pop(request, None)

    @rule(key=st.sampled_from(KEYS), rank=st.integers(0, 1))
    def corrupt_disk_file(self, key, rank):
        disk = self.disks[rank]
        disk.flush(10)
        path = disk.file_path(key.storage_name(rank))
        try:
            with open(path, "r+b") as f:
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 0x5A]))
        except FileNotFoundError:
            return
        self.corrupted.add(key)

    @precondition(lambda self: self.remote is not None)
    @rule(down=st.booleans())
    def remote_outage(self, down):
        self.remote.down = down

    @invariant()
    def bytes_are_never_wrong(self):
        assert not self.cluster.mismatches

    @precondition(lambda self: self.lossless and self.write_through)
    @invariant()
    def every_stored_chunk_is_on_disk_once_quiet(self):
        if self.index.in_flight or self.index.queued_commands():
            return
        for key in sorted(self.stored - self.corrupted):
            assert self.index.location(key)[2] is DiskState.PRESENT, f"{key.chunk_hash.hex()[:12]} not written through"

    @precondition(lambda self: self.lossless)
    @invariant()
    def nothing_stored_vanishes(self):
        if self.index.in_flight or self.index.queued_commands() or any(c.reservations for c in self.index.chunks()):
            return
        if any(c.readers for c in self.index.chunks()):
            return
        for key in sorted(self.stored - self.corrupted):
            self.cluster.settle()  # a probe's promotion may evict (and spill) the previous probe's chunk
            result = self.index.lookup("probe", [key])
            self.index.release("probe")
            assert result.hit_chunks == 1, f"stored chunk {key.chunk_hash.hex()[:12]} vanished"
        self.cluster.settle()


class LossyIndexMachine(IndexMachine):
    lossless = False


TestIndexLossless = IndexMachine.TestCase
TestIndexLossless.settings = settings(max_examples=60, stateful_step_count=40)
TestIndexLossy = LossyIndexMachine.TestCase
TestIndexLossy.settings = settings(max_examples=200, stateful_step_count=50)

for _policy in sorted(set(POLICIES) - {"lru"}):  # the same machines under every other policy
    for _base, _examples, _steps in ((IndexMachine, 60, 40), (LossyIndexMachine, 200, 50)):
        _machine = type(f"{_base.__name__}_{_policy}", (_base,), {"policy": _policy})
        _case = _machine.TestCase
        _case.settings = settings(max_examples=_examples, stateful_step_count=_steps)
        globals()[f"Test{_base.__name__.replace('Machine', '')}_{_policy}"] = _case
