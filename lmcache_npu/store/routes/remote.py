"""The arena <-> remote (Mooncake) routes: consecutive gets, or puts, go as one batch and one round trip. Gets
(promotions a request waits for) run on io threads and answer ok only for bytes that verify; puts seal on a
background thread (the slot is pinned in the index until every rank completes), never on the model's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence, Union

from ..commands import ARENA_TO_REMOTE, REMOTE_TO_ARENA, Promote, Put
from ..envelope import RejectionLog
from ..tier import OK, Failure, TierResult, TierStore
from .context import RouteContext
from .guard import EnvelopeGuard

if TYPE_CHECKING:  # handed in by the factory; this module never builds a tier
    from ..mooncake import MooncakeTier

logger = logging.getLogger(__name__)


class RemoteRoute:
    """Puts and gets of one rank; `tier` is the `MooncakeTier` (None: each answers "no remote tier"). It registers
    the arena with the tier (and the segments the device runtime allocates later), so transfers need no copy."""

    routes = frozenset({REMOTE_TO_ARENA, ARENA_TO_REMOTE})
    batched = True  # one round trip per run of gets, or of puts

    def __init__(self, context: RouteContext, guard: EnvelopeGuard, remote: Optional[MooncakeTier]) -> None:
        self.context = context
        self.guard = guard
        self.tier = remote
        self.rejections = RejectionLog("mooncake")
        if remote is not None:
            arena = context.arena
            registered = [remote.register(address, nbytes) for address, nbytes in arena.registration_ranges()]
            if not arena.contiguous:  # segments the device runtime allocates later get their own registration
                arena.add_live_listener(remote.register)
            if not all(registered):
                logger.info("rank %d: the arena is not registered with the remote store; puts and gets copy",
                            context.rank)

    def submit(self, batch: Sequence[Union[Promote, Put]]) -> None:
        if isinstance(batch[0], Promote):
            self.context.io.submit(self._run, batch, True)
        else:
            self.context.background.submit(self._run, batch, False)

    @property
    def deletes_inline(self) -> bool:
        """A delete is a network round trip (a background thread's); without a tier there is nothing to wait for."""
        return self.tier is None

    def delete(self, name: str) -> TierResult:
        """Deletes this rank's object `name` (nothing to delete without a tier)."""
        if self.tier is not None:
            self.tier.delete([name])
        return OK

    def close(self) -> None:
        if isinstance(self.tier, TierStore):  # a fake without counters and close is the test's to close
            self.tier.close()

    def _run(self, batch: Sequence[Union[Promote, Put]], get: bool) -> None:
        """On an io thread, one batch of gets (promotions into the arena); on a background thread, one of puts."""
        rank, arena = self.context.rank, self.context.arena
        try:
            if self.tier is None:
                results = [TierResult.fail(Failure.NO_REMOTE_TIER)] * len(batch)
            else:
                names = [c.key.storage_name(rank) for c in batch]
                views = [arena.sealed_view(c.slot) for c in batch]
                checks = [self.guard.verifier(c.key) for c in batch]
                if get:
                    results = list(self.tier.get_into(names, views, verify=checks))
                else:
                    for command in batch:  # here, on a background thread, never on the model's
                        self.guard.seal(command.slot, command.key)
                    results = list(self.tier.put(names, views, verify=checks))
                if len(results) != len(batch):
                    raise RuntimeError(f"remote tier answered {len(results)} results for {len(batch)} chunks")
                if get:
                    for name, command, result in zip(names, batch, results):
                        if result.ok:
                            self.guard.remember(command.slot, command.key)
                        elif result.kind is Failure.REJECTED:  # the tier counted it
                            self.rejections.record(name, result.detail)
        except Exception as exc:  # the serving path turns any tier fault into failed commands
            logger.exception("rank %d: remote batch of %d raised", rank, len(batch))
            results = [TierResult.fail(Failure.ERROR, str(exc))] * len(batch)
        for command, result in zip(batch, results):
            self.context.report(command.cmd_id, result)
