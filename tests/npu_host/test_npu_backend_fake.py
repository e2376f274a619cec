"""The NPU backend's host side on the fake device: the real native sources (csrc/npu, csrc/bindings/npu_module.cpp)
over fake ACL and a fake torch_npu task queue, the kernel under the AscendC emulator, every byte against the oracle.

What a card would show and these show on x86: transfers go through the task queue without draining it, behind the
model's queued work and only behind it; host copies are asynchronous (page-locked host side) by construction; a
failing ACL call fails the transfer, not the model's queue; a batch larger than the staging window moves in windows.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.ops import ChunkBatch, Direction
from lmcache_npu.ops.npu_backend import NpuBackend

from ..ops.oracle import Geometry, oracle_load, oracle_object_layout, oracle_store, payload_mask, small_geometry
from ..ops.strategies import Case, cases
from ..ops.test_conformance import run_round_trip
from .fake_npu import FakeNpu


def on_device(fake: FakeNpu, geometry: Geometry) -> Geometry:
    """The geometry's pages moved into the fake device's memory (the kernel's GM is that memory alone)."""
    for rp in geometry.raw_planes:
        device = fake.device_tensor(rp.raw.numel())
        device.copy_(rp.raw)
        rp.raw = device
    return geometry


def backend_for(fake: FakeNpu, plan, chunks_per_window: int = 4, cores: int = 3) -> NpuBackend:
    backend = NpuBackend.on_runtime(fake.runtime(), cores=cores, staging_bytes=max(1, chunks_per_window
                                                                                   * plan.object_bytes))
    backend.prepare(plan)
    return backend


SLOTS = [np.arange(64).reshape(2, 32), np.arange(16).reshape(2, 8)]  # two chunks of small_geometry


@settings(max_examples=30, deadline=None)
@given(case=cases(soc="a2", max_chunks=6), window_chunks=st.integers(1, 4),
       placement=st.sampled_from(["pinned", "device"]))
def test_fake_npu_matches_oracle(fake_device: FakeNpu, case: Case, window_chunks: int, placement: str) -> None:
    fake_device.fresh()
    on_device(fake_device, case.geometry)
    backend = backend_for(fake_device, case.geometry.plan(), window_chunks)

    def place(objects: torch.Tensor) -> torch.Tensor:
        make = fake_device.pinned_tensor if placement == "pinned" else fake_device.device_tensor
        target = make(objects.numel())
        target.copy_(objects.reshape(-1))
        return target.view(objects.shape)

    run_round_trip(backend, case, place)
    assert fake_device.counter("pageable_async_copies") == 0, "a host copy was not asynchronous"


def test_a_batch_larger_than_the_window_moves_in_windows_and_a_wrong_byte_is_seen(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan, chunks_per_window=1)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    launches = fake_npu.counter("launches")
    backend.store(plan, SLOTS, objects)
    assert backend.last_windows == 2 and fake_npu.counter("launches") == launches + 2
    payload = payload_mask(geometry)
    expected = oracle_store(geometry, SLOTS, objects.numpy())
    assert np.array_equal(objects.numpy()[:, payload], expected[:, payload])
    objects[1, int(np.flatnonzero(payload)[-1])] ^= 0xFF  # negative control: the comparison sees one byte
    assert not np.array_equal(objects.numpy()[:, payload], expected[:, payload])


def test_the_transfer_is_queued_behind_the_models_work_without_draining_the_queue(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    page = geometry.raw_planes[0].raw
    before = len(fake_npu.device_log())
    fake_npu.queue(paused=True)
    fake_npu.model_write("model: writes the pages", page, 0x3C)  # queued by the model before the store
    done = threading.Event()
    errors: list[BaseException] = []

    def store() -> None:
        try:
            fake_npu.select_device()
            backend.store(plan, SLOTS, objects)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        done.set()

    tails = fake_npu.device_log().count("submit:lmcache_kv_transfer_tail")  # the warm-up's
    worker = threading.Thread(target=store)
    worker.start()
    deadline = time.monotonic() + 10
    while fake_npu.device_log().count("submit:lmcache_kv_transfer_tail") == tails and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_npu.device_log().count("submit:lmcache_kv_transfer_tail") == tails + 1, \
        "submitting waited for the paused queue (a drain)"
    assert fake_npu.queue_pending() >= 3 and not done.is_set(), "the transfer must wait for its tail, not finish"
    fake_npu.queue(paused=False)
    assert done.wait(10) and not errors, errors
    worker.join()
    log = fake_npu.device_log()[before:]
    assert log.index("model: writes the pages") < log.index("kernel"), "the kernel ran before the model's write"
    stored = objects.numpy()[0, : geometry.raw_planes[0].row_bytes]
    assert (stored == 0x3C).all(), "the store did not see the pages the model wrote before it"


def test_a_launch_that_bypasses_the_queue_is_seen_to_overtake_the_model(fake_npu: FakeNpu) -> None:
    """Negative control of the test above: a port that launched directly (no task queue) would read the pages
    before the model's queued write lands, and the same check sees it."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    page = geometry.raw_planes[0].raw
    fake_npu.queue(paused=True, bypass=True)
    fake_npu.model_write("model: writes the pages", page, 0x3C)
    backend.store(plan, SLOTS, objects)  # returns: every submit ran at once, the model's write still queued
    fake_npu.queue(paused=False)
    fake_npu.drain()
    assert not (objects.numpy()[0, : geometry.raw_planes[0].row_bytes] == 0x3C).all()


def test_with_the_task_queue_off_the_work_runs_on_the_calling_thread(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    fake_npu.queue(enabled=False)
    backend = backend_for(fake_npu, plan)
    assert not backend.task_queue
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    backend.store(plan, SLOTS, objects)
    expected = oracle_store(geometry, SLOTS, objects.numpy())
    assert np.array_equal(objects.numpy()[:, payload_mask(geometry)], expected[:, payload_mask(geometry)])


def test_pages_are_free_right_after_the_last_kernel_before_the_store_copies(fake_npu: FakeNpu) -> None:
    """after_kernel is called once every window's kernel is queued and before the last window's copies: an event
    recorded there completes when the pages are read, not when the host has the bytes."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan, chunks_per_window=1)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    marks: list[list[str]] = []
    before = len(fake_npu.device_log())

    def after_kernel(event: object) -> None:
        assert event is None
        marks.append([n for n in fake_npu.device_log()[before:] if n.startswith("submit:")])

    backend.transfer(ChunkBatch.build(plan, SLOTS, objects, Direction.STORE), after_kernel=after_kernel)
    assert marks == [["submit:lmcache_kv_transfer"] * 2], \
        "after_kernel must come after every window was submitted and before the tail"
    assert [n for n in fake_npu.device_log()[before:] if n.startswith("submit:")][-1] == \
        "submit:lmcache_kv_transfer_tail"


def test_a_failed_copy_fails_the_transfer_not_the_models_queue(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan, chunks_per_window=1)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    fake_npu.fail_async_copy_at(1)  # the first window's status copy... or whichever comes second
    with pytest.raises(RuntimeError, match=r"aclrtMemcpyAsync .*\(window 0\) failed with ACL error 107000"):
        backend.store(plan, SLOTS, objects)
    assert fake_npu.queue_task_errors() == 0, "a failed transfer must not put torch_npu's queue in an error state"
    backend.store(plan, SLOTS, objects)  # the next transfer is unaffected
    expected = oracle_store(geometry, SLOTS, objects.numpy())
    assert np.array_equal(objects.numpy()[:, payload_mask(geometry)], expected[:, payload_mask(geometry)])


def test_a_refused_launch_and_a_kernel_fault_are_reported(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    fake_npu.set_errors(launch=507899)
    with pytest.raises(RuntimeError, match="aclrtlaunch_lmcache_kv_transfer .* 507899"):
        backend.store(plan, SLOTS, objects)
    fake_npu.set_errors()
    host_pages = torch.zeros(geometry.raw_planes[0].raw.numel(), dtype=torch.uint8)  # not device memory
    geometry.raw_planes[0].raw = host_pages
    with pytest.raises(RuntimeError, match="AI core exception"):
        backend.store(geometry.plan(), SLOTS, objects)


def test_bad_copies_are_refused_before_anything_is_queued(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    whole = fake_npu.pinned_tensor(2 * plan.object_bytes + 4096)
    misaligned = whole[32: 32 + 2 * plan.object_bytes].view(2, -1)  # 32 B off: aclrtMemcpyAsync refuses
    fake_npu.drain()  # the backend's start-up uploads run on the queue's thread; only what the refusal queues counts
    launches = fake_npu.counter("launches")
    with pytest.raises(ValueError, match="64 B aligned"):
        backend.store(plan, SLOTS, misaligned)
    assert fake_npu.counter("launches") == launches and fake_npu.queue_pending() == 0


def test_a_pageable_host_object_is_noticed(fake_npu: FakeNpu) -> None:
    """The S1 question on x86: copies from the arena's page-locked memory never run synchronously, and the same
    counter does see a pageable object (CANN copies those synchronously, inside the task queue's thread)."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    backend.store(plan, SLOTS, fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1))
    assert fake_npu.counter("pageable_async_copies") == 0
    pageable = torch.zeros(2, plan.object_bytes + 64, dtype=torch.uint8)[:, : plan.object_bytes]
    pageable = torch.zeros(2 * plan.object_bytes + 64, dtype=torch.uint8)
    start = -pageable.data_ptr() % 64
    backend.store(plan, SLOTS, pageable[start: start + 2 * plan.object_bytes].view(2, -1))
    assert fake_npu.counter("pageable_async_copies") > 0


def test_load_round_trip_through_windows(fake_npu: FakeNpu) -> None:
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan, chunks_per_window=1)
    _, _, object_bytes = oracle_object_layout(geometry)
    rng = np.random.default_rng(5)
    objects = fake_npu.pinned_tensor(2 * object_bytes).view(2, -1)
    objects.copy_(torch.from_numpy(rng.integers(0, 256, (2, object_bytes), dtype=np.uint8)))
    expected = oracle_load(geometry, SLOTS, objects.numpy())
    backend.load(plan, SLOTS, objects)
    for rp, want in zip(geometry.raw_planes, expected):
        assert np.array_equal(rp.raw.numpy(), want)


def test_the_platform_is_read_with_the_device_selected_and_a_null_soc_is_refused(fake_npu: FakeNpu) -> None:
    info = fake_npu.native.platform(0)
    assert info["soc"] == "Ascend910B1" and info["vector_cores"] == 48 and info["task_queue"] is True
    fake_npu.set_soc(None)
    with pytest.raises(RuntimeError, match="aclrtGetSocName"):
        fake_npu.native.platform(0)
    fake_npu.set_soc("Ascend910B1")
    with pytest.raises(RuntimeError, match="current NPU is 0, not 1"):
        fake_npu.native.platform(1)
    unselected: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(unselected, lambda: fake_npu.native.platform(0)))
    thread.start()
    thread.join()
    assert unselected and "torch.npu.set_device" in str(unselected[0]), "a thread without a device must be refused"


def _capture(errors: list[BaseException], call) -> None:  # type: ignore[no-untyped-def]
    try:
        call()
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


def test_backend_options_are_checked(fake_npu: FakeNpu) -> None:
    with pytest.raises(ValueError, match="backend_options.cores must be an integer >= 1"):
        NpuBackend.on_runtime(fake_npu.runtime(), cores=0)
    with pytest.raises(ValueError, match="exceeds the 48 vector cores"):
        NpuBackend.on_runtime(fake_npu.runtime(), cores=49)
    with pytest.raises(ValueError, match="backend_options.staging_bytes"):
        NpuBackend.on_runtime(fake_npu.runtime(), staging_bytes=-1)
    backend = NpuBackend.on_runtime(fake_npu.runtime())
    assert backend.cores == 16 and backend.staging_bytes == 64 << 20


def test_a_store_after_a_load_copies_no_host_gap_bytes_out_of_staging(fake_npu: FakeNpu,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging window a load filled with host bytes (another object's alignment gaps) is zeroed where a later
    store's gaps are; without that zeroing (negative control) the store copies the host's gap bytes out."""
    from lmcache_npu.ops import device_staging

    from ..ops.staging_cases import HOST_GAP, gap_bytes_of_a_store_after_a_load

    def pinned(t: torch.Tensor) -> torch.Tensor:
        target = fake_npu.pinned_tensor(t.numel()).view(t.shape)
        target.copy_(t)
        return target

    def run() -> np.ndarray:
        backend = NpuBackend.on_runtime(fake_npu.runtime(), cores=2)
        return gap_bytes_of_a_store_after_a_load(backend, torch.device("cpu"), lambda raw: _to_device(fake_npu, raw),
                                                 pinned)

    assert not (run() == HOST_GAP).any(), "a store copied another object's gap bytes out of staging"
    monkeypatch.setattr(device_staging.StagingLedger, "claim", lambda *args, **kwargs: None)
    assert (run() == HOST_GAP).any(), "without the zeroing the gap bytes must show (the check can fail)"


def _to_device(fake: FakeNpu, raw: torch.Tensor) -> torch.Tensor:
    device = fake.device_tensor(raw.numel())
    device.copy_(raw)
    return device


def test_the_module_knows_the_soc_it_was_built_for_and_refuses_another_arch(fake_npu: FakeNpu) -> None:
    """F8/F15: CANN's launcher registers no kernel on another arch's SoC and every launch then fails with a bare
    code; the backend refuses at start naming both SoCs. A2 and A3 share one binary; A5 is refused by name."""
    from lmcache_npu.ops.transfer_backend import BackendUnavailable

    assert fake_npu.native.BUILT_SOC == "ascend910b1" and fake_npu.native.platform(0)["built_soc"] == "ascend910b1"
    fake_npu.set_soc("Ascend910_9391")  # an A3: the same c220 kernel
    assert NpuBackend.on_runtime(fake_npu.runtime()).soc.name == "a3"
    fake_npu.set_soc("Ascend310P3")
    with pytest.raises(BackendUnavailable, match=r"built for SOC_VERSION ascend910b1 \(c220\) but this NPU is "
                                                 r"Ascend310P3 \(m200\)"):
        NpuBackend.on_runtime(fake_npu.runtime())
    fake_npu.set_soc("Ascend950PR_9599")
    with pytest.raises(BackendUnavailable, match="Atlas A5"):
        NpuBackend.on_runtime(fake_npu.runtime())


@pytest.mark.parametrize("built,running,refused", [
    ("ascend910b1", "Ascend910B3", False), ("ascend910_9391", "Ascend910B1", False),
    ("Ascend310P3", "Ascend310P1", False), ("ascend910b1", "Ascend310P3", True),
    ("ascend310p1", "Ascend910_9392", True),
    ("", "Ascend310P3", False)])
def test_built_and_running_socs_compare_by_kernel_arch(built: str, running: str, refused: bool) -> None:
    from lmcache_npu.ops.soc import check_built_soc

    if refused:
        with pytest.raises(ValueError, match=f"built for SOC_VERSION {built}.* but this NPU is {running}"):
            check_built_soc(built, running)
    else:
        check_built_soc(built, running)


@pytest.mark.parametrize("name", ["Ascend950PR_9599", "Ascend910", "Ascend310B4", ""])
def test_socs_the_kernel_is_not_built_for_are_refused_by_name(name: str) -> None:
    from lmcache_npu.ops.soc import soc_from_name

    with pytest.raises(ValueError, match="A5" if "950" in name else "not a SoC the transfer kernel is built for"):
        soc_from_name(name, 196608, 48)


def test_the_built_soc_is_read_from_the_module_file_without_importing_it(fake_npu: FakeNpu, tmp_path) -> None:
    from lmcache_npu.platform.npu_runtime import recorded_built_soc

    assert recorded_built_soc(fake_npu.native.__file__) == "ascend910b1"
    untagged = tmp_path / "_npu.so"
    untagged.write_bytes(b"\x7fELF no tag here")
    assert recorded_built_soc(str(untagged)) is None and recorded_built_soc(str(tmp_path / "missing.so")) is None
    untagged.write_bytes(b"\x00LMCACHE_NPU_BUILT_SOC=\x00")
    assert recorded_built_soc(str(untagged)) == ""


@pytest.mark.parametrize("shared", [False, True])
def test_loads_launched_back_to_back_keep_their_own_buffers_until_finished(fake_npu: FakeNpu, monkeypatch,
                                                                           shared: bool) -> None:
    """A sliced load's slices on NPU: one load per plane, each launched while the task queue is paused, so every
    launch returns before any of their tasks runs, then finished in order: every page byte is the oracle's.
    Negative control (`shared`): every launch on one flight's tables, status and Transfer (one transfer at a time,
    as before flights) is seen to go wrong."""
    geometry = on_device(fake_npu, small_geometry())
    plan = geometry.plan()
    backend = backend_for(fake_npu, plan)
    pieces = [plan.plane_subset([i]) for i in range(len(plan.moved_planes))]
    for piece in pieces:
        backend.prepare(piece)
    objects = fake_npu.pinned_tensor(2 * plan.object_bytes).view(2, -1)
    objects.copy_(torch.randint(0, 256, tuple(objects.shape), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(5)))
    expected = oracle_load(geometry, SLOTS, objects.numpy())
    batch = ChunkBatch.build(plan, SLOTS, objects, Direction.LOAD)
    if shared:
        one = backend._spare()
        monkeypatch.setattr(backend, "_spare", lambda: one)
        monkeypatch.setattr(backend, "_give_back", lambda flight, late: None)
    fake_npu.queue(paused=True)
    pending = [backend.launch(batch.for_plan(piece)) for piece in pieces]  # a wait here would never end
    assert fake_npu.queue_pending() >= 2 * len(pieces), "a launch ran its tasks or waited for them"
    fake_npu.queue(paused=False)
    failures = []
    for transfer in pending:
        try:
            transfer.finish()
        except RuntimeError as exc:
            failures.append(str(exc))
    same = all(np.array_equal(rp.raw.cpu().numpy(), want) for rp, want in zip(geometry.raw_planes, expected))
    if shared:
        assert failures or not same, "launches sharing one flight's buffers went unnoticed"
    else:
        assert not failures and same, failures or "a page byte differs from the oracle's"
        assert len(backend._flights) >= len(pieces), "launches in flight together shared a flight"
