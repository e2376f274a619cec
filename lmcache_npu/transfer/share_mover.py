"""`SharedMover`: the `DeviceMover` of a rank that stores only its share of replicated KV; it wraps the rank's
`KVMover`, which still moves whole chunk objects. A store copies the own part and this rank's share into the arena
slot (no collective); a load is a collective on the model's thread (one ok flag per command, then the shares over the
host or the device exchange). How and why: docs/storage.md §6b "Replicated KV".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from ..store.commands import DeviceMove
from ..store.routes.context import Report
from ..store.tier import Failure, TierCounters, TierResult
from ..ops import Direction
from .mover import check_moves
from .shares import ShareLayout
from ..store.metrics import Metric, per_rank

logger = logging.getLogger(__name__)

ShareCheck = Callable[[DeviceMove, torch.Tensor], str]  # "" when the rank's stored object may be loaded, else why not


class ShareExchange:
    """The collectives of a share load: per-command flags over `group` (gloo, host memory), and the shares over
    `group` in host memory or, when `device_group` is given, over it in `device` memory (NCCL/HCCL)."""

    def __init__(self, group: Any, device_group: Any = None, device: Optional[torch.device] = None) -> None:
        if (device_group is None) != (device is None):
            raise ValueError("share exchange: a device group needs its device, and a device its group")
        self.group = group
        self.device_group = device_group
        self.device = device if device is not None else torch.device("cpu")

    @property
    def on_device(self) -> bool:
        return self.device_group is not None

    def agree(self, ok: Sequence[bool]) -> list[bool]:
        """Per flag: true on every rank of the group."""
        import torch.distributed as dist

        flags = torch.tensor([1 if x else 0 for x in ok], dtype=torch.int32)
        if flags.numel():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(x) for x in flags.tolist()]

    def gather(self, contribution: torch.Tensor, size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every rank's `contribution` (same length on all), concatenated in rank order into `out`: a new host
        tensor over the host group by default, or `out` on the exchange's device over the device group."""
        import torch.distributed as dist

        device_side = out is not None and self.on_device and out.device == self.device
        if out is None:
            out = torch.empty(size * contribution.numel(), dtype=torch.uint8)
        elif not device_side and out.device.type != "cpu":
            raise ValueError(f"share exchange: a gather into {out.device} needs the device exchange of that device")
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renames it
        gather(out[:size * contribution.numel()], contribution.to(out.device, non_blocking=True).contiguous(),
               group=self.device_group if device_side else self.group)
        return out


