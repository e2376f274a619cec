"""The transfer lanes' ordering on a device with streams (CUDA or NPU), as a real step exercises it: the model's
stream is kept busy, then writes pages, and the lanes must see exactly the bytes the model's stream order says,
while the host never waits for the device. Each scenario has a negative control: without the event (or the page
fence) the same sequence sees the wrong bytes."""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from lmcache_npu.layout.discovery import LayoutPolicy, discover_layout
from lmcache_npu.ops import ChunkBatch, Direction, TransferStats, get_backend
from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.commands import Load, Store
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.tier import TierCounters
from lmcache_npu.transfer import BlockWindow, DeviceMove, KVMover, StreamKit

BLOCK = 16
BLOCKS = 64
CHUNK = 256
LAYERS = 4


class FullAttentionSpec:  # read by class name and attributes, as layout discovery reads vLLM's specs
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size, self.dtype = BLOCK, 8, 128, torch.bfloat16
        self.sliding_window = None


class Unordered(StreamKit):
    """The negative control: the device kit without its events (no ordering against the model's stream)."""

    def __init__(self, inner: StreamKit) -> None:
        self.inner = inner

    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def record(self) -> Optional[object]:
        return None

    def wait(self, event: Optional[object]) -> None:
        return None

    def side_stream(self):
        return self.inner.side_stream()


class Delayed:
    """A backend whose transfers first hold their own (side) stream: a gather that starts late."""

    def __init__(self, inner, hold: Callable[[], None]) -> None:
        self.inner, self.hold, self.name = inner, hold, inner.name

    def prepare(self, plan) -> None:
        self.inner.prepare(plan)

    def transfer(self, batch: ChunkBatch, after_kernel=None) -> TransferStats:
        self.hold()
        return self.inner.transfer(batch, after_kernel)


class _Host:
    """Host memory has nothing to synchronise."""

    @staticmethod
    def synchronize() -> None:
        return None

    @staticmethod
    def current_stream(device: torch.device) -> type:
        return _Host


class Gate:
    """Holds a stream at a point until the test opens it, once: a CUDA stream memory operation waits on a flag in
    pinned host memory that the host itself writes, so "the other side ran first" is decided by the test, not by
    timing, and opening needs no stream (a new stream may share a hardware queue with the held one and never run).
    Opening before the hold is enqueued (the hold may sit on another thread) lets the hold pass, never strands it.
    Without stream memory operations (NPU, or a CUDA build without them) a long busy loop stands in; on the host, a
    pause."""

    def __init__(self, setup: "Setup") -> None:
        self.setup = setup
        self.flag: Optional[torch.Tensor] = None
        if setup.device.type == "cuda":
            from lmcache_npu import _cuda

            flag = torch.zeros(1, dtype=torch.int32).pin_memory()  # mapped at the same address under UVA
            probe = torch.cuda.Stream(setup.device)
            if _cuda.stream_wait_value32(probe.cuda_stream, flag.data_ptr(), 0):
                self.flag, self._cuda = flag, _cuda
            probe.synchronize()

    def hold(self) -> None:
        """Everything enqueued on the current stream after this waits until `open` (no wait once it was opened)."""
        if self.flag is None:
            self.setup.busy()
            return
        stream = torch.cuda.current_stream(self.setup.device)
        assert self._cuda.stream_wait_value32(stream.cuda_stream, self.flag.data_ptr(), 1)

    def open(self) -> None:
        if self.flag is not None:
            self.flag[0] = 1  # a plain host store; the waiting stream polls the flag


