"""`doctor --selftest` on the fake device: every item runs through the same code a card runs, and the round trip's
comparison sees one wrong byte. Without a card every item is a skip that says why."""

from __future__ import annotations

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


def test_every_item_runs_on_the_fake_device(fake_npu: FakeNpu) -> None:
    runtime = fake_npu.runtime()
    items = selftest.run_selftest(runtime, FakeOps(fake_npu), StreamKit(),
                                  pinning=SegmentPinning([AclMallocHost(runtime)]))
    verdicts = {item.name: item.verdict for item in items}
    assert list(verdicts) == list(selftest.ITEMS)
    assert verdicts["round trip"] == "ok" and verdicts["host memory"] == "ok" and verdicts["task queue"] == "ok"
    assert {"warn", "ok"} >= {verdicts["host copy"], verdicts["overlap"]}  # timings on a fake mean nothing
    assert items[0].numbers["path"] == "aclrtMallocHost" and items[0].numbers["pointer_location"] == "host"
    assert items[1].numbers["bytes"] == selftest.COPY_BYTES
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
