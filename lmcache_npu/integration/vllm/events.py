"""KV-cache events for routers (issue 24): which prefixes this instance holds behind the device cache.

vLLM's scheduler asks its connector for events every step (`take_events`) and publishes them with its own; the
index, in the scheduler process, tells `KVEvents.on_tier_change` when a chunk becomes readable in a tier or stops
being so, and the events name the chunk as vLLM names its blocks. What is announced, the names, media and bounds:
docs/storage.md §6a.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ...checks import check_int, hash_blocks_per_chunk
from ...store.commands import Tier
from ...store.keys import ChunkKey
from ...store.tier import TierCounters
from ...store.metrics import Metric

logger = logging.getLogger(__name__)

# a tier -> (vLLM event medium, locality where vLLM's events carry one)
MEDIUMS: dict[Tier, tuple[str, str]] = {
    Tier.ARENA: ("CPU", "LOCAL"),
    Tier.DISK: ("STORAGE", "LOCAL"),
    Tier.REMOTE: ("MOONCAKE", "REMOTE"),
}
DEFAULT_MAX_EVENTS = 100_000
_LOW_64_BITS = (1 << 64) - 1
# payloads kept beyond the chunks the tiers can hold: room for stores and promotions in flight
PAYLOAD_SLACK = 1024


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (`--kv-events-config` with enable_kv_cache_events)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


@dataclass(frozen=True)
class ChunkPayload:
    """What a router needs to match a chunk to its own block hashes, taken from the request that made or asked for
    it (hashes already as events carry them; token ids as a compact int array: one is kept per chunk a tier
    holds, and vLLM's token ids fit 32 bits)."""

    block_hashes: tuple[Any, ...]
    parent_block_hash: Optional[Any]
    token_ids: array
    lora_id: Optional[int]
    lora_name: Optional[str]

    def to_plain(self) -> tuple:
        """Builtins only: how the node cache carries a payload to the other engines of the node."""
        return (self.block_hashes, self.parent_block_hash, self.token_ids.tobytes(), self.lora_id, self.lora_name)

    @classmethod
    def from_plain(cls, plain: tuple) -> "ChunkPayload":
        hashes, parent, token_bytes, lora_id, lora_name = plain
        token_ids = array("i")
        token_ids.frombytes(token_bytes)
        return cls(tuple(hashes), parent, token_ids, lora_id, lora_name)


def chunk_payload(request: Any, chunk_index: int, chunk_tokens: int, hash_block_size: int,
                  convert: Callable[[bytes], Any] = bytes) -> ChunkPayload:
    """The payload of the request's chunk `chunk_index` (its hash blocks must exist: the chunk is complete), with
    each block hash passed through `convert` (the event form)."""
    check_int("chunk_index", chunk_index, lo=0)
    per_chunk = hash_blocks_per_chunk(chunk_tokens, hash_block_size)
    first, end = chunk_index * per_chunk, (chunk_index + 1) * per_chunk
    hashes = request.block_hashes
    if len(hashes) < end:
        raise ValueError(f"request {request.request_id!r} chunk {chunk_index} needs block hashes up to {end}, "
                         f"vLLM has computed {len(hashes)}")
    lora = getattr(request, "lora_request", None)
    return ChunkPayload(
        block_hashes=tuple(convert(bytes(h)) for h in hashes[first:end]),
        parent_block_hash=convert(bytes(hashes[first - 1])) if first > 0 else None,
        token_ids=array("i", request.all_token_ids[chunk_index * chunk_tokens:(chunk_index + 1) * chunk_tokens]),
        lora_id=getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None)) if lora is not None else None,
        lora_name=getattr(lora, "name", getattr(lora, "lora_name", None)) if lora is not None else None,
    )


