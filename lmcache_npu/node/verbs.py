"""The node cache's verbs: what each request of an attached engine does to its pool (`VERBS`, handler(pool, lease,
*arguments) -> the reply's value; messages.py says what each sends), and the checks of every argument a peer sent:
a wrong type or value is a ValueError naming the argument and the rule, answered as an error reply."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from itertools import repeat
from typing import Any, Callable, Optional

from ..store.commands import Completion
from ..store.index.contract import ChunkView
from ..store.keys import ChunkKey
from ..store.metrics import HIT_CHUNKS, Metric
from .messages import Verb
from .pool import ENGINE_SEPARATOR, EngineLease, NodePool, scoped

_new_key = partial(tuple.__new__, ChunkKey)  # ChunkKey(namespace, hash) without its Python-level __new__


def unscoped(text: str, engine: str) -> str:
    """`text` with the engine's scope taken off its request ids (as written and as repr() writes them)."""
    scope = scoped(engine, "")
    return text.replace(scope, "").replace(repr(scope)[1:-1], "")


def _as_seen_by(engine: str, view: ChunkView) -> ChunkView:
    """`view` as `engine` sees it: its own requests' reservations by the ids it gave, others' engine-scoped."""
    own = scoped(engine, "")
    names = frozenset(name[len(own):] if name.startswith(own) else name for name in view.reservations)
    return view if names == view.reservations else dataclasses.replace(view, reservations=names)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a request id must be a string, got {type(value).__name__}")
    if ENGINE_SEPARATOR in value:  # "A\x1fB" + "r" would be "A" + "B\x1fr": another engine's request
        raise ValueError(f"a request id may not hold \\x1f, got {value!r}")
    return value


def _keys(keys: Any, namespace: str) -> list[ChunkKey]:
    if not isinstance(keys, (list, tuple)):
        raise ValueError(f"keys must be a list, got {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, ChunkKey) or not isinstance(key.chunk_hash, bytes):
            raise ValueError(f"a key must be a ChunkKey, got {key!r}")
        if key.namespace != namespace:  # another model's or layout's chunks never meet this pool's
            raise ValueError(f"key of namespace {key.namespace!r} sent to the pool of namespace {namespace!r}")
    return list(keys)


def _hashed(pool: NodePool, namespace: Any, hashes: Any) -> list[ChunkKey]:
    """The keys a batch names: its namespace, which must be the pool's, and its chunk hashes (messages.py)."""
    if namespace != pool.geometry.namespace:  # another model's or layout's chunks never meet this pool's
        raise ValueError(f"key of namespace {namespace!r} sent to the pool of namespace {pool.geometry.namespace!r}")
    if not isinstance(hashes, list) or not set(map(type, hashes)) <= {bytes}:  # map/set: C speed for 512 hashes
        raise ValueError(f"chunk hashes must be a list of bytes, got {_shape(hashes)}")
    return list(map(_new_key, zip(repeat(pool.geometry.namespace), hashes)))


def _numbered(pool: NodePool, namespace: Any, numbers: Any, hashes: Any) -> list[tuple[int, ChunkKey]]:
    keys = _hashed(pool, namespace, hashes)
    if (not isinstance(numbers, list) or len(numbers) != len(keys) or not set(map(type, numbers)) <= {int}
            or (numbers and min(numbers) < 0)):
        raise ValueError(f"chunk numbers must be a list of ints >= 0, one per hash ({len(keys)}), got "
                         f"{_shape(numbers)}")
    return list(zip(numbers, keys))


def _shape(value: Any) -> str:
    if not isinstance(value, list):
        return type(value).__name__
    return f"a list of {len(value)} ({', '.join(sorted({type(item).__name__ for item in value}))})"


def _payload(payload: Any, chunk_tokens: int) -> tuple:
    """A chunk's event payload as `ChunkPayload.to_plain` makes it: (block hashes, parent hash, token ids as int32
    bytes, LoRA id, LoRA name)."""
    if not isinstance(payload, tuple) or len(payload) != 5:
        raise ValueError("a chunk payload is (block hashes, parent hash, token bytes, lora id, lora name)")
    hashes, parent, token_bytes, lora_id, lora_name = payload
    if (not isinstance(hashes, tuple) or len(hashes) > chunk_tokens
            or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in hashes)):
        raise ValueError("a chunk payload's block hashes must be a tuple of ints or bytes, one per hash block")
    if parent is not None and (not isinstance(parent, (int, bytes)) or isinstance(parent, bool)):
        raise ValueError("a chunk payload's parent hash must be an int, bytes or None")
    if not isinstance(token_bytes, bytes) or len(token_bytes) != 4 * chunk_tokens:
        raise ValueError(f"a chunk payload's token ids must be {chunk_tokens} int32 values")
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
        raise ValueError("a chunk payload's LoRA id must be an int or None")
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError("a chunk payload's LoRA name must be a string or None")
    return payload


def _completions(completions: Any) -> list[Completion]:
    if not isinstance(completions, list):
        raise ValueError(f"completions must be a list, got {type(completions).__name__}")
    answers = []
    for done in completions:
        if (not isinstance(done, tuple) or len(done) != 4 or set(map(type, done[:2])) != {int}
                or type(done[2]) is not bool or not isinstance(done[3], str)):
            raise ValueError(f"a completion must be (command id, rank, ok, reason), got {done!r}")
        answers.append(Completion(*done))
    return answers


