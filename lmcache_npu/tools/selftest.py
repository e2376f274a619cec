"""`lmcache-npu doctor --selftest`: on an Ascend card, in under a minute, settles what no x86 test can.

1. host memory: the arena's registration chain picks its path on this host, and aclrtPointerGetAttributes must call a
   slot page-locked host memory (a registered segment it calls anything else fails: its copies would be synchronous);
2. copy blocks: in a child process with torch_npu's task queue off, how long submitting a load takes behind queued
   device work; an asynchronous copy returns at once, a synchronous one waits for the stream (the direct measurement
   of what item 1 infers);
3. host copy: 32 MiB from arena slots into the device through the backend's own copies, against torch's copy from
   `torch.empty(pin_memory=True)` (the link's ceiling) and torch's copy from an arena slot (torch_npu's pinned guess);
4. round trip: one store from pages into arena slots and one load into fresh pages through the AscendC kernel, every
   byte against the torch oracle;
5. overlap: a model-sized matmul timed with events on the compute stream, alone and with transfers in flight on the
   lane's stream (a device-wide synchronize would wait for the lane too and report a slowdown that is not there);
6. task queue: whether torch_npu's task queue is on (transfers then enter it without draining it).

Each item is a verdict (ok, warn, fail, skip) with its numbers. Everything device-specific goes through `CardOps`,
so x86 tests run the same items on the fake device. Where no card is visible every item is a skip that says why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from ..ops.plan import GroupSpec, Plane, TransferPlan
from ..ops.torch_backend import TorchBackend
from ..platform.ascend_host import NpuHostMethod
from ..platform.ascend_memory import PAGE_LOCKED_LOCATIONS
from ..platform.npu_runtime import DeviceUnavailable, NpuRuntime

logger = logging.getLogger(__name__)

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
ITEMS = ("host memory", "copy blocks", "host copy", "round trip", "overlap", "task queue")
COPY_BYTES = 32 << 20
COPY_OK_SHARE = 0.7  # our copies reach at least this share of a pinned torch copy, or the verdict is warn
OVERLAP_OK_SLOWDOWN = 0.15  # transfers in flight slow the model's matmul by at most this, or the verdict is warn
BUSY_SECONDS = 0.2  # device work queued ahead of the load whose submit "copy blocks" times
BLOCKED_SHARE = 0.5  # a submit that waited this share of the queued work waited for the stream: a synchronous copy
REGISTRARS = (NpuHostMethod.HOST_REGISTER.value, NpuHostMethod.HAL_REGISTER.value)


@dataclass(frozen=True)
class SelftestItem:
    name: str
    verdict: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


class CardOps(Protocol):
    """The device operations the self-test needs beyond the native module (torch_npu on a card)."""

    device: torch.device

    def empty(self, nbytes: int) -> torch.Tensor:
        """uint8 device memory."""

    def torch_pinned(self, nbytes: int) -> torch.Tensor:
        """uint8 host memory from torch's own pinned allocator (the baseline every copy is compared with)."""

    def synchronize(self) -> None:
        """Waits for every stream of the device."""

    def matmul_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two model-sized matrices on the device."""

    def time_on_stream(self, call: Callable[[], Any], repeats: int) -> float:
        """Seconds per `call`, measured on the calling thread's current stream alone (events, not a device sync)."""

    def busy_stream(self, seconds: float) -> None:
        """Queues about `seconds` of device work on the current stream and returns at once."""


class TorchNpuOps:
    """CardOps on an Ascend card through torch_npu."""

    def __init__(self, runtime: NpuRuntime) -> None:
        self.device = runtime.device
        self._busy: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None  # operands, seconds per matmul

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def torch_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def matmul_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=self.device)  # one MLP projection's worth
        return a, torch.randn(4096, 4096, dtype=torch.bfloat16, device=self.device)

    def time_on_stream(self, call: Callable[[], Any], repeats: int) -> float:
        call()  # warm-up: first-use allocations and lazy module loads
        start = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
        end = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()  # this stream's work up to `end`, not the lane's
        return start.elapsed_time(end) / 1e3 / repeats

    def busy_stream(self, seconds: float) -> None:
        if self._busy is None:
            a, b = self.matmul_operands()
            self._busy = (a, b, self.time_on_stream(lambda: torch.matmul(a, b), repeats=5))
        a, b, per_matmul = self._busy
        for _ in range(max(1, int(seconds / max(per_matmul, 1e-6)))):
            torch.matmul(a, b)