class Setup:
    def __init__(self, device: torch.device, ordered: bool = True, options: Optional[dict] = None) -> None:
        self.device = device
        self.module = {"cuda": torch.cuda, "npu": getattr(torch, "npu", None), "cpu": _Host}[device.type]
        # Earlier tests' arenas go now: a collection during a held stream would unregister them there and wait on it.
        gc.collect()
        self.module.synchronize()
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_tensors=[],
                                 kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=FullAttentionSpec())])
        self.caches = {n: torch.zeros((BLOCKS, 2, BLOCK, 8, 128), dtype=torch.bfloat16, device=device) for n in names}
        self.layout = discover_layout(config, self.caches, LayoutPolicy(chunk_tokens=CHUNK))
        kit = (lambda: StreamKit.for_device(device)) if ordered else (lambda: Unordered(StreamKit.for_device(device)))
        backend = {"cuda": "cuda", "npu": "npu", "cpu": "emu"}[device.type]
        self.mover = KVMover(self.layout, lambda: get_backend(backend, **(options or {})), kit, 0, 0, TierCounters())
        self.arena = HostArena(4, self.layout.plan.object_bytes)
        self.blocks = tuple(range(1, 1 + CHUNK // BLOCK))  # chunk 0 of one request
        # on the device already: indexing with a host list would copy it synchronously and stall the host
        self.block_index = torch.tensor(self.blocks, device=device)
        self.window = BlockWindow((0,), (self.blocks,))
        size = 8 if device.type == "cpu" else 4096
        self.busy_a = torch.randn(size, size, dtype=torch.float16, device=device)
        self.busy_b = torch.randn(size, size, dtype=torch.float16, device=device)
        self._ids = iter(range(1, 1 << 30))

    def close(self) -> None:
        """The lanes, then the arena's CUDA registration, while no stream is held (unregistering waits for them)."""
        self.mover.close()
        self.arena.close()

    def busy(self, matmuls: int = 300) -> None:
        """Tens of milliseconds of work on the current stream (the host only enqueues it); on the host, a pause."""
        if self.device.type == "cpu":
            time.sleep(0.3)
            return
        out = self.busy_a
        for _ in range(matmuls):
            out = torch.mm(out, self.busy_b)

    def fill(self, value: int) -> None:
        """The model writes chunk 0's pages (every layer, K and V) on its stream."""
        for cache in self.caches.values():
            cache.index_fill_(0, self.block_index, value)

    def run(self, direction: Direction, slot: int = 0) -> list[tuple[int, object]]:
        """One command through the mover; returns once it reported (the host waits here, not inside `run`)."""
        done = threading.Event()
        results = []

        def report(cmd_id: int, result: object) -> None:
            results.append((cmd_id, result))
            done.set()

        cmd_id = self.last_cmd_id = next(self._ids)
        key = ChunkKey("0" * 32, cmd_id.to_bytes(8, "little"))
        if direction == Direction.STORE:
            move = DeviceMove(Store(cmd_id, key, slot, "r", 0), self.window)
        else:
            move = DeviceMove(Load(cmd_id, key, slot, "r", 0), self.window, 0, CHUNK)
        self.mover.run([move], [self.arena.slot(slot)], report)
        self.pending = done
        return results

    def warm(self) -> None:
        """One store and one load before the test's own: a lane's first transfer may allocate page-locked or
        device memory, which the driver serialises with every stream (it would wait out a held model stream)."""
        for direction in (Direction.STORE, Direction.LOAD):
            self.run(direction, slot=3)
            self.pending.wait(60)
        self.module.synchronize()

    def stored_value(self, slot: int = 0) -> set[int]:
        """The distinct bf16 values the chunk object holds (one per fill)."""
        return set(self.arena.slot(slot).view(torch.bfloat16).float().unique().tolist())

    def page_value(self) -> set[int]:
        return set(torch.cat([c[list(self.blocks)].flatten() for c in self.caches.values()]).float().unique().tolist())


def store_after_the_forwards_writes(device: torch.device, ordered: bool = True,
                                    options: Optional[dict] = None) -> tuple[set, bool, bool]:
    """The model's stream is held, then writes 7s; the store is queued at once. Returns (the stored values, whether the
    host came back from `run` and from `release_pages` while the model's stream was still held)."""
    s = Setup(device, ordered, options)
    gate = Gate(s)
    stream = s.module.current_stream(device)
    s.warm()
    s.fill(1)
    s.module.synchronize()
    gate.hold()
    s.fill(7)
    s.run(Direction.STORE)
    run_returned_early = not stream.query()
    s.mover.release_pages()
    fence_returned_early = not stream.query()
    if not ordered:
        s.pending.wait(60)  # an unordered store does not wait for the gate
    gate.open()
    s.pending.wait(60)
    s.module.synchronize()
    stored = s.stored_value()
    s.close()
    return stored, run_returned_early, fence_returned_early


def _store_then_overwrite(device: torch.device, fence: Callable[["Setup"], Optional[int]], waits_for_it: bool,
                          options: Optional[dict]) -> tuple[set, Optional[int]]:
    """A store whose gather starts late; `fence(setup)` runs the page fence (its waits, or None for no fence), then
    the next step's forward overwrites the pages with 9s. Where the fence does not wait for the store
    (`waits_for_it` False), the 9s are in the pages before the gather may start. Returns (the stored values, the
    fence's result)."""
    s = Setup(device, options=options)
    gate = Gate(s)
    s.warm()
    s.mover.set_backend(Direction.STORE, Delayed(s.mover.backends[Direction.STORE], gate.hold))
    s.fill(5)
    s.run(Direction.STORE)
    fenced = fence(s)
    s.fill(9)  # the next step's forward writes blocks vLLM handed to another request
    if not waits_for_it:
        s.module.current_stream(device).synchronize()
    gate.open()
    s.pending.wait(60)
    s.module.synchronize()
    stored = s.stored_value()
    s.close()
    return stored, fenced


def fence_orders_the_next_forward(device: torch.device, fence: bool = True, options: Optional[dict] = None) -> set:
    """A store whose gather starts late; the next step's forward overwrites the pages with 9s right after the page
    fence. With the fence the store holds what the step computed (5s); without it, the 9s."""
    return _store_then_overwrite(device, lambda s: s.mover.release_pages() if fence else None, fence, options)[0]


def narrow_fence(device: torch.device, names_the_store: bool, options: Optional[dict] = None) -> tuple[set, int]:
    """The same, after a page fence that names the store (the scheduler saw the step write its pages) or only some
    other store (the step writes other pages, so no wait is added: the negative control, the store sees the 9s).
    Returns (the stored values, the waits the fence added)."""
    stored, waits = _store_then_overwrite(
        device, lambda s: s.mover.release_pages([s.last_cmd_id if names_the_store else s.last_cmd_id + 1000]),
        names_the_store, options)
    assert waits is not None
    return stored, waits


def load_after_the_models_earlier_writes(device: torch.device, ordered: bool = True,
                                        options: Optional[dict] = None) -> set:
    """The arena holds 3s; the model's stream is held, then zeroes the target blocks (as vLLM zeroes new blocks); the
    load is queued at once. The pages must end with the loaded 3s."""
    s = Setup(device, ordered, options)
    gate = Gate(s)
    s.warm()
    s.fill(3)
    s.run(Direction.STORE)
    s.pending.wait(60)
    s.module.synchronize()
    gate.hold()
    s.fill(0)
    s.run(Direction.LOAD)
    if not ordered:
        s.pending.wait(60)  # an unordered load lands before the held zeroing
    gate.open()
    s.pending.wait(60)
    s.module.synchronize()
    pages = s.page_value()
    s.close()
    return pages