# ---- the verbs: handler(pool, lease, *arguments) -> the reply's value (messages.py says what each sends) ------------

def _writer(writer: Any) -> Optional[tuple[str, str]]:
    """A lookup's awaited writer: [engine name, lease id] (messages.lease_id), or None."""
    if writer is None:
        return None
    if (not isinstance(writer, list) or len(writer) != 2 or not all(isinstance(part, str) for part in writer)
            or not writer[0] or len(writer[0]) > 256 or len(writer[1]) != 32):
        raise ValueError(f"an awaited writer must be [engine name (1-256 characters), lease id (32 hex characters)], "
                         f"got {_shape(writer)}")
    return writer[0], writer[1]


def _lookup(pool: NodePool, lease: EngineLease, request_id: Any, namespace: Any, hashes: Any,
            writer: Any = None) -> Any:
    keys = _hashed(pool, namespace, hashes)
    awaited = _writer(writer)
    name = scoped(lease.engine, _text(request_id))
    lease.looked_up[name] = time.monotonic()  # renews its reservations (LeaseLimits.reservation_ttl_s)
    if name not in lease.requests:
        lease.requests.add(name)
        pool.lookup_counters[Metric.LOOKUPS] += 1
    found = pool.call(lease, lambda: pool.index.lookup(name, pool.visible(lease, keys, awaited=awaited)))
    for tier, metric in HIT_CHUNKS.items():  # per tier, for status's hit rates (tuple.count: C speed)
        pool.lookup_counters[metric] += found.sources.count(tier)
    return found


def _presence(pool: NodePool, lease: EngineLease, namespace: Any, hashes: Any, remote: Any) -> list[bool]:
    keys = _hashed(pool, namespace, hashes)
    # as lookup will see them: nothing from another engine's store in flight on
    visible = len(pool.visible(lease, keys, count=False))
    return pool.index.presence(keys[:visible], bool(remote)) + [False] * (len(keys) - visible)


def _prepare(verb: Verb) -> Callable[..., list[tuple[int, int, int, bytes]]]:
    def prepare(pool: NodePool, lease: EngineLease, request_id: Any, namespace: Any, numbers: Any,
                hashes: Any) -> list[tuple[int, int, int, bytes]]:
        chunks = _numbered(pool, namespace, numbers, hashes)
        name = scoped(lease.engine, _text(request_id))
        return pool.hand_out(lease, pool.call(lease, lambda: getattr(pool.index, verb)(name, chunks)))

    return prepare


def prefetch(pool: NodePool, batch: Optional[tuple]) -> None:
    """The remote store's answers for a lookup's or presence's (namespace, hashes), asked without the lock
    (malformed arguments: nothing, the verb refuses them under the lock)."""
    if batch is None or len(batch) != 2:
        return
    try:
        keys = _hashed(pool, *batch)
    except ValueError:
        return
    pool.index.prefetch_remote(keys)


# the verbs that may ask the remote store: their (namespace, hashes) arguments when they will
REMOTE_KEYS: dict[Verb, Callable[[tuple], Optional[tuple]]] = {
    Verb.LOOKUP: lambda arguments: arguments[1:3],
    Verb.PRESENCE: lambda arguments: arguments[0:2] if len(arguments) == 3 and arguments[2] else None,
}


def _release(pool: NodePool, lease: EngineLease, request_id: Any) -> None:
    name = scoped(lease.engine, _text(request_id))
    pool.call(lease, lambda: pool.index.release(name))
    lease.requests.discard(name)
    lease.looked_up.pop(name, None)


VERBS: dict[Verb, Callable[..., Any]] = {
    Verb.LOOKUP: _lookup,
    Verb.PRESENCE: _presence,
    Verb.PREPARE_LOAD: _prepare(Verb.PREPARE_LOAD),
    Verb.PREPARE_STORE: _prepare(Verb.PREPARE_STORE),
    Verb.RELEASE: _release,
    Verb.ON_COMPLETIONS: lambda pool, lease, completions: pool.call(
        lease, lambda: pool.on_completions(lease, _completions(completions))),
    Verb.EVENTS: lambda pool, lease, wanted: setattr(lease, "events", bool(wanted)),
    Verb.DESCRIBE: lambda pool, lease, key, payload: pool.describe(_keys([key], pool.geometry.namespace)[0],
                                                                   _payload(payload, pool.geometry.chunk_tokens)),
    Verb.SYNC: lambda pool, lease: None,  # nothing but the reply: the counters and tier changes of one-way calls
    Verb.OCCUPANCY: lambda pool, lease: pool.index.occupancy(),
    Verb.LOCATION: lambda pool, lease, key: pool.index.location(_keys([key], pool.geometry.namespace)[0]),
    Verb.CHUNKS: lambda pool, lease: [_as_seen_by(lease.engine, view) for view in pool.index.chunks()],
    Verb.ADOPT_DISK: lambda pool, lease, keys: pool.call(
        lease, lambda: pool.index.adopt_disk(_keys(keys, pool.geometry.namespace))),
    Verb.DROP_DISK_COPIES: lambda pool, lease, keys: pool.call(
        lease, lambda: pool.index.drop_disk_copies(_keys(keys, pool.geometry.namespace))),
}
