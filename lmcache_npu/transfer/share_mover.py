"""`SharedMover`: the `DeviceMover` of a rank that stores only its share of replicated KV (docs/storage.md
"Replicated KV"); it wraps the rank's `KVMover`, which still moves whole chunk objects.

Store: the kernel writes the full object into scratch memory; when the batch reports, each command's own part and
this rank's share are copied into its arena slot (`ShareLayout.pack`), so the arena, disk files and Mooncake objects
hold `own + tail / tp` bytes per rank. No collective: a chunk counts as stored only once every rank completed it
(the scheduler's index already waits for all ranks), so a hit always has every share.

Load: the exchange is a collective, so it runs in `run`, on the model's thread, where every rank handles the same
commands in the same order (the scheduler sends one command list to all ranks and the executor hands the mover the
step's loads as one batch). Each rank checks its stored objects, all-reduces one ok flag per command (MIN: a share
missing on any rank fails the command on every rank), all-gathers the shares of the commands still ok, rebuilds the
full objects and queues them on the wrapped mover, which scatters them into pages. A command that failed anywhere
is reported failed on every rank and writes no row, so vLLM recomputes it. The exchange runs over a process group
of its own (never one vLLM's threads use), gloo on host memory.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..store.commands import Load, Store
from ..store.executor import Report
from ..store.tier import TierCounters, TierResult
from .shares import ShareLayout

logger = logging.getLogger(__name__)

ShareCheck = Callable[[Load, torch.Tensor], str]  # "" when the rank's stored object may be loaded, else why not


class ShareExchange:
    """The collectives of a share load over one torch.distributed process group (its ranks = the TP group's)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def agree(self, ok: Sequence[bool]) -> list[bool]:
        """Per command: ok on every rank of the group."""
        import torch.distributed as dist

        flags = torch.tensor([1 if x else 0 for x in ok], dtype=torch.int32)
        if flags.numel():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(x) for x in flags.tolist()]

    def gather(self, contribution: torch.Tensor, size: int) -> torch.Tensor:
        """Every rank's `contribution` (same length on all), concatenated in rank order."""
        import torch.distributed as dist

        out = torch.empty(size * contribution.numel(), dtype=torch.uint8)
        dist.all_gather(list(out.chunk(size)), contribution.contiguous(), group=self.group)
        return out


def _size_check(layout: ShareLayout) -> ShareCheck:
    def check(command: Load, stored: torch.Tensor) -> str:
        if stored.numel() < layout.object_bytes:
            return f"share missing: slot {command.slot} holds {stored.numel()} B of {layout.object_bytes}"
        return ""

    return check


class SharedMover:
    """Stores and loads a rank's share of each chunk through `inner` (a `KVMover` or any `DeviceMover` of whole
    objects) and `exchange`."""

    def __init__(self, inner: Any, layout: ShareLayout, exchange: ShareExchange, counters: TierCounters,
                 check: Optional[ShareCheck] = None, pin: bool = False) -> None:
        if layout.replicated_bytes == 0:
            raise ValueError("shared mover: the plan replicates no plane across the TP group; use the plain mover")
        self.inner = inner
        self.layout = layout
        self.exchange = exchange
        self.counters = counters
        self.check = check or _size_check(layout)
        self.pin = pin  # scratch objects page-locked, as the arena is, where a device copies them

    def run(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        if isinstance(commands[0], Store):
            self._store(commands, objects, report)
        else:
            self._load(commands, objects, report)  # type: ignore[arg-type]

    def _full(self) -> torch.Tensor:
        return torch.zeros(self.layout.full_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def _store(self, commands: Sequence[Union[Store, Load]], objects: Sequence[torch.Tensor], report: Report) -> None:
        scratch = [self._full() for _ in commands]
        where = {c.cmd_id: (full, stored) for c, full, stored in zip(commands, scratch, objects)}
        rank = self.layout.rank

        def packed(cmd_id: int, result: TierResult) -> None:
            if result.ok:
                full, stored = where[cmd_id]
                try:
                    self.layout.pack(full, stored)
                except Exception as exc:  # a failed copy must fail the command, never leave a half share stored
                    logger.exception("rank %d: packing the share of store %d failed", rank, cmd_id)
                    result = TierResult.fail(f"share: {exc}")
                else:
                    self.counters.add("share_stored_bytes", self.layout.object_bytes)
                    self.counters.add(f"rank{rank}_stored_bytes", self.layout.object_bytes)
            report(cmd_id, result)

        self.inner.run(commands, scratch, packed)

    def _load(self, commands: Sequence[Load], objects: Sequence[torch.Tensor], report: Report) -> None:
        layout, rank = self.layout, self.layout.rank
        local: list[str] = []
        for command, stored in zip(commands, objects):
            try:
                local.append(self.check(command, stored))
            except Exception as exc:  # a check that raises is a failed share, and the group still hears of it
                local.append(f"share check raised: {exc}")
        agreed = self.exchange.agree([not why for why in local])
        kept = [i for i, ok in enumerate(agreed) if ok]
        for i, ok in enumerate(agreed):
            if not ok:
                why = local[i] or "share missing or invalid on another rank of the TP group"
                self.counters.add("share_load_failures")
                logger.warning("rank %d: load %d refused: %s", rank, commands[i].cmd_id, why)
                report(commands[i].cmd_id, TierResult.fail(f"share: {why}"))
        if not kept:
            return
        contribution = torch.cat([layout.share_of(objects[i]) for i in kept])
        gathered = self.exchange.gather(contribution, layout.size)
        per_rank = gathered.view(layout.size, len(kept), layout.share_bytes)
        fulls = []
        for position, i in enumerate(kept):
            full = self._full()
            layout.own_part(objects[i], full)
            layout.place_gathered(per_rank[:, position, :].reshape(-1), full)
            fulls.append(full)
        self.counters.add("share_loaded_bytes", layout.object_bytes * len(kept))
        self.counters.add(f"rank{rank}_loaded_bytes", layout.object_bytes * len(kept))
        self.counters.add("share_exchanged_bytes", layout.share_bytes * (layout.size - 1) * len(kept))
        self.inner.run([commands[i] for i in kept], fulls, report)