class KVEvents:
    """Turns the index's tier changes into vLLM `BlockStored` / `BlockRemoved` events, buffered until vLLM's
    scheduler takes them. `group_idx` is the KV-cache group the events name (None: the chunk holds every group of
    a hybrid model); `max_payloads` bounds the remembered chunks (at least what every tier holds)."""

    def __init__(self, chunk_tokens: int, hash_block_size: int, max_payloads: int, group_idx: Optional[int] = 0,
                 max_events: int = DEFAULT_MAX_EVENTS,
                 on_remember: Optional[Callable[[ChunkKey, ChunkPayload], None]] = None) -> None:
        hash_blocks_per_chunk(chunk_tokens, hash_block_size)
        if max_payloads < 1 or max_events < 1:
            raise ValueError(f"KV events need max_payloads >= 1 and max_events >= 1 "
                             f"(got {max_payloads}, {max_events})")
        from vllm.distributed import kv_events

        self._stored_cls = kv_events.BlockStored
        self._removed_cls = kv_events.BlockRemoved
        self._stored_fields = set(kv_events.BlockStored.__struct_fields__)
        self._removed_fields = set(kv_events.BlockRemoved.__struct_fields__)
        self._convert = _hash_converter()
        self.chunk_tokens = chunk_tokens
        self.hash_block_size = hash_block_size
        self.group_idx = group_idx
        self.max_payloads = max_payloads
        self._payloads: OrderedDict[ChunkKey, ChunkPayload] = OrderedDict()  # oldest remembered first
        self._announced: dict[ChunkKey, set[Tier]] = {}  # key -> local tiers a BlockStored told routers of
        self._remote_announced: OrderedDict[ChunkKey, None] = OrderedDict()  # never removed, so kept bounded
        self._queue: deque[Any] = deque()
        self._max_events = max_events
        self._warned_drop = False
        self.counters = TierCounters()
        # the node cache: what this engine remembers is told to the node, so every engine of it can name the chunk
        self._on_remember = on_remember

    def remember(self, key: ChunkKey, request: Any, chunk_index: int) -> None:
        """The request's chunk `chunk_index` is stored or promoted under `key`: keep what its events will say."""
        if key in self._payloads:
            self._payloads.move_to_end(key)
            return
        payload = self._payloads[key] = chunk_payload(request, chunk_index, self.chunk_tokens, self.hash_block_size,
                                                      self._convert)
        self._trim_payloads()
        if self._on_remember is not None:
            self._on_remember(key, payload)

    def adopt(self, key: ChunkKey, payload: ChunkPayload) -> None:
        """Another engine of the node cache remembered `key`: this one names it too when it enters a tier."""
        if key not in self._payloads:
            self._payloads[key] = payload
            self._trim_payloads()

    def on_tier_change(self, key: ChunkKey, tier: Tier, entered: bool) -> None:
        """The index's listener: one event per change of an announced chunk."""
        if tier not in MEDIUMS:
            raise ValueError(f"unknown tier {tier!r}; the index names one of {', '.join(MEDIUMS)}")
        tier = Tier(tier)
        if tier is Tier.REMOTE:
            if entered:
                self._announce_remote(key)
            return
        tiers = self._announced.get(key)
        if not entered:
            if tiers is None or tier not in tiers:
                return  # never announced there (no payload when it entered)
            tiers.discard(tier)
            if not tiers:
                del self._announced[key]
            self._push(self._removed(self._payloads[key], tier))
            return
        if tiers is not None and tier in tiers:
            return
        payload = self._payloads.get(key)
        if payload is None:
            self.counters.add(Metric.UNNAMED)
            return
        self._payloads.move_to_end(key)
        self._announced.setdefault(key, set()).add(tier)
        self._push(self._stored(payload, tier))

    def take(self) -> list[Any]:
        """The events since the last call, oldest first (vLLM's scheduler calls this every step)."""
        events = list(self._queue)
        self._queue.clear()
        return events

    def announced(self, key: ChunkKey) -> frozenset[Tier]:
        """The tiers routers were told hold `key` and not told it left."""
        local = self._announced.get(key, set())
        return frozenset(local | ({Tier.REMOTE} if key in self._remote_announced else set()))

    @property
    def remembered(self) -> int:
        return len(self._payloads)

    # ---- internals ----------------------------------------------------------------------------------------------

    def _announce_remote(self, key: ChunkKey) -> None:
        if key in self._remote_announced:
            self._remote_announced.move_to_end(key)
            return
        payload = self._payloads.get(key)
        if payload is None:
            self.counters.add(Metric.UNNAMED)
            return
        self._remote_announced[key] = None
        while len(self._remote_announced) > self.max_payloads:
            self._remote_announced.popitem(last=False)  # forgotten: announced again if put again
        self._push(self._stored(payload, Tier.REMOTE))

    def _trim_payloads(self) -> None:
        """Forgets the oldest payloads of chunks no local tier announced (an announced one is needed for its
        removal); a store that failed leaves such a payload behind."""
        if len(self._payloads) <= self.max_payloads:
            return
        for key in list(self._payloads):
            if len(self._payloads) <= self.max_payloads:
                break
            if key not in self._announced:
                del self._payloads[key]

    def _push(self, event: Any) -> None:
        if len(self._queue) >= self._max_events:
            self._queue.popleft()
            self.counters.add(Metric.DROPPED)
            if not self._warned_drop:
                self._warned_drop = True
                logger.warning("lmcache_npu: more than %d KV events waited for vLLM's scheduler; dropping the oldest "
                               "(routers may hold a stale view of this instance)", self._max_events)
        self._queue.append(event)
        self.counters.add(Metric.PUBLISHED)

    def _stored(self, payload: ChunkPayload, tier: Tier) -> Any:
        medium, locality = MEDIUMS[tier]
        fields = dict(
            block_hashes=list(payload.block_hashes),
            parent_block_hash=payload.parent_block_hash,
            token_ids=payload.token_ids.tolist(),
            block_size=self.hash_block_size,
            lora_id=payload.lora_id,
            medium=medium,
            lora_name=payload.lora_name,
            group_idx=self.group_idx,
            locality=locality,
        )
        return self._stored_cls(**{k: v for k, v in fields.items() if k in self._stored_fields})

    def _removed(self, payload: ChunkPayload, tier: Tier) -> Any:
        medium, locality = MEDIUMS[tier]
        fields = dict(block_hashes=list(payload.block_hashes), medium=medium,
                      group_idx=self.group_idx, locality=locality)
        return self._removed_cls(**{k: v for k, v in fields.items() if k in self._removed_fields})


def _hash_converter() -> Callable[[bytes], Any]:
    """A block hash as vLLM's block-pool events carry it: with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (on by default)
    its low 64 bits as a big-endian int, else the bytes. vLLM reads the switch on every call; it cannot change in a
    running engine, so it is read once here (per call it cost more than building the event)."""
    try:
        from vllm import envs

        as_int = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    except (ImportError, AttributeError):  # an era without the switch publishes raw bytes
        return bytes
    if not as_int:
        return bytes
    return lambda block_hash: int.from_bytes(block_hash, "big") & _LOW_64_BITS
