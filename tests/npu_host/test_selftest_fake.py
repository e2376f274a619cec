"""`doctor --selftest` on the fake device: every item runs through the same code a card runs, and the round trip's
comparison sees one wrong byte. Without a card every item is a skip that says why."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_npu.tools import selftest
from lmcache_npu.platform.host_memory import SegmentPinning
from lmcache_npu.platform.ascend_memory import AclMallocHost
from lmcache_npu.ops.npu_backend import NpuBackend
from lmcache_npu.transfer.streams import StreamKit

from .fake_npu import FakeNpu


class FakeOps:
    """CardOps on the fake device: its device memory, its page-locked memory standing in for torch's pinned."""

    def __init__(self, fake: FakeNpu) -> None:
        self.fake = fake
        self.device = torch.device("cpu")

    def empty(self, nbytes: int) -> torch.Tensor:
        return self.fake.device_tensor(nbytes)

    def torch_pinned(self, nbytes: int) -> torch.Tensor:
        return self.fake.pinned_tensor(nbytes)

    def synchronize(self) -> None:
        self.fake.drain()

    def matmul_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(64, 64), torch.randn(64, 64)

    def time_on_stream(self, call, repeats: int) -> float:  # type: ignore[no-untyped-def]
        began = time.perf_counter()  # the "matmul" runs on the host here: its own time is the stream's
        for _ in range(repeats):
            call()
        return (time.perf_counter() - began) / repeats

    def busy_stream(self, seconds: float) -> None:
        self.fake.stream_busy(seconds)


def copy_blocking_with_the_queue_off(fake: FakeNpu, pinning: SegmentPinning):  # type: ignore[no-untyped-def]
    """What the child process runs (TASK_QUEUE_ENABLE=0), in this process on the fake device."""
    def run() -> selftest.SelftestItem:
        fake.queue(enabled=False)
        try:
            return selftest.copy_blocking_item(fake.runtime(), FakeOps(fake), pinning)
        finally:
            fake.queue(enabled=True)
    return run


def test_every_item_runs_on_the_fake_device(fake_npu: FakeNpu) -> None:
    runtime = fake_npu.runtime()
    items = selftest.run_selftest(runtime, FakeOps(fake_npu), StreamKit(),
                                  pinning=SegmentPinning([AclMallocHost(runtime)]),
                                  copy_blocking=copy_blocking_with_the_queue_off(
                                      fake_npu, SegmentPinning([AclMallocHost(runtime)])))
    verdicts = {item.name: item.verdict for item in items}
    assert list(verdicts) == list(selftest.ITEMS)
    assert verdicts["round trip"] == "ok" and verdicts["host memory"] == "ok" and verdicts["task queue"] == "ok"
    assert verdicts["copy blocks"] == "ok", items[1].detail
    assert {"warn", "ok"} >= {verdicts["host copy"], verdicts["overlap"]}  # timings on a fake mean nothing
    assert items[0].numbers["path"] == "aclrtMallocHost" and items[0].numbers["pointer_location"] == "host"
    assert items[2].numbers["bytes"] == selftest.COPY_BYTES
    assert items[4].numbers["transfers"] > 0 and items[4].numbers["lane_gb_s"] > 0
    assert '"failed": false' in selftest.to_json(items)


def test_the_round_trip_sees_one_wrong_byte(fake_npu: FakeNpu) -> None:
    runtime = fake_npu.runtime()
    fixture = selftest._fixture(runtime, FakeOps(fake_npu), 4, SegmentPinning([AclMallocHost(runtime)]))
    backend = NpuBackend.on_runtime(runtime)
    backend.prepare(fixture.plan)
    assert selftest.check_round_trip(fixture, backend).verdict == "ok"

    class OneWrongByte:
        def __init__(self, inner: NpuBackend) -> None:
            self.inner = inner

        def store(self, plan, slots, objects):  # type: ignore[no-untyped-def]
            stats = self.inner.store(plan, slots, objects)
            objects[2][100] ^= 0x01
            return stats

        def load(self, plan, slots, objects):  # type: ignore[no-untyped-def]
            return self.inner.load(plan, slots, objects)

    item = selftest.check_round_trip(fixture, OneWrongByte(backend))
    assert item.verdict == "fail" and "chunk 2" in item.detail and "byte 100" in item.detail


