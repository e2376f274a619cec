"""The node cache on a CUDA machine: a worker's mapping of the node's shared segments is registered with
cudaHostRegister (every segment, before the worker reports), the CUDA kernels store into one engine's mapping and load
from another's the bytes the torch backend computes, and a second process's DMA into the shared pages is what this
one reads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.node.attachment import attach_worker_arena
from lmcache_npu.node.messages import PoolGeometry
from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.ops import get_backend
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.config import StoreConfig

from ..ops.strategies import Case, cases
from .cuda_marks import CUDA_KERNELS
from .reference import cuda_reference

pytestmark = CUDA_KERNELS
ROOT = Path(__file__).resolve().parents[2]


def _service(object_bytes: int, slots: int, segment_slots: int) -> tuple[NodeCacheService, str]:
    socket_path = os.path.join(tempfile.mkdtemp(prefix="lmc-node-"), "node.sock")
    slot_bytes = slot_bytes_for(object_bytes)
    tiers = StoreConfig(hugepages="off", arena_segment_bytes=segment_slots * slot_bytes)
    return NodeCacheService(ServiceOptions(socket_path, NodeCapacity(slots * slot_bytes), tiers)).start(), socket_path


def test_a_workers_mapping_is_registered_segment_by_segment():
    from lmcache_npu import _cuda

    service, path = _service(1 << 20, slots=5, segment_slots=2)
    try:
        geometry = PoolGeometry("c" * 32, b"fingerprint", 1, 1 << 20, 16)
        # an accelerator: pinned
        attached = attach_worker_arena(path, "engine-a", geometry, 0, weights="sha256", pinned=None)
        arena = attached.arena
        assert arena.pinned and len(arena.memory.segments) == 3
        for segment in arena.memory.segments:
            assert segment.registered and _cuda.host_mapped(segment.address, segment.mapped_bytes)
        device = torch.arange(1 << 20, device="cuda", dtype=torch.int32).to(torch.uint8)
        arena.slot(3).copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        pool = next(iter(service.pools.values()))
        assert torch.equal(pool.arenas[0].slot(3), device.cpu())  # the service's own mapping sees the DMA
        arena.close()
        attached.close()
    finally:
        service.close()


_CHILD = """
import sys, torch
from lmcache_npu.node.attachment import attach_worker_arena
from lmcache_npu.node.messages import PoolGeometry
attached = attach_worker_arena(sys.argv[1], "engine-child", PoolGeometry("c" * 32, b"fingerprint", 1, 1 << 20, 16), 0,
                               weights="sha256", pinned=None)
pattern = (torch.arange(1 << 20, device="cuda", dtype=torch.int64) * 7 + 3).to(torch.uint8)
attached.arena.slot(1).copy_(pattern, non_blocking=True)
torch.cuda.synchronize()
print("stored", flush=True)
"""


def test_another_processes_dma_into_the_shared_slots_is_what_this_one_loads():
    service, path = _service(1 << 20, slots=4, segment_slots=4)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", _CHILD, path], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and "stored" in done.stdout, done.stderr[-3000:]
        geometry = PoolGeometry("c" * 32, b"fingerprint", 1, 1 << 20, 16)
        attached = attach_worker_arena(path, "engine-parent", geometry, 0, weights="sha256", pinned=None)
        loaded = attached.arena.slot(1).cuda()
        expected = (torch.arange(1 << 20, device="cuda", dtype=torch.int64) * 7 + 3).to(torch.uint8)
        assert torch.equal(loaded, expected)
        assert not torch.equal(attached.arena.slot(2).cuda(), expected)  # the check can fail: another slot differs
        attached.arena.close()
        attached.close()
    finally:
        service.close()


@settings(max_examples=25, deadline=None)
@given(case=cases(soc="a2", max_chunks=6), path=st.sampled_from(["mapped", "staging"]), data=st.data())
def test_cuda_kernels_store_through_one_engines_mapping_and_load_through_anothers(case: Case, path: str,
                                                                                    data: st.DataObject):
    """Engine A's worker stores chunks with the CUDA kernels into its mapping of the node's slots; engine B's worker,
    another mapping registered on its own, loads them; both against the torch backend. Inverting the shared slots'
    bytes through A's mapping changes what B loads (the control)."""
    geometry = case.geometry
    ref = cuda_reference(case)
    cpu_plan, cuda_plan, expected, cpu_pages, torch_backend = (ref.cpu_plan, ref.cuda_plan, ref.expected,
                                                               ref.cpu_pages, ref.torch_backend)
    num_slots = 2 * case.num_chunks + 1
    service, socket_path = _service(cuda_plan.object_bytes, slots=num_slots, segment_slots=2)
    try:
        pool_geometry = PoolGeometry("d" * 32, b"fingerprint", 1, cuda_plan.object_bytes, 16)
        writer = attach_worker_arena(socket_path, "engine-a", pool_geometry, 0, weights="sha256", pinned=None)
        reader = attach_worker_arena(socket_path, "engine-b", pool_geometry, 0, weights="sha256", pinned=None)
        order = data.draw(st.permutations(list(range(num_slots))))[:case.num_chunks]
        backend = get_backend("cuda", path=path)
        backend.store(cuda_plan, case.slots, [writer.arena.slot(s) for s in order])
        torch.cuda.synchronize()
        for i, slot in enumerate(order):  # what landed in the node's slots, seen through the writer's mapping
            assert torch.equal(writer.arena.slot(slot), expected[i]), f"chunk {i}: stored bytes differ"
        for rp, page in zip(geometry.raw_planes, cpu_pages):
            rp.raw.zero_()
            page.zero_()
        backend.load(cuda_plan, case.slots, [reader.arena.slot(s) for s in order])
        torch_backend.load(cpu_plan, case.slots, expected)
        torch.cuda.synchronize()
        for i, (rp, page) in enumerate(zip(geometry.raw_planes, cpu_pages)):
            assert torch.equal(rp.raw.cpu(), page), f"plane {i}: what engine B loaded differs from engine A's store"
        before = [rp.raw.clone() for rp in geometry.raw_planes]
        for slot in order:  # every stored byte inverted in the shared pages, through the writer's mapping
            writer.arena.slot(slot).bitwise_not_()
        backend.load(cuda_plan, case.slots, [reader.arena.slot(s) for s in order])
        torch.cuda.synchronize()
        if any(s is not None and (s >= 0).any() for s in case.slots):  # unless no chunk moves a row
            assert any(not torch.equal(rp.raw, old) for rp, old in zip(geometry.raw_planes, before)), \
                "bytes changed in the shared slots did not reach engine B's load"
        for attached in (writer, reader):
            attached.arena.close()
            attached.close()
    finally:
        service.close()
