"""What an engine and the node cache tell each other when an engine's process attaches (plain values, see wire.py).

Every later request is a tuple `(verb, *arguments)` of the manager contract's verbs (`store/index/contract.py`);
every reply is `("ok", value, counters, tier_changes)` or `("error", kind, text)`, a tier change being
`(chunk hash, tier, entered)` of the pool's namespace. The hot verbs carry keys as a batch, `namespace, [chunk hash]`
(the namespace once: pickling a 128K-token prompt's 512 named tuples cost a millisecond), and device commands as
`(command id, slot, chunk number, chunk hash)`:
- `("lookup", request_id, namespace, hashes[, writer])` -> LookupResult (`writer`: (engine, lease id) whose stores
  in flight are pending hits, a P/D hand-off's prefill engine); `("presence", namespace, hashes, remote)` -> [bool]
- `("prepare_load" | "prepare_store", request_id, namespace, chunk_numbers, hashes)` -> [command tuple]
- `("release", request_id)` and `("on_completions", [(command id, rank, ok, reason)])`: one-way, no reply
- `("join", lease token)`, from a worker: binds its connection to its scheduler's lease -> bool
- `("events", wanted)`, `("occupancy",)`, `("location", ChunkKey)`, `("chunks",)`, `("adopt_disk", [ChunkKey])`,
  `("drop_disk_copies", [ChunkKey])`: rare, plain values.

Attach and Attached say the protocol version each side speaks (`PROTOCOL_VERSION`): the service refuses an engine of
another version (it answers `Refused` naming both), and an engine refuses a service that answers with another, so a
DaemonSet upgraded apart from its engines means misses, never a verb or a reply one side cannot read.

A first message `("ping",)` instead of an Attach is answered `("pong", {version, epoch, ...})` (probes), and
`(HANDOVER, protocol, drain seconds)` from a process of the service's own uid starts a planned hand-over to it
(handover.py). Before it closes a worker's connection for good, a service that handed its pools over sends the worker
`(HANDOVER, [epochs])`: those epochs live on in its successor, so the worker keeps its mapping and attaches again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# bumped whenever a verb, its arguments or its reply change; messages from before it existed carry none (version 1)
PROTOCOL_VERSION = 3
UNVERSIONED = 1
HANDOVER = "handover"
# how an engine's weights are named (engine_identity.py): by their content, by the operator's model_fingerprint, or
# by nothing; the node keeps chunks beyond the engine and shares them, so it takes only weights something names
WEIGHTS_CONTENT, WEIGHTS_NAMED, WEIGHTS_UNNAMED = "sha256", "named", "unnamed"
NAMED_WEIGHTS = frozenset({WEIGHTS_CONTENT, WEIGHTS_NAMED})


class Verb(StrEnum):
    """The first element of an attached engine's request: the client sends `verb.value` (the closed encoding carries
    plain strings) and the service's table (verbs.VERBS) is keyed by it. A verb named like a `ChunkManager` method runs
    that method on the pool's index; `DESCRIBE`, `EVENTS` and `SYNC` are the node cache's own."""

    LOOKUP = "lookup"
    PRESENCE = "presence"
    PREPARE_LOAD = "prepare_load"
    PREPARE_STORE = "prepare_store"
    RELEASE = "release"
    ON_COMPLETIONS = "on_completions"
    DESCRIBE = "describe"
    EVENTS = "events"
    SYNC = "sync"
    OCCUPANCY = "occupancy"
    LOCATION = "location"
    CHUNKS = "chunks"
    ADOPT_DISK = "adopt_disk"
    DROP_DISK_COPIES = "drop_disk_copies"


# the engine does not wait for these: their counters ride the next reply
ONEWAY = frozenset({Verb.RELEASE, Verb.ON_COMPLETIONS, Verb.DESCRIBE})


@dataclass(frozen=True)
class PoolGeometry:
    """What makes two engines' chunks interchangeable: the same namespace (model and layout), as many ranks, and the
    same bytes per rank and chunk. Engines of one geometry share a pool of slots; others get a pool of their own."""

    namespace: str
    layout_fingerprint: bytes
    world: int
    object_bytes: int
    chunk_tokens: int

    def describe(self) -> str:
        return (f"namespace {self.namespace}, {self.world} rank(s), {self.object_bytes} B per rank and "
                f"{self.chunk_tokens}-token chunk")


@dataclass(frozen=True)
class Attach:
    """The first message on a connection. `engine` names the engine (its KV transfer engine id and data-parallel
    rank): its scheduler and every worker attach under it, and what the engine holds is released once the last of
    its connections closes. `rank` is a worker's rank (None: the scheduler). `weights` says how the engine's model
    identity names its weights (`WEIGHTS_*`); the service takes only named ones. `lease` is the token the service
    issued the engine's scheduler (`Attached.lease`): a scheduler presents it when it attaches again, a worker to be
    bound to that lease (one that has none yet joins it later, with the `join` verb, when the scheduler's step names
    it); what the engine holds is released once its scheduler's connection and those of its bound workers close."""

    engine: str
    geometry: PoolGeometry
    rank: int | None = None
    events: bool = False  # the scheduler publishes vLLM KV events: send it the pool's tier changes
    weights: str = WEIGHTS_UNNAMED  # an engine that does not say is taken for one whose weights nothing names
    protocol: int = PROTOCOL_VERSION
    lease: str = ""


@dataclass(frozen=True)
class Attached:
    """The service's answer: the pool's arena (a worker also receives its rank's segment files beside this message,
    in segment order) and what the scheduler side needs to know of it. `epoch` changes whenever the service or the
    pool is new: a worker whose mapping is of another epoch maps again before it moves a byte."""

    epoch: str
    num_slots: int
    object_bytes: int
    segment_bytes: int
    hugepages: str
    disk_chunks: int
    eviction_policy: str
    protocol: int = PROTOCOL_VERSION
    lease: str = ""  # the engine's lease token: to a scheduler, and to a worker that presented it


@dataclass(frozen=True)
class Refused:
    """The service will not take this engine (a geometry for which no pool is left, a protocol version it does not
    speak); `reason` says which and what to change."""

    reason: str


def protocol_of(message: Any) -> int:
    """The protocol version a received Attach or Attached was made with: an unpickled message of a peer that did not
    know the field has none of its own (the class default would wrongly answer for it), so it counts as UNVERSIONED."""
    version = vars(message).get("protocol", UNVERSIONED)
    return version if type(version) is int else UNVERSIONED


def lease_id(token: str) -> str:
    """The public name of a lease (32 hex chars): another engine names it to wait for that lease's stores; the token
    itself binds workers to the lease, so it never leaves the engine."""
    return hashlib.sha256(b"lmcache-npu lease id\x00" + token.encode()).hexdigest()[:32]
