"""Whether, and over which process group, an engine's ranks store replicated KV once (`tp_share`, docs/storage.md
"Replicated KV").

`tp_share: auto` turns sharing on when the engine runs with tensor_parallel_size > 1 and discovery marked planes
replicated (MLA latents, indexers, DeepSeek-V4 caches, attention with a single KV head); `off`, tp_size 1 or no
replicated plane leave every rank storing its whole chunk, byte for byte as before. The exchange gets a gloo group
of its own over the TP group's ranks, and, for the device exchange (`tp_share_exchange`), an NCCL/HCCL group of its
own: vLLM's cpu_group and device_group also carry its own coordination from the model's thread, and two users of one
group could interleave their collectives. Making a group is collective over the whole world, so every rank creates
every TP group's, in the same order, and keeps its own.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from ...layout.discovery import LayoutPolicy
from ...ops.plan import TransferPlan
from ...platform.npu_budget import HCCL_SHARE_BUFFER_MB
from ...transfer.share_mover import ShareExchange
from ...transfer.shares import ShareLayout

logger = logging.getLogger(__name__)

EXCHANGE_TIMEOUT = timedelta(minutes=5)  # a rank that never joins a load's exchange fails it instead of hanging


def tp_policy(vllm_config: Any, mode: str) -> tuple[int, Optional[int]]:
    """(tp_size, total KV heads) that discovery marks replicated planes with; (1, None) when sharing is off."""
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    if mode == "off" or tp_size <= 1:
        return 1, None
    if not exchange_available():
        logger.info("tp_share: tensor_parallel_size %d but no TP process group in this process (ranks simulated in "
                    "one process?): every rank stores its whole chunk", tp_size)
        return 1, None
    model_config = getattr(vllm_config, "model_config", None)
    heads: Optional[int] = None
    if model_config is not None:
        try:
            heads = int(model_config.get_total_num_kv_heads())
        except (AttributeError, TypeError, ValueError):  # a model config without heads: head-split planes not shared
            heads = None
    return tp_size, heads


def exchange_available() -> bool:
    """torch.distributed and vLLM's TP group are up: the share exchange has ranks to talk to."""
    try:
        import torch.distributed as dist
        from vllm.distributed import parallel_state
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def with_tp(policy: LayoutPolicy, vllm_config: Any, mode: str) -> LayoutPolicy:
    """`policy` with the engine's TP size and KV heads (unchanged when sharing is off)."""
    import dataclasses

    tp_size, heads = tp_policy(vllm_config, mode)
    return dataclasses.replace(policy, tp_size=tp_size, total_kv_heads=heads)


def share_layout(plan: TransferPlan, tp_rank: int, share_ranks: int) -> Optional[ShareLayout]:
    """The rank's share of the plan's replicated tail inside its share group (`share_ranks` consecutive TP ranks);
    None when there is nothing to share."""
    if share_ranks <= 1 or plan.replicated_bytes == 0:
        return None
    return ShareLayout(plan.object_bytes, plan.replicated_offset, tp_rank % share_ranks, share_ranks)


def tp_rank() -> int:
    """This worker's rank inside its TP group (not its global rank, which pipeline stages offset)."""
    from vllm.distributed.parallel_state import get_tp_group

    return int(get_tp_group().rank_in_group)


def _tp_groups(world: int, tp_size: int, coordinator: Any) -> Sequence[Sequence[int]]:
    """Every TP group's global ranks: vLLM's own list where it keeps one (>= 0.29), else its layout (TP innermost)."""
    groups = getattr(coordinator, "group_ranks", None)
    if groups:
        return [list(map(int, g)) for g in groups]
    if world % tp_size:
        raise ValueError(f"tp_share: world size {world} is not a multiple of tensor_parallel_size {tp_size}")
    return [list(range(start, start + tp_size)) for start in range(0, world, tp_size)]


def _share_groups(tp_size: int, share_ranks: int) -> list[list[int]]:
    """Every share group's global ranks: each TP group (in vLLM's rank order) cut into runs of `share_ranks`
    consecutive ranks, in the order every rank must make their process groups."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    coordinator = get_tp_group()
    if coordinator.world_size != tp_size:
        raise ValueError(f"tp_share: vLLM's TP group has {coordinator.world_size} ranks, the config says {tp_size}")
    if tp_size % share_ranks:
        raise ValueError(f"tp_share: share groups of {share_ranks} ranks do not divide a TP group of {tp_size}")
    return [list(ranks[start:start + share_ranks]) for ranks in _tp_groups(dist.get_world_size(), tp_size, coordinator)
            for start in range(0, tp_size, share_ranks)]


def group_options(backend: str) -> Optional[Any]:
    """Options of a new `backend` group: an HCCL communicator's buffer (2 x hccl_buffer_size of device memory each,
    200 MB by default) is cut to HCCL_SHARE_BUFFER_MB, since shares are a few MB and HCCL moves larger collectives
    through its buffer in pieces; None for other backends."""
    if backend != "hccl":
        return None
    import torch_npu

    options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {"hccl_buffer_size": HCCL_SHARE_BUFFER_MB}
    return options


def _group_over_shares(tp_size: int, share_ranks: int, backend: str) -> Any:
    """A process group of `backend` over this rank's share group, made like every other rank's, in the same order."""
    import torch.distributed as dist

    mine = None
    options = group_options(backend)
    for ranks in _share_groups(tp_size, share_ranks):
        group = dist.new_group(ranks, backend=backend, timeout=EXCHANGE_TIMEOUT, pg_options=options)
        if dist.get_rank() in ranks:
            mine, members = group, ranks
    if mine is None:
        raise ValueError(f"tp_share: global rank {dist.get_rank()} is in no TP group")
    logger.info("tp_share: %s exchange group over ranks %s", backend, members)
    return mine


def exchange_group(tp_size: int, share_ranks: int) -> Any:
    """A gloo process group over this rank's share group, for the share exchange only."""
    return _group_over_shares(tp_size, share_ranks, "gloo")


# the collective library that moves device memory between the ranks of a device type
DEVICE_COLLECTIVES = {"cuda": "nccl", "npu": "hccl"}


def device_collective(mode: str, device: torch.device) -> Optional[str]:
    """The backend of the device exchange (`tp_share_exchange`), or None for the host exchange."""
    backend = DEVICE_COLLECTIVES.get(device.type)
    if mode == "host" or (mode == "auto" and backend is None):
        return None
    if backend is None:
        raise ValueError(f"tp_share_exchange: device needs the KV cache on NPU or CUDA; it is on {device.type}")
    return backend


def share_exchange(mode: str, tp_size: int, share_ranks: int, device: torch.device) -> ShareExchange:
    """The exchange a rank's shared loads use: flags (and host shares) over gloo, device shares over NCCL/HCCL."""
    backend = device_collective(mode, device)
    host = exchange_group(tp_size, share_ranks)
    if backend is None:
        return ShareExchange(host)
    return ShareExchange(host, _group_over_shares(tp_size, share_ranks, backend), device)
