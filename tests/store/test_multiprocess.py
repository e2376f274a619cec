"""One scheduler-side index, one worker process per rank: commands travel pickled (as they will in the
connector metadata), completions come back, every load is checked byte for byte in the worker that made it.
A second run over the same disk directory finds what the first spilled, and with write-through what its arenas
held too."""

import multiprocessing as mp

import pytest

from lmcache_npu.store.config import StoreConfig
from lmcache_npu.store.factory import build_index
from lmcache_npu.store.index.contract import DiskState

from .fakes import make_key, serve_rank

OBJECT_BYTES = 20_000
FINGERPRINT = b"M" * 16
NAMESPACE = "ab" * 16
RANKS = 2


class Workers:
    def __init__(self, config: dict) -> None:
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(RANKS)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=serve_rank, daemon=True, args=(r, config, OBJECT_BYTES, FINGERPRINT, NAMESPACE,
                                                                        self.inboxes[r], self.outbox))
                      for r in range(RANKS)]
        for proc in self.procs:
            proc.start()
        self.mismatches: set = set()
        self.loaded = [0] * RANKS

    def step(self, index) -> None:
        commands = index.take_commands()
        for inbox in self.inboxes:
            inbox.put(commands)
        for _ in range(RANKS):
            completions, mismatches, loaded = self.outbox.get(timeout=120)
            self.mismatches.update(mismatches)
            index.on_completions(completions)
            if completions:
                self.loaded[completions[0].rank] = loaded
        index.check_invariants()

    def settle(self, index) -> None:
        for _ in range(10):
            self.step(index)
            if index.in_flight == 0:
                return
        raise AssertionError("commands still in flight")

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(60)
            assert proc.exitcode == 0


@pytest.mark.parametrize("write_through", [True, False])
def test_index_drives_worker_processes_and_a_restart_keeps_the_disk_cache(tmp_path, write_through):
    config = {"cpu_bytes": 4 * 20480, "pinned": False, "disk_path": str(tmp_path / "kv"), "disk_bytes": "1MiB",
              "disk_write_through": write_through}
    index = build_index(StoreConfig.from_dict(config), OBJECT_BYTES, RANKS, NAMESPACE, FINGERPRINT)
    assert index.num_slots == 4
    keys = [make_key(i, NAMESPACE) for i in range(12)]
    workers = Workers(config)
    try:
        for start in range(0, 12, 3):  # 12 chunks through 4 slots: 8 are evicted on the way
            index.prepare_store("writer", list(enumerate(keys[start:start + 3], start)))
            workers.settle(index)
        # with write-through every chunk is on disk, evicted or not; without, the 8 spilled ones
        assert sum(index.location(k)[2] is DiskState.PRESENT for k in keys) == (12 if write_through else 8)
        for start in (0, 4, 8):  # read everything back through promotions, four chunks at a time
            result = index.lookup("reader", keys[start:start + 4])
            assert result.hit_chunks == 4
            workers.settle(index)
            assert index.lookup("reader", keys[start:start + 4]).ready_chunks == 4
            index.prepare_load("reader", list(enumerate(keys[start:start + 4], start)))
            workers.settle(index)
            index.release("reader")
        assert workers.loaded == [12, 12] and not workers.mismatches
    finally:
        workers.stop()

    restarted = build_index(StoreConfig.from_dict(config), OBJECT_BYTES, RANKS, NAMESPACE, FINGERPRINT)
    on_disk = [k for k in keys if restarted.location(k)[2] is DiskState.PRESENT]
    if write_through:
        assert len(on_disk) == 12  # the four never evicted too
    else:
        assert len(on_disk) >= 8  # every chunk spilled before the stop (the last four stayed in the old arenas)
    other_model = build_index(StoreConfig.from_dict(config), OBJECT_BYTES, RANKS, "cd" * 16, FINGERPRINT)
    assert all(other_model.location(k)[2] is DiskState.NONE for k in keys)
    workers = Workers(config)
    try:
        assert restarted.lookup("again", on_disk[:4]).hit_chunks == 4
        workers.settle(restarted)
        restarted.prepare_load("again", list(enumerate(on_disk[:4])))
        workers.settle(restarted)
        assert workers.loaded == [4, 4] and not workers.mismatches
    finally:
        workers.stop()
