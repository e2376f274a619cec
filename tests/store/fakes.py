"""Test doubles for the store: a device that writes and checks per-chunk patterns, an in-memory remote store, and
a cluster of one index and several executors (one per simulated rank) stepping like vLLM's scheduler loop."""

from __future__ import annotations

import hashlib
import threading
from typing import Optional, Sequence, Union

import numpy as np
import torch

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Command, Completion, Load, Store
from lmcache_npu.store.routes.build import make_executor
from lmcache_npu.store.routes.context import Report
from lmcache_npu.store.factory import remote_exists_for
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import OK, Failure, TierCounters, TierResult


def chunk_payload(key: ChunkKey, rank: int, nbytes: int) -> np.ndarray:
    """The bytes rank `rank` holds for chunk `key`: distinct per key and rank, the same in every process."""
    seed = int.from_bytes(hashlib.blake2b(key.chunk_hash + key.namespace.encode() + bytes([rank]),
                                          digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def make_key(i: int, namespace: str = "0" * 32) -> ChunkKey:
    return ChunkKey(namespace, hashlib.sha256(i.to_bytes(8, "little")).digest())


class PatternDevice:
    """The device side of one rank: a store writes the chunk's pattern into the arena object, a load checks it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loaded: list[ChunkKey] = []
        self.mismatches: list[ChunkKey] = []

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        for command, obj in zip(commands, objects):
            expected = torch.from_numpy(chunk_payload(command.key, self.rank, obj.numel()))
            if isinstance(command, Store):
                obj.copy_(expected)
                report(command.cmd_id, OK)
            elif torch.equal(obj, expected):
                self.loaded.append(command.key)
                report(command.cmd_id, OK)
            else:
                self.mismatches.append(command.key)
                report(command.cmd_id, TierResult.fail(Failure.DEVICE, "mismatch"))


class MemoryRemote:
    """The remote tier's API over a dict shared by every client ("instance"); `down` makes it unreachable."""

    def __init__(self, objects: Optional[dict[str, bytes]] = None) -> None:
        self.objects = {} if objects is None else objects
        self.down = False
        self.counters = TierCounters()
        self._lock = threading.Lock()

    def register(self, address: int, size: int) -> bool:
        return True

    def put(self, names: Sequence[str], buffers: Sequence[memoryview], verify=None) -> list[TierResult]:
        if self.down:
            return [TierResult.fail(Failure.UNAVAILABLE)] * len(names)
        with self._lock:
            for name, buffer in zip(names, buffers):
                self.objects[name] = bytes(buffer)
        return [OK] * len(names)

    def get_into(self, names: Sequence[str], buffers: Sequence[memoryview], verify=None) -> list[TierResult]:
        """Like the Mooncake tier: `verify[i]` checks the bytes before they reach the buffer (a miss if not)."""
        results = []
        for i, (name, buffer) in enumerate(zip(names, buffers)):
            data = None if self.down else self.objects.get(name)
            why = None if data is None or verify is None or len(data) != buffer.nbytes else verify[i](memoryview(data))
            if data is None:
                results.append(TierResult.fail(Failure.UNAVAILABLE if self.down else Failure.MISS))
            elif len(data) != buffer.nbytes:
                results.append(TierResult.fail(Failure.CORRUPT, "length"))
            elif why is not None:
                self.counters.add("rejected")
                results.append(TierResult.fail(Failure.REJECTED, why))
            else:
                buffer[:] = data
                results.append(OK)
        return results

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [not self.down and name in self.objects for name in names]

    def delete(self, names: Sequence[str]) -> None:
        with self._lock:
            for name in names:
                self.objects.pop(name, None)


class Cluster:
    """One index and `num_ranks` executors in this process; `step()` is one scheduler step (commands out,
    completions back)."""

    def __init__(self, num_slots: int, object_bytes: int, num_ranks: int = 2, disks: Optional[list] = None,
                 disk_chunks: int = 0, remote: Optional[MemoryRemote] = None, disk_write_through: bool = False) -> None:
        self.remote = remote
        self.devices = [PatternDevice(rank) for rank in range(num_ranks)]
        self.executors = [
            make_executor(rank, HostArena(num_slots, object_bytes, pinned=False), self.devices[rank],
                          disk=None if disks is None else disks[rank], remote=remote, io_threads=2)
            for rank in range(num_ranks)
        ]
        self.remote_exists = None if remote is None else remote_exists_for(remote, num_ranks)
        self.index = ChunkIndex(num_slots, num_ranks, disk_chunks=disk_chunks, remote_exists=self.remote_exists,
                                disk_write_through=disk_write_through)
        self.issued: list[Command] = []
        self.stored: set[ChunkKey] = set()  # chunks whose store completed on every rank

    def step(self, timeout: float = 30.0) -> list[Completion]:
        commands = self.index.take_commands()
        self.issued.extend(commands)
        for executor in self.executors:
            executor.submit(commands)
        done = [c for executor in self.executors for c in executor.drain(timeout)]
        self.index.on_completions(done)
        self.index.check_invariants()
        issued = {c.cmd_id: c for c in commands}
        oks: dict[int, list[bool]] = {}
        for completion in done:
            oks.setdefault(completion.cmd_id, []).append(completion.ok)
        for cmd_id, answers in oks.items():
            command = issued.get(cmd_id)
            if isinstance(command, Store) and len(answers) == len(self.executors) and all(answers):
                self.stored.add(command.key)
        return done

    def settle(self, max_steps: int = 10) -> None:
        """Steps until no command is in flight (a completion may issue follow-ups such as puts)."""
        for _ in range(max_steps):
            self.step()
            if self.index.in_flight == 0 and not self.index.queued_commands():
                return
        raise AssertionError(f"{self.index.in_flight} commands still in flight after {max_steps} steps")

    def store(self, request_id: str, keys: Sequence[ChunkKey], first_chunk: int = 0) -> list[Store]:
        stores = self.index.prepare_store(request_id, list(enumerate(keys, first_chunk)))
        self.settle()
        return stores

    def load(self, request_id: str, keys: Sequence[ChunkKey]) -> int:
        """Looks up, waits for promotions, loads the ready prefix; returns the chunks loaded (bytes checked)."""
        for _ in range(10):
            result = self.index.lookup(request_id, keys)
            if not result.pending:
                break
            self.settle()
        loads = self.index.prepare_load(request_id, list(enumerate(keys[:result.ready_chunks])))
        self.settle()
        self.index.release(request_id)
        return len(loads)

    @property
    def mismatches(self) -> list[ChunkKey]:
        return [k for d in self.devices for k in d.mismatches]

    def close(self) -> None:
        for executor in self.executors:
            executor.close()


def serve_rank(rank: int, config: dict, object_bytes: int, layout_fingerprint: bytes, namespace: str, inbox,
               outbox) -> None:
    """A worker process: builds its arena and tiers from the config, runs each command list it receives and
    answers with (completions, mismatched keys); None stops it."""
    from lmcache_npu.store.config import StoreConfig
    from lmcache_npu.transfer.pipeline import build_executor

    device = PatternDevice(rank)
    executor = build_executor(StoreConfig.from_dict(config), rank, object_bytes, layout_fingerprint, device, namespace)
    try:
        while (commands := inbox.get()) is not None:
            executor.submit(commands)
            outbox.put((executor.drain(60), list(device.mismatches), len(device.loaded)))
    finally:
        executor.close()
