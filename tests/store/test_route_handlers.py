"""Each route handler on its own, over a `RouteContext` and one `EnvelopeGuard` (no executor): the bytes it moves
arrive unchanged, and one wrong byte is noticed (the negative controls)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Drop, Load, Persist, Promote, Put, Spill, Store, Tier
from lmcache_npu.store.disk import HEADER_BYTES, DiskTier
from lmcache_npu.store.envelope import Sealer
from lmcache_npu.store.routes.context import RouteContext
from lmcache_npu.store.routes.device import DeviceRoute
from lmcache_npu.store.routes.disk import DiskRoute
from lmcache_npu.store.routes.drop import DropRoute
from lmcache_npu.store.routes.guard import EnvelopeGuard
from lmcache_npu.store.routes.remote import RemoteRoute
from lmcache_npu.store.tier import OK

from .fakes import MemoryRemote, make_key

OBJECT_BYTES = 4096
FINGERPRINT = b"H" * 16


def _context() -> RouteContext:
    return RouteContext(0, HostArena(4, OBJECT_BYTES, pinned=False), io_threads=1)


def _answers(context: RouteContext, count: int) -> dict[int, tuple[bool, str]]:
    """The next `count` answers by command id (waits up to 30 s for them)."""
    context.outstanding += count
    assert context.wait(lambda: len(context.done) >= count, 30)
    return {c.cmd_id: (c.ok, c.reason) for c in context.poll()}


def _fill(arena: HostArena, slot: int, seed: int) -> np.ndarray:
    pattern = np.random.default_rng(seed).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    arena.slot_array(slot)[:] = pattern
    return pattern


def _flip(path: str, offset: int) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[offset] ^= 0x01
    Path(path).write_bytes(bytes(raw))


class CopyMover:
    """A device of one buffer per chunk index: stores copy it into the arena object, loads copy the object back;
    `wrong_byte` makes every store write one wrong byte (the negative control)."""

    def __init__(self, wrong_byte: bool = False) -> None:
        self.device = {i: np.random.default_rng(100 + i).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
                       for i in range(4)}
        self.wrong_byte = wrong_byte

    def run(self, commands, objects, report) -> None:
        for command, target in zip(commands, objects):
            if isinstance(command, Store):
                target.numpy()[:] = self.device[command.chunk_index]
                if self.wrong_byte:
                    target.numpy()[7] ^= 0x01
            else:
                self.device[command.chunk_index] = target.numpy().copy()
            report(command.cmd_id, OK)


@pytest.mark.parametrize("wrong_byte", [False, True])
def test_the_device_route_stores_and_loads_the_chunks_bytes(wrong_byte):
    context = _context()
    mover = CopyMover(wrong_byte)
    route = DeviceRoute(context, mover)
    stored = mover.device[0].copy()
    route.submit([Store(1, make_key(1), 2, "r", 0)])
    assert _answers(context, 1) == {1: (True, "")}
    # the control: a mover that writes one wrong byte is seen by the same comparison
    assert np.array_equal(context.arena.slot_array(2), stored) is not wrong_byte
    route.submit([Load(2, make_key(1), 2, "r", 3)])
    assert _answers(context, 1) == {2: (True, "")}
    assert np.array_equal(mover.device[3], context.arena.slot_array(2))
    context.shutdown()


def test_the_device_route_without_a_mover_answers_why():
    context = _context()
    DeviceRoute(context, None).submit([Store(1, make_key(1), 0, "r", 0)])
    assert _answers(context, 1) == {1: (False, "no device mover")}
    context.shutdown()


@pytest.mark.parametrize("command", [Spill, Persist])
def test_the_disk_route_writes_the_sealed_slot_and_promotes_it_back(tmp_path, command):
    context = _context()
    disk = DiskTier(tmp_path / "kv", FINGERPRINT, writer_threads=1)
    route = DiskRoute(context, EnvelopeGuard(context), disk)
    key = make_key(1)
    pattern = _fill(context.arena, 0, 1)
    route.submit([command(1, key, 0)])
    assert _answers(context, 1) == {1: (True, "")} and disk.flush(10)
    path = disk.file_path(key.storage_name(0))
    assert Path(path).read_bytes()[HEADER_BYTES:] == bytes(context.arena.sealed_view(0))  # the sealed slot, as is
    route.submit([Promote(2, key, 1, Tier.DISK)])
    assert _answers(context, 1) == {2: (True, "")}
    assert np.array_equal(context.arena.slot_array(1), pattern)
    assert not route.pinning  # the persist answered: it pins nothing any more
    route.close()
    context.shutdown()


@pytest.mark.parametrize("offset", [HEADER_BYTES + 5, -3])  # a payload byte, a trailer byte
def test_the_disk_route_rejects_a_file_with_one_wrong_byte(tmp_path, offset):
    context = _context()
    disk = DiskTier(tmp_path / "kv", FINGERPRINT, writer_threads=1)
    route = DiskRoute(context, EnvelopeGuard(context, Sealer(b"k" * 32)), disk)
    key = make_key(1)
    _fill(context.arena, 0, 1)
    route.submit([Spill(1, key, 0)])
    assert _answers(context, 1) == {1: (True, "")} and disk.flush(10)
    _flip(disk.file_path(key.storage_name(0)), offset)
    route.submit([Promote(2, key, 1, Tier.DISK)])
    ok, reason = _answers(context, 1)[2]
    assert not ok and reason.startswith(("rejected", "corrupt"))
    route.close()
    context.shutdown()


def test_the_disk_route_without_a_tier_answers_why():
    context = _context()
    route = DiskRoute(context, EnvelopeGuard(context), None)
    route.submit([Spill(1, make_key(1), 0)])
    route.submit([Persist(2, make_key(2), 1)])
    route.submit([Promote(3, make_key(3), 2, Tier.DISK)])
    assert _answers(context, 3) == {i: (False, "no disk tier") for i in (1, 2, 3)}
    context.shutdown()


def test_the_remote_route_puts_the_sealed_slot_and_gets_it_back():
    context = _context()
    remote = MemoryRemote()
    route = RemoteRoute(context, EnvelopeGuard(context), remote)
    keys = [make_key(1), make_key(2)]
    patterns = [_fill(context.arena, 0, 1), _fill(context.arena, 1, 2)]
    route.submit([Put(1, keys[0], 0), Put(2, keys[1], 1)])
    assert _answers(context, 2) == {1: (True, ""), 2: (True, "")}
    assert remote.objects[keys[0].storage_name(0)] == bytes(context.arena.sealed_view(0))
    route.submit([Promote(3, keys[1], 2, Tier.REMOTE), Promote(4, keys[0], 3, Tier.REMOTE)])
    assert _answers(context, 2) == {3: (True, ""), 4: (True, "")}
    assert np.array_equal(context.arena.slot_array(2), patterns[1])
    assert np.array_equal(context.arena.slot_array(3), patterns[0])
    context.shutdown()


def test_the_remote_route_rejects_an_object_with_one_wrong_byte():
    context = _context()
    remote = MemoryRemote()
    route = RemoteRoute(context, EnvelopeGuard(context, Sealer(b"k" * 32)), remote)
    keys = [make_key(1), make_key(2)]
    _fill(context.arena, 0, 1)
    _fill(context.arena, 1, 2)
    route.submit([Put(1, keys[0], 0), Put(2, keys[1], 1)])
    _answers(context, 2)
    name = keys[0].storage_name(0)
    raw = bytearray(remote.objects[name])
    raw[11] ^= 0x01
    remote.objects[name] = bytes(raw)
    context.arena.slot_array(2)[:] = 0x5A  # a rejected chunk leaves no byte of its own
    route.submit([Promote(3, keys[0], 2, Tier.REMOTE), Promote(4, keys[1], 3, Tier.REMOTE)])
    answers = _answers(context, 2)
    assert answers[4] == (True, "")  # the control: the untouched object of the same batch loads
    assert not answers[3][0] and answers[3][1].startswith("rejected")
    assert (context.arena.slot_array(2) == 0x5A).all()
    context.shutdown()


def test_the_drop_route_deletes_only_the_named_tiers_copy(tmp_path):
    context = _context()
    guard = EnvelopeGuard(context)
    disk, remote = DiskTier(tmp_path / "kv", FINGERPRINT, writer_threads=1), MemoryRemote()
    disk_route, remote_route = DiskRoute(context, guard, disk), RemoteRoute(context, guard, remote)
    drop = DropRoute(context, {Tier.DISK: disk_route, Tier.REMOTE: remote_route})
    key = make_key(1)
    name = key.storage_name(0)
    _fill(context.arena, 0, 1)
    disk_route.submit([Spill(1, key, 0)])
    remote_route.submit([Put(2, key, 0)])
    _answers(context, 2)
    assert disk.flush(10) and disk.exists(name) and name in remote.objects
    drop.submit([Drop(3, key, Tier.DISK)])
    assert _answers(context, 1) == {3: (True, "")}
    assert not disk.exists(name) and name in remote.objects  # the control: the other tier's copy stays
    drop.submit([Drop(4, key, Tier.REMOTE)])
    assert _answers(context, 1) == {4: (True, "")}
    assert name not in remote.objects
    disk_route.close()
    context.shutdown()


def test_the_guard_seals_once_per_content_and_notices_a_wrong_byte():
    context = _context()
    guard = EnvelopeGuard(context, Sealer(b"k" * 32))
    key = make_key(1)
    _fill(context.arena, 0, 1)
    guard.seal(0, key)
    assert guard.verify(context.arena.sealed_view(0), key) is None
    assert guard.verify(context.arena.sealed_view(0), make_key(2)) is not None  # another key's: not these bytes
    context.arena.slot_array(0)[9] ^= 0x01
    assert guard.verify(context.arena.sealed_view(0), key) is not None  # one wrong byte
    guard.seal(0, key)  # remembered: the trailer is not rewritten, so the changed bytes still do not verify
    assert guard.verify(context.arena.sealed_view(0), key) is not None
    guard.forget_written([Store(1, key, 0, "r", 0)])  # new bytes came: the next seal writes a new trailer
    guard.seal(0, key)
    assert guard.verify(context.arena.sealed_view(0), key) is None
    guard.unseal(0)
    assert guard.verify(context.arena.sealed_view(0), key) is not None
    context.shutdown()
