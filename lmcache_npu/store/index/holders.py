"""Who holds which chunks of a shared index (the node cache's engines): per holder, the distinct chunks its requests
reserve or load, and a cap on them, so that one engine cannot pin a pool every engine of the node shares. The index
keeps a per-chunk count of each holder's reservations and loads (`Entry.holders`); this keeps the totals."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional


class Holders:
    """`holder_of(request_id)` names who holds for a request; `cap` (None: none) is how many distinct chunks a
    holder may reserve."""

    def __init__(self, holder_of: Callable[[str], str]) -> None:
        self.holder_of = holder_of
        self.cap: Optional[int] = None
        self._held: dict[str, int] = {}  # holder -> chunks its requests reserve or load

    def held_by(self, holder: str) -> int:
        return self._held.get(holder, 0)

    def reserve(self, entry: Any, request_id: str) -> bool:
        """A reservation of `request_id` on `entry` counted; False when its holder may hold no more chunks."""
        if request_id in entry.reservations:
            return True
        if not self.may_hold(entry, request_id):
            return False
        self.hold(entry, request_id)
        return True

    def unreserve(self, entry: Any, request_id: str) -> None:
        if request_id in entry.reservations:
            self.unhold(entry, request_id)

    def may_hold(self, entry: Any, request_id: str) -> bool:
        """Whether the request's holder may hold `entry` too (one it holds already costs nothing)."""
        if self.cap is None:
            return True
        holder = self.holder_of(request_id)
        return (entry.holders is not None and holder in entry.holders) or self._held.get(holder, 0) < self.cap

    def hold(self, entry: Any, request_id: str) -> None:
        """One more reservation or load of the request's holder on `entry`."""
        holder = self.holder_of(request_id)
        if entry.holders is None:
            entry.holders = {}
        count = entry.holders.get(holder, 0)
        entry.holders[holder] = count + 1
        if not count:
            self._held[holder] = self._held.get(holder, 0) + 1

    def unhold(self, entry: Any, request_id: str) -> None:
        if entry.holders is None:
            return
        holder = self.holder_of(request_id)
        count = entry.holders.get(holder, 0) - 1
        if count > 0:
            entry.holders[holder] = count
            return
        entry.holders.pop(holder, None)
        if not entry.holders:
            entry.holders = None
        left = self._held.get(holder, 0) - 1
        if left > 0:
            self._held[holder] = left
        else:
            self._held.pop(holder, None)

    def check_invariants(self, entries: Iterable[Any]) -> None:
        """Raises AssertionError unless the totals are the chunks' own counts."""
        held: dict[str, int] = {}
        for entry in entries:
            for holder in entry.holders or ():
                held[holder] = held.get(holder, 0) + 1
        assert held == self._held, f"holders hold {held}, the index counts {self._held}"