def test_without_a_card_every_item_is_a_skip_with_the_reason() -> None:
    items = selftest.run_selftest()
    assert [i.name for i in items] == list(selftest.ITEMS)
    assert {i.verdict for i in items} == {"skip"} and all("torch_npu" in i.detail for i in items)


def _pageable_registration(fake: FakeNpu, monkeypatch: pytest.MonkeyPatch) -> SegmentPinning:
    """aclrtHostRegister(MAPPED) that ACL reports as unregistered, kept (the arena's own check switched off): the
    card-side failure F3 fears, which the self-test must report, not pass."""
    from lmcache_npu.platform import ascend_memory

    fake.set_host_register_v2_error(207000)
    fake.set_pointer_host_location("unregistered")
    monkeypatch.setattr(ascend_memory, "require_page_locked", lambda *args: None)
    return SegmentPinning([ascend_memory.AclHostRegister(fake.runtime())])


def test_a_registration_acl_calls_pageable_fails_host_memory_and_copy_blocks(fake_npu: FakeNpu,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = fake_npu.runtime()
    fixture = selftest._fixture(runtime, FakeOps(fake_npu), 4, _pageable_registration(fake_npu, monkeypatch))
    item = selftest.check_host_memory(fixture, runtime)
    assert item.verdict == "fail" and "unregistered" in item.detail and item.numbers["api"] == \
        "aclrtHostRegister(MAPPED)"
    blocked = copy_blocking_with_the_queue_off(fake_npu, _pageable_registration(fake_npu, monkeypatch))()
    assert blocked.verdict == "fail" and blocked.numbers["submit_ms"] >= 0.5 * blocked.numbers["busy_ms"]


def test_host_memory_verdicts_for_what_acl_may_say(fake_npu: FakeNpu) -> None:
    runtime = fake_npu.runtime()
    fixture = selftest._fixture(runtime, FakeOps(fake_npu), 4, SegmentPinning([AclMallocHost(runtime)]))
    assert selftest.check_host_memory(fixture, runtime).verdict == "ok"

    class Says:
        def __init__(self, location: str) -> None:
            self.location = location

        def pointer_attributes(self, address: int) -> dict:
            return {"location": self.location}

    for location, verdict in (("host_numa", "ok"), ("unknown", "warn"), ("unregistered", "warn")):
        runtime.native = Says(location)  # aclrtMallocHost's memory: a wrong answer is a warning, not a failure
        assert selftest.check_host_memory(fixture, runtime).verdict == verdict, location


def test_copy_blocks_cannot_time_a_submit_with_the_queue_on(fake_npu: FakeNpu) -> None:
    runtime = fake_npu.runtime()
    item = selftest.copy_blocking_item(runtime, FakeOps(fake_npu), SegmentPinning([AclMallocHost(runtime)]))
    assert item.verdict == "warn" and "stayed on" in item.detail


def test_the_overlap_is_timed_on_the_compute_stream_not_with_a_device_sync(fake_npu: FakeNpu) -> None:
    """F5: a device-wide synchronize waits for the lane's loads too; the item must not call it while timing."""
    runtime = fake_npu.runtime()
    ops = FakeOps(fake_npu)
    fixture = selftest._fixture(runtime, ops, 4, SegmentPinning([AclMallocHost(runtime)]))
    backend = NpuBackend.on_runtime(runtime)
    backend.prepare(fixture.plan)
    calls = []
    ops.synchronize = lambda: calls.append("device sync")  # type: ignore[method-assign]
    item = selftest.check_overlap(fixture, backend, ops, StreamKit(), seconds=0.4)
    assert item.name == "overlap" and not calls, "the overlap item synchronized the whole device"


def test_the_child_process_reports_its_verdict_as_json() -> None:
    """The real 'copy blocks' path: a child with TASK_QUEUE_ENABLE=0; without a card it says why it skipped."""
    item = selftest.copy_blocking_in_child()
    assert item.name == "copy blocks" and item.verdict == "skip" and "torch_npu" in item.detail
