"""A router's view of the plugin's KV events checked against its index: shared by the simulated-engine tests
(tests/integration/test_events.py) and the real-engine test (tests/engines/test_kv_events.py). `RouterView` is the
test oracle: what a router replaying the stream believes the instance holds."""

from __future__ import annotations

from typing import Any

from lmcache_npu.integration.vllm.events import MEDIUMS
from lmcache_npu.store.index.contract import SlotState



class RouterView:
    """What a router reading an event stream believes this instance holds: per medium, each announced chunk (its
    block hashes) with a count, since vLLM asks consumers to reference-count repeated announcements. Replaying a
    stream here checks it: a removal of something never stored is an error naming it."""

    def __init__(self) -> None:
        self._held: dict[str, dict[tuple[Any, ...], int]] = {}

    def apply(self, events: Any) -> None:
        """Replays vLLM `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events in order."""
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self._held.clear()
                continue
            if kind not in ("BlockStored", "BlockRemoved"):
                raise ValueError(f"not a vLLM KV event: {kind}")
            medium = event.medium or ""
            chunk = tuple(event.block_hashes)
            held = self._held.setdefault(medium, {})
            if kind == "BlockStored":
                held[chunk] = held.get(chunk, 0) + 1
            elif held.get(chunk, 0) <= 0:
                raise ValueError(f"BlockRemoved on {medium} of {len(chunk)} blocks ending {chunk[-1]!r} that no "
                                 f"earlier BlockStored announced")
            elif held[chunk] == 1:
                del held[chunk]
            else:
                held[chunk] -= 1

    def holds(self, medium: str) -> set[tuple[Any, ...]]:
        """The chunks (tuples of block hashes) announced on `medium` and not removed since."""
        return set(self._held.get(medium, {}))


def ours(events: list[Any]) -> list[Any]:
    """The connector's events (vLLM's block pool announces its device blocks with medium GPU or None)."""
    mediums = {m for m, _ in MEDIUMS.values()}
    return [e for e in events if getattr(e, "medium", None) in mediums]


def index_view(half: Any) -> dict[str, set[tuple[Any, ...]]]:
    """What the scheduler half's index holds per medium, named by the block hashes its events carry."""
    events, index = half.events, half.index
    held: dict[str, set[tuple[Any, ...]]] = {"CPU": set(), "STORAGE": set()}
    for key in [chunk.key for chunk in index.chunks()]:
        payload = events._payloads.get(key)
        if payload is None:
            continue
        chunk = tuple(payload.block_hashes)
        _, state, disk = index.location(key)
        if state in (SlotState.READY, SlotState.READING):
            held["CPU"].add(chunk)
        if disk.value == "present":
            held["STORAGE"].add(chunk)
    return held


def check_against_index(stream: list[Any], half: Any) -> None:
    """The stream, replayed as a router would, says exactly what the index holds in the arena and on disk."""
    view = RouterView()
    view.apply(stream)
    for medium, chunks in index_view(half).items():
        got = view.holds(medium)
        assert got == chunks, (f"{medium}: events announce {len(got)} chunks, the index holds {len(chunks)} "
                               f"({len(got - chunks)} extra, {len(chunks - got)} missing)")