def _out_of_memory(exc: BaseException) -> bool:
    """A device allocation that failed for room (CUDA raises torch.OutOfMemoryError, torch_npu a RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _size_check(layout: ShareLayout) -> ShareCheck:
    def check(command: DeviceMove, stored: torch.Tensor) -> str:
        if stored.numel() < layout.object_bytes:
            return f"share missing: slot {command.slot} holds {stored.numel()} B of {layout.object_bytes}"
        return ""

    return check


class SharedMover:
    """Stores and loads a rank's share of each chunk through `inner` (a `KVMover` or any `DeviceMover` of whole
    objects) and `exchange`."""

    def __init__(self, inner: Any, layout: ShareLayout, exchange: ShareExchange, counters: TierCounters,
                 check: Optional[ShareCheck] = None, pin: bool = False, rank: Optional[int] = None) -> None:
        if layout.replicated_bytes == 0:
            raise ValueError("shared mover: the plan replicates no plane across the TP group; use the plain mover")
        self.inner = inner
        self.layout = layout
        self.exchange = exchange
        self.counters = counters
        self.check = check or _size_check(layout)
        self.pin = pin  # scratch objects page-locked, as the arena is, where a device copies them
        self.rank = layout.rank if rank is None else rank  # the worker's rank, in logs and per-rank counters

    def run(self, moves: Sequence[DeviceMove], objects: Sequence[torch.Tensor], report: Report) -> None:
        if check_moves(moves) == Direction.STORE:
            self._store(moves, objects, report)
        else:
            self._load(moves, objects, report)

    def _scratch(self, count: int) -> list[torch.Tensor]:
        """Zeroed full objects for the store kernel to write: in device memory with the device exchange, so only
        the own part and the share cross to the host, else in (pinned) host memory."""
        full_bytes = self.layout.full_bytes
        if self.exchange.on_device:
            try:
                return list(torch.zeros(count, full_bytes, dtype=torch.uint8, device=self.exchange.device).unbind(0))
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                if not _out_of_memory(exc):
                    raise
                self.counters.add(Metric.SHARE_STORE_HOST_SCRATCH)
                logger.warning("rank %d: no device memory for the scratch of %d stores (%d B); using host memory",
                               self.rank, count, count * full_bytes)
        return list(torch.zeros(count, full_bytes, dtype=torch.uint8, pin_memory=self.pin).unbind(0))

    def _store(self, commands: Sequence[DeviceMove], objects: Sequence[torch.Tensor], report: Report) -> None:
        scratch = self._scratch(len(commands))
        where = {c.cmd_id: (full, stored) for c, full, stored in zip(commands, scratch, objects)}
        rank = self.rank

        def packed(cmd_id: int, result: TierResult) -> None:
            if result.ok:
                full, stored = where[cmd_id]
                try:
                    self.layout.pack(full, stored)  # from device scratch: the own part and the share cross PCIe
                except Exception as exc:  # a failed copy must fail the command, never leave a half share stored
                    logger.exception("rank %d: packing the share of store %d failed", rank, cmd_id)
                    result = TierResult.fail(Failure.SHARE, str(exc))
                else:
                    self.counters.add(Metric.SHARE_STORED_BYTES, self.layout.object_bytes)
                    self.counters.add(per_rank(rank, Metric.STORED_BYTES), self.layout.object_bytes)
            report(cmd_id, result)

        self.inner.run(commands, scratch, packed)

    def _device_buffers(self, count: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Gather output and full objects for `count` loads in device memory; None when the device has no room (the
        group then exchanges this batch in host memory)."""
        layout = self.layout
        try:
            gathered = torch.empty(layout.size * count * layout.share_bytes, dtype=torch.uint8,
                                   device=self.exchange.device)
            full = torch.empty(count, layout.full_bytes, dtype=torch.uint8, device=self.exchange.device)
        except Exception as exc:  # never raise here: the other ranks would wait in the agreement for this one
            logger.warning("rank %d: no device memory for the share exchange of %d loads (%d B: %s); exchanging them "
                           "in host memory", self.rank, count,
                           count * (layout.full_bytes + layout.size * layout.share_bytes), exc)
            return None
        return gathered, full

    def _load(self, commands: Sequence[DeviceMove], objects: Sequence[torch.Tensor], report: Report) -> None:
        layout, rank = self.layout, self.rank
        local: list[str] = []
        for command, stored in zip(commands, objects):
            try:
                local.append(self.check(command, stored))
            except Exception as exc:  # a check that raises is a failed share, and the group still hears of it
                local.append(f"share check raised: {exc}")
        buffers = self._device_buffers(len(commands)) if self.exchange.on_device else None
        # the last flag: every rank has its device buffers (agreed with the shares, so all ranks take one path)
        flags = self.exchange.agree([not why for why in local] + ([buffers is not None] if self.exchange.on_device
                                                                  else []))
        on_device = self.exchange.on_device and flags.pop()
        if self.exchange.on_device and not on_device:
            self.counters.add(Metric.SHARE_HOST_FALLBACKS)
        kept = [i for i, ok in enumerate(flags) if ok]
        for i, ok in enumerate(flags):
            if not ok:
                why = local[i] or "share missing or invalid on another rank of the TP group"
                self.counters.add(Metric.SHARE_LOAD_FAILURES)
                logger.warning("rank %d: load %d refused: %s", rank, commands[i].cmd_id, why)
                report(commands[i].cmd_id, TierResult.fail(Failure.SHARE, why))
        if not kept:
            return
        stored = [objects[i] for i in kept]
        shares = [layout.share_of(obj) for obj in stored]
        if on_device:
            assert buffers is not None
            gathered, full = buffers[0], buffers[1][:len(kept)]
            # pinned, so the copy to the device is asynchronous and torch keeps the buffer until it is done
            contribution = torch.empty(len(kept) * layout.share_bytes, dtype=torch.uint8,
                                       pin_memory=self.exchange.device.type != "cpu")
            self.exchange.gather(torch.cat(shares, out=contribution), layout.size, out=gathered)
        else:
            gathered = self.exchange.gather(torch.cat(shares), layout.size)
            full = torch.empty(len(kept), layout.full_bytes, dtype=torch.uint8, pin_memory=self.pin)
        layout.assemble(stored, gathered, full)
        self.counters.add(Metric.SHARE_LOADED_BYTES, layout.object_bytes * len(kept))
        self.counters.add(per_rank(rank, Metric.LOADED_BYTES), layout.object_bytes * len(kept))
        self.counters.add(Metric.SHARE_EXCHANGED_BYTES, layout.share_bytes * (layout.size - 1) * len(kept))
        self.inner.run([commands[i] for i in kept], list(full.unbind(0)), report)
