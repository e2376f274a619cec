"""The shapes of the service's replies, checked before any of a reply is used: a reply of another shape (another
release, a bug in the service) is a counted miss in the client, never an exception in vLLM's scheduler."""

from __future__ import annotations

from typing import Any

from ..store.commands import Tier
from ..store.index.contract import ChunkView, DiskState, LookupResult, SlotState
from .messages import Attached


def none(value: Any) -> bool:
    return value is None


def is_int(value: Any) -> bool:
    return type(value) is int


def is_error(reply: Any) -> bool:
    return type(reply) is tuple and len(reply) == 3 and reply[0] == "error" and isinstance(reply[2], str)


def is_ok(reply: Any) -> bool:
    """("ok", value, {counter name: int}, [(chunk hash, tier, entered, payload or None)]); the counters are what the
    engine's calls moved, never less than 0: the engine adds them to counters it exports, which never go back."""
    if type(reply) is not tuple or len(reply) != 4 or reply[0] != "ok":
        return False
    _, _, counters, changes = reply
    return (type(counters) is dict and all(type(k) is str and count(v) for k, v in counters.items())
            and type(changes) is list and all(
                type(c) is tuple and len(c) == 4 and type(c[0]) is bytes and isinstance(c[1], Tier)
                and type(c[2]) is bool and (c[3] is None or type(c[3]) is tuple) for c in changes))


def attached(attached: Attached) -> bool:
    sizes = (attached.num_slots, attached.object_bytes, attached.segment_bytes, attached.disk_chunks)
    return (type(attached.epoch) is str and all(is_int(size) and size >= 0 for size in sizes)
            and type(attached.hugepages) is str and type(attached.eviction_policy) is str)


def describe(reply: Any) -> str:
    if type(reply) is not tuple:
        return f"a {type(reply).__name__}, not a tuple"
    head = reply[0] if reply else None
    if head in ("ok", "error"):
        return f"{head!r} with {len(reply) - 1} value(s) of an unexpected shape"
    return f"a tuple of {len(reply)} starting {head!r}"


def lookup_result(count: int, value: Any) -> bool:
    return (isinstance(value, LookupResult) and is_int(value.hit_chunks) and is_int(value.ready_chunks)
            and 0 <= value.ready_chunks <= value.hit_chunks <= count and type(value.sources) is tuple
            and len(value.sources) <= value.hit_chunks and all(isinstance(t, Tier) for t in value.sources))


def bools(count: int, value: Any) -> bool:
    return type(value) is list and len(value) == count and set(map(type, value)) <= {bool}  # map/set: C speed


def moves(hashes: set[bytes], num_slots: int, value: Any) -> bool:
    """(command id, slot, chunk number, chunk hash) of the chunks asked for, each in a slot the pool has (checked
    column by column: 512 moves in some microseconds)."""
    if type(value) is not list or not value:
        return type(value) is list
    if set(map(type, value)) != {tuple} or set(map(len, value)) != {4}:
        return False
    ids, slots, numbers, named = zip(*value)
    return (set(map(type, ids)) == set(map(type, slots)) == set(map(type, numbers)) == {int}
            and 0 <= min(slots) and max(slots) < num_slots and set(named) <= hashes)


def occupancy(value: Any) -> bool:
    return type(value) is dict and {Tier.ARENA, Tier.DISK} <= value.keys() and all(
        isinstance(tier, Tier) and type(use) is tuple and len(use) == 2 and all(map(is_int, use))
        for tier, use in value.items())


def location(value: Any) -> bool:
    return (type(value) is tuple and len(value) == 3 and (value[0] is None or is_int(value[0]))
            and isinstance(value[1], SlotState) and isinstance(value[2], DiskState))


def chunk_views(value: Any) -> bool:
    return type(value) is list and all(isinstance(view, ChunkView) for view in value)


def count(value: Any) -> bool:
    return is_int(value) and value >= 0
