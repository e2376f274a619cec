"""The drop routes: a `Drop` deletes this rank's copy of a chunk in one tier (the disk's LRU, a copy found corrupt on
some rank). It answers ok whether or not there was a copy; a disk unlink runs here, a remote delete in the background
(nothing waits for it)."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from ..commands import Drop, Route, Tier
from ..tier import TierResult
from .context import RouteContext


class Deleter(Protocol):
    """What a drop uses of a tier's route: its delete, and whether that is cheap enough for the model's thread."""

    deletes_inline: bool

    def delete(self, name: str) -> TierResult: ...


class DropRoute:
    """Drops of one rank, each deleted by the route that holds its tier (so a tier swapped on that route is the one
    deleted from)."""

    batched = False
    tier = None  # it holds no tier of its own: `deleters` do

    def __init__(self, context: RouteContext, deleters: Mapping[Tier, Deleter]) -> None:
        self.context = context
        self.deleters = dict(deleters)
        self.routes: frozenset[Route] = frozenset(Drop.route_from(tier) for tier in deleters)

    def submit(self, batch: Sequence[Drop]) -> None:
        context = self.context
        for command in batch:
            deleter = self.deleters[command.tier]
            name = command.key.storage_name(context.rank)
            if deleter.deletes_inline:
                context.report(command.cmd_id, deleter.delete(name))
            else:
                context.background.submit(context.guarded, command.cmd_id, deleter.delete, name)

    def close(self) -> None:
        """The tiers are their routes' to close."""