@dataclass
class _Fixture:
    """A small two-group geometry on the device and an arena whose slots hold its chunk objects."""

    plan: TransferPlan
    pages: list[torch.Tensor]
    slots: list[np.ndarray]
    arena: Any


def _fixture(runtime: NpuRuntime, ops: CardOps, chunks: int, pinning: Any) -> _Fixture:
    from ..store.arena import HostArena

    rows_per_block, row_bytes, chunk_tokens = 128, 1024, 256  # 1 KiB rows: a GQA layer's K or V per token
    blocks = chunks * chunk_tokens // rows_per_block + 2
    generator = torch.Generator().manual_seed(11)
    pages, planes = [], []
    for name in ("k", "v"):
        host = torch.randint(0, 256, (blocks, rows_per_block * row_bytes), dtype=torch.uint8, generator=generator)
        device = ops.empty(host.numel()).view(blocks, -1)
        device.copy_(host)
        pages.append(device)
        planes.append(Plane(device, 0, rows_per_block, row_bytes, name=name))
    plan = TransferPlan([GroupSpec(rows_per_block)], planes, chunk_tokens)
    order = np.random.default_rng(11).permutation(blocks)[: chunks * chunk_tokens // rows_per_block]
    slots = [(order[:, None] * rows_per_block + np.arange(rows_per_block)).reshape(chunks, chunk_tokens)]
    arena = HostArena(chunks, plan.object_bytes, pinning=pinning, segment_bytes=64 << 20, hugepages="off")
    return _Fixture(plan, pages, slots, arena)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def check_host_memory(fixture: _Fixture, runtime: NpuRuntime) -> SelftestItem:
    """OK when ACL calls a slot page-locked host memory; FAIL when a registrar's segment (or an unregistered arena) is
    anything else, since every staging copy from it would be synchronous; WARN where ACL cannot say."""
    arena = fixture.arena
    if not arena.wait_ready(30):
        return SelftestItem("host memory", FAIL, "the arena's segments did not settle within 30 s")
    pinning = arena.memory.pinning
    location = str(runtime.native.pointer_attributes(arena.slot_address(0))["location"])
    chosen = pinning.chosen.name if pinning is not None and pinning.chosen is not None else "pageable"
    api = getattr(pinning.chosen, "api", None) if pinning is not None else None
    numbers = {"path": chosen, "api": api or chosen, "pointer_location": location,
               "describe": pinning.describe() if pinning else ""}
    head = f"segments made DMA-able with {api or chosen}; aclrtPointerGetAttributes says {location}"
    if location in PAGE_LOCKED_LOCATIONS:
        return SelftestItem("host memory", OK, head + ": page-locked, copies from slots are asynchronous", numbers)
    if location == "unknown":
        return SelftestItem("host memory", WARN, head + " (this toolkit cannot tell): 'copy blocks' measures it",
                            numbers)
    if chosen in REGISTRARS or chosen == "pageable":
        return SelftestItem("host memory", FAIL, head + ": ACL does not see the registered segments as page-locked, "
                            "so every staging copy runs synchronously on torch_npu's queue thread; set "
                            "npu_host_memory to aclrtMallocHost and report this card's answer", numbers)
    return SelftestItem("host memory", WARN, head + f": memory {chosen} allocated should be page-locked; 'copy "
                        "blocks' measures whether its copies wait", numbers)


def _time(ops: CardOps, call: Callable[[], Any], repeats: int = 3) -> float:
    call()  # warm-up: first-use allocations and lazy module loads
    ops.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    ops.synchronize()
    return (time.perf_counter() - began) / repeats


def check_host_copy(fixture: _Fixture, backend: Any, ops: CardOps) -> SelftestItem:
    plan, arena = fixture.plan, fixture.arena
    objects = [arena.slot(s) for s in range(arena.num_slots)]
    nbytes = plan.object_bytes * len(objects)
    ours = _time(ops, lambda: backend.load(plan, fixture.slots, objects))
    pinned = ops.torch_pinned(nbytes)
    target = ops.empty(nbytes)
    baseline = _time(ops, lambda: target.copy_(pinned, non_blocking=True))
    slot = arena.slot(0)
    guess = _time(ops, lambda: target[: slot.numel()].copy_(slot, non_blocking=True))
    numbers = {"bytes": nbytes, "backend_load_gb_s": _gbps(nbytes, ours), "torch_pinned_gb_s": _gbps(nbytes, baseline),
               "torch_from_slot_gb_s": _gbps(slot.numel(), guess)}
    share = numbers["backend_load_gb_s"] / numbers["torch_pinned_gb_s"]
    detail = (f"{nbytes >> 20} MiB from arena slots through the backend (copy + kernel) at "
              f"{numbers['backend_load_gb_s']:.1f} GB/s, {share:.0%} of torch's pinned copy "
              f"({numbers['torch_pinned_gb_s']:.1f} GB/s); torch's own copy from a slot "
              f"{numbers['torch_from_slot_gb_s']:.1f} GB/s")
    return SelftestItem("host copy", OK if share >= COPY_OK_SHARE else WARN, detail, numbers)


def _rows(fixture: _Fixture) -> list[torch.Tensor]:
    """Every live row of the fixture's slots, per plane, on the host (what a round trip must reproduce)."""
    from ..ops.torch_backend import row_view

    matrix = torch.from_numpy(fixture.slots[0].reshape(-1))
    out = []
    for plane in fixture.plan.moved_planes:
        index = matrix.to(plane.pages.device)
        out.append(row_view(plane)[index // plane.rows_per_block, index % plane.rows_per_block].cpu().clone())
    return out


def check_round_trip(fixture: _Fixture, backend: Any) -> SelftestItem:
    plan, arena = fixture.plan, fixture.arena
    objects = [arena.slot(s) for s in range(arena.num_slots)]
    want = _rows(fixture)
    backend.store(plan, fixture.slots, objects)
    oracle = [torch.zeros(plan.object_bytes, dtype=torch.uint8, device=plan.device) for _ in objects]
    TorchBackend().store(plan, fixture.slots, oracle)
    for i, (got, ref) in enumerate(zip(objects, oracle)):
        if not torch.equal(got, ref.cpu()):
            offset = int(torch.nonzero(got != ref.cpu())[0])
            return SelftestItem("round trip", FAIL, f"store: chunk {i} differs from the torch oracle at byte {offset}")
    for page in fixture.pages:
        page.fill_(0)
    backend.load(plan, fixture.slots, objects)
    for plane, expected, got in zip(plan.moved_planes, want, _rows(fixture)):
        if not torch.equal(got, expected):
            return SelftestItem("round trip", FAIL, f"load: plane {plane.label} differs from the pages stored")
    return SelftestItem("round trip", OK, f"{len(objects)} chunks ({plan.object_bytes * len(objects) >> 20} MiB) "
                        "stored and loaded through the AscendC kernel, every byte as the torch oracle's",
                        {"chunks": len(objects), "object_bytes": plan.object_bytes})


def check_overlap(fixture: _Fixture, backend: Any, ops: CardOps, kit: Any, seconds: float = 2.0) -> SelftestItem:
    a, b = ops.matmul_operands()
    alone = ops.time_on_stream(lambda: torch.matmul(a, b), repeats=10)
    stop = threading.Event()
    moved = [0]
    lane_seconds = [0.0]

    def transfers() -> None:
        kit.bind_thread()
        with kit.side_stream():
            objects = [fixture.arena.slot(s) for s in range(fixture.arena.num_slots)]
            began = time.perf_counter()
            while not stop.is_set():
                backend.load(fixture.plan, fixture.slots, objects)
                moved[0] += 1
            lane_seconds[0] = time.perf_counter() - began

    lane = threading.Thread(target=transfers, name="lmcache-npu-selftest-lane", daemon=True)
    lane.start()
    time.sleep(min(0.2, seconds / 4))
    busy = ops.time_on_stream(lambda: torch.matmul(a, b), repeats=10)  # the compute stream's time only
    stop.set()
    lane.join()
    slowdown = busy / alone - 1
    lane_bytes = moved[0] * fixture.plan.object_bytes * fixture.arena.num_slots
    numbers = {"matmul_ms_alone": alone * 1e3, "matmul_ms_with_transfers": busy * 1e3, "slowdown": slowdown,
               "transfers": moved[0], "lane_gb_s": _gbps(lane_bytes, lane_seconds[0])}
    detail = (f"a 4096x4096 matmul {alone * 1e3:.2f} ms alone, {busy * 1e3:.2f} ms with loads in flight on the lane's "
              f"stream ({slowdown:+.0%}, timed with events on the compute stream); the lane moved {moved[0]} loads at "
              f"{numbers['lane_gb_s']:.1f} GB/s with {backend.cores} vector cores per transfer")
    return SelftestItem("overlap", OK if slowdown <= OVERLAP_OK_SLOWDOWN else WARN, detail, numbers)


def check_copy_blocking(fixture: _Fixture, backend: Any, ops: CardOps,
                        busy_seconds: float = BUSY_SECONDS) -> SelftestItem:
    """With torch_npu's task queue off a submit runs its ACL calls on this thread: behind `busy_seconds` of queued
    device work an asynchronous aclrtMemcpyAsync returns at once, a synchronous one waits for the stream."""
    if backend.task_queue:
        return SelftestItem("copy blocks", WARN, "torch_npu's task queue stayed on (TASK_QUEUE_ENABLE=0 was not "
                            "honoured): a submit returns before any copy runs, so it cannot be timed")
    objects = [fixture.arena.slot(s) for s in range(fixture.arena.num_slots)]
    backend.load(fixture.plan, fixture.slots, objects)  # warm-up
    ops.busy_stream(busy_seconds)
    backend.load(fixture.plan, fixture.slots, objects)
    submit = backend.last_submit_seconds
    numbers = {"busy_ms": busy_seconds * 1e3, "submit_ms": submit * 1e3}
    if submit >= BLOCKED_SHARE * busy_seconds:
        return SelftestItem("copy blocks", FAIL, f"submitting a load waited {submit * 1e3:.0f} ms behind "
                            f"{busy_seconds * 1e3:.0f} ms of queued device work: aclrtMemcpyAsync from arena slots "
                            "is synchronous (ACL does not see them as page-locked); with the task queue on, that wait "
                            "stalls every model launch behind it", numbers)
    return SelftestItem("copy blocks", OK, f"submitting a load took {submit * 1e3:.2f} ms behind "
                        f"{busy_seconds * 1e3:.0f} ms of queued device work: the copies are asynchronous", numbers)


def copy_blocking_item(runtime: NpuRuntime, ops: CardOps, pinning: Any) -> SelftestItem:
    """'copy blocks' on its own fixture and backend (what the child process runs)."""
    from ..ops.npu_backend import NpuBackend

    runtime.bind_thread()
    fixture = _fixture(runtime, ops, COPY_BYTES // (2 * 256 * 1024), pinning)
    backend = NpuBackend.on_runtime(runtime)
    try:
        backend.prepare(fixture.plan)
        return check_copy_blocking(fixture, backend, ops)
    finally:
        fixture.arena.close()
        backend.close()


def copy_blocking_in_child(npu_host_memory: str = "auto", timeout_s: float = 300) -> SelftestItem:
    """'copy blocks' in a child process with TASK_QUEUE_ENABLE=0 (the queue is chosen when torch_npu starts)."""
    command = [sys.executable, "-m", "lmcache_npu.tools.selftest", "--copy-blocks", "--npu-host-memory",
               npu_host_memory]
    try:
        result = subprocess.run(command, env={**os.environ, "TASK_QUEUE_ENABLE": "0"}, capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SelftestItem("copy blocks", FAIL, f"the child process did not finish within {timeout_s:.0f} s")
    lines = result.stdout.strip().splitlines()
    try:
        return SelftestItem(**json.loads(lines[-1]))
    except (IndexError, TypeError, ValueError):
        tail = (result.stderr or result.stdout).strip()[-600:]
        return SelftestItem("copy blocks", FAIL, f"the child process exited {result.returncode} without a verdict: "
                            f"{tail}")


def check_task_queue(runtime: NpuRuntime) -> SelftestItem:
    on = runtime.platform().task_queue
    return SelftestItem("task queue", OK, "torch_npu's task queue is " + (
        "on: transfers are enqueued in it behind the lane's stream, never draining it" if on else
        "off (TASK_QUEUE_ENABLE=0): transfers launch from the lane's thread directly"), {"enabled": on})


def run_selftest(runtime: Optional[NpuRuntime] = None, ops: Optional[CardOps] = None, kit: Any = None,
                 npu_host_memory: str = "auto", pinning: Any = None,
                 copy_blocking: Optional[Callable[[], SelftestItem]] = None) -> list[SelftestItem]:
    """Every item on this machine's card (or on `runtime`/`ops`, which tests pass for the fake device, with
    `copy_blocking` run in-process); skips that say why where there is no card."""
    if runtime is None:
        try:
            runtime = NpuRuntime.load()
        except DeviceUnavailable as exc:
            return [SelftestItem(name, SKIP, f"no Ascend card to test: {exc}") for name in ITEMS]
    ops = ops if ops is not None else TorchNpuOps(runtime)
    if kit is None:
        from ..transfer.streams import StreamKit

        kit = StreamKit.for_device(runtime.device)
    from ..ops.npu_backend import NpuBackend
    from ..platform.ascend_memory import npu_segment_pinning

    runtime.bind_thread()
    items: list[SelftestItem] = []
    try:
        fixture = _fixture(runtime, ops, COPY_BYTES // (2 * 256 * 1024),
                           pinning if pinning is not None else npu_segment_pinning(runtime, npu_host_memory))
    except MemoryError as exc:
        return [SelftestItem("host memory", FAIL, str(exc))] + [
            SelftestItem(name, SKIP, "needs the host arena") for name in ITEMS[1:5]] + [check_task_queue(runtime)]
    backend = NpuBackend.on_runtime(runtime)
    backend.prepare(fixture.plan)
    blocking = copy_blocking or (lambda: copy_blocking_in_child(npu_host_memory))
    for check in (lambda: check_host_memory(fixture, runtime), blocking,
                  lambda: check_host_copy(fixture, backend, ops),
                  lambda: check_round_trip(fixture, backend), lambda: check_overlap(fixture, backend, ops, kit),
                  lambda: check_task_queue(runtime)):
        try:
            items.append(check())
        except Exception as exc:  # one item's failure is its verdict; the rest still run
            logger.exception("self-test item failed")
            items.append(SelftestItem(ITEMS[len(items)], FAIL, f"{type(exc).__name__}: {exc}"))
    fixture.arena.close()
    backend.close()
    return items


def to_json(items: list[SelftestItem]) -> str:
    return json.dumps({"failed": any(i.verdict == FAIL for i in items), "items": [asdict(i) for i in items]},
                      indent=2)


def main(argv: Optional[list[str]] = None) -> int:
    """The child process of 'copy blocks': its verdict as one JSON line on stdout."""
    parser = argparse.ArgumentParser(description="lmcache-npu self-test, one item in this process")
    parser.add_argument("--copy-blocks", action="store_true", required=True)
    parser.add_argument("--npu-host-memory", default="auto")
    args = parser.parse_args(argv)
    try:
        runtime = NpuRuntime.load()
    except DeviceUnavailable as exc:
        item = SelftestItem("copy blocks", SKIP, f"no Ascend card to test: {exc}")
    else:
        from ..platform.ascend_memory import npu_segment_pinning

        runtime.bind_thread()
        item = copy_blocking_item(runtime, TorchNpuOps(runtime), npu_segment_pinning(runtime, args.npu_host_memory))
    sys.stdout.write(json.dumps(asdict(item)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
