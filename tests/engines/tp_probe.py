"""Worker-side probes for engines whose workers run in other processes (tensor_parallel_size > 1): plain
module-level functions that vLLM's `collective_rpc` pickles by name and runs on every rank."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence


def _worker_half() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_half


def share_facts(_worker: Any) -> dict[str, Any]:
    """This rank's place, the object its tiers hold per chunk, and what its disk tier wrote and read."""
    half = _worker_half()
    disk = half.executor.disk if half.executor is not None else None
    counts = disk.counters.snapshot() if disk is not None else {}
    return {"rank": half.place.rank, "object_bytes": half.executor.arena.object_bytes,
            "full_bytes": half.layout.plan.object_bytes, "shared": half.shares is not None,
            "disk_write_bytes": counts.get("write_bytes", 0), "disk_writes": counts.get("writes", 0),
            "disk_reads": counts.get("reads", 0), "disk_path": getattr(disk, "root", None) and str(disk.root)}


def flush_disk(_worker: Any) -> bool:
    """Waits until the rank's executor and disk writers are idle (every queued chunk file is on disk)."""
    half = _worker_half()
    ok = half.executor.wait_idle(60)
    disk = half.executor.disk
    if disk is not None and hasattr(disk, "flush"):
        disk.flush()
    return bool(ok)


def block_digests(_worker: Any, blocks: Sequence[int]) -> dict[str, str]:
    """Per registered KV layer of this rank, a digest of the bytes of `blocks` (whole blocks, in table order)."""
    import torch

    half = _worker_half()
    ids = torch.tensor(list(blocks), dtype=torch.long)
    out = {}
    for layer, cache in sorted(half.kv_caches.items()):
        tensors = [cache] if isinstance(cache, torch.Tensor) else list(cache)
        h = hashlib.sha256()
        for tensor in tensors:
            assert tensor.shape[0] == half.kv_cache_config.num_blocks, f"{layer}: not a [num_blocks, ...] cache"
            h.update(tensor[ids].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[layer] = h.hexdigest()
    return out


def poison_all(_worker: Any) -> int:
    """Overwrites every KV block of this rank with a value no model computes (1e30), so a block a load should
    have written and did not can never equal a computed one. Call it only while no request runs."""
    import torch

    half = _worker_half()
    count = 0
    for cache in half.kv_caches.values():
        for tensor in [cache] if isinstance(cache, torch.Tensor) else list(cache):
            tensor.fill_(1e30 if tensor.is_floating_point() else 0x7F)
            count += 1
    return count
