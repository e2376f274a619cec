"""P/D through the node cache: what a prefill engine tells the decode engine of one node in a request's
`kv_transfer_params` (under `adapter.HANDOFF_PARAMS_KEY`, a key no P/D connector uses).

The proxy sends the prefill engine `{"lmcache_npu_node_pd": {"do_remote_decode": true}}` (the ask, as in vLLM's toy
P/D proxy); the prefill engine stores the prompt's chunks, its partial last chunk included, in the node cache and
answers with a `Handoff`: the chunks' hashes and the writer (its engine name and its lease's public id). The proxy
passes that to the decode engine, which waits for the chunks the writer is still storing (pending hits, under the
writer's live lease only) instead of computing them. The decode engine keys the prompt itself and loads only chunks
whose keys equal the hand-off's, so a hand-off can make it wait, never load another prompt's KV.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ...store.commands import Store
from ...store.index.contract import ChunkManager, LookupResult, Writer
from ...store.keys import ChunkKey, tail_chunk_key
from ...store.metrics import Metric
from ...store.tier import TierCounters
from . import adapter

logger = logging.getLogger(__name__)

ASK = "do_remote_decode"
MAX_CHUNKS = 1 << 16  # a 8M-token prompt of 128-token chunks: more is not a hand-off this engine made
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Handoff:
    """What the prefill engine stored for one prompt: the hashes of chunks 0.. (in order), the prompt's partial last
    chunk's hash (None when the prompt ends on a chunk boundary or the tail was not stored), under `namespace`, by
    `writer`."""

    writer: Writer
    namespace: str
    prompt_tokens: int
    chunk_hashes: tuple[bytes, ...]
    tail_hash: Optional[bytes]

    def to_params(self) -> dict[str, Any]:
        """As kv_transfer_params carry it (JSON: hex strings)."""
        return {"writer": list(self.writer), "namespace": self.namespace, "prompt_tokens": self.prompt_tokens,
                "chunks": [h.hex() for h in self.chunk_hashes],
                "tail": None if self.tail_hash is None else self.tail_hash.hex()}

    @classmethod
    def from_params(cls, value: Any) -> "Handoff":
        """A hand-off as a prefill engine wrote it; anything else is a ValueError naming the field and the rule."""
        if not isinstance(value, dict):
            raise ValueError(f"a hand-off must be an object, got {type(value).__name__}")
        missing = {"writer", "namespace", "prompt_tokens", "chunks", "tail"} - set(value)
        if missing:
            raise ValueError(f"a hand-off needs {', '.join(sorted(missing))}")
        writer = value["writer"]
        if (not isinstance(writer, list) or len(writer) != 2 or not all(isinstance(part, str) for part in writer)
                or not writer[0] or len(writer[0]) > 256 or not _is_hex(writer[1], 16)):
            raise ValueError(f"a hand-off's writer must be [engine name, lease id (32 hex characters)], got {writer!r}")
        namespace = value["namespace"]
        if not isinstance(namespace, str) or not _is_hex(namespace, 16):
            raise ValueError(f"a hand-off's namespace must be 32 hex characters, got {namespace!r}")
        tokens = value["prompt_tokens"]
        if type(tokens) is not int or tokens < 1:
            raise ValueError(f"a hand-off's prompt_tokens must be an int >= 1, got {tokens!r}")
        chunks = value["chunks"]
        if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
            raise ValueError(f"a hand-off's chunks must be a list of at most {MAX_CHUNKS} hex hashes")
        tail = value["tail"]
        for name, text in [*(("chunks", c) for c in chunks), *((("tail", tail),) if tail is not None else ())]:
            if not isinstance(text, str) or not 16 <= len(text) <= 256 or len(text) % 2 or not _HEX.fullmatch(text):
                raise ValueError(f"a hand-off's {name} must hold hashes as even-length hex strings of 16-256 "
                                 f"characters, got {text!r}")
        return cls((writer[0], writer[1]), namespace, tokens, tuple(bytes.fromhex(c) for c in chunks),
                   None if tail is None else bytes.fromhex(tail))


def _is_hex(text: str, num_bytes: int) -> bool:
    return len(text) == 2 * num_bytes and _HEX.fullmatch(text) is not None


def is_ask(value: Any) -> bool:
    """The proxy asks the prefill engine for a hand-off (`{"do_remote_decode": true}`)."""
    return isinstance(value, dict) and value.get(ASK) is True and "chunks" not in value


@dataclass
class Receiving:
    """A decode request's hand-off: the keys of chunks 0.. it may load (None until the scheduler had the geometry to
    key the prompt), whether its hit may end inside a chunk, and the wait for the writer's stores in flight."""

    handoff: Handoff
    keys: Optional[list[ChunkKey]] = None
    through: bool = False
    since: Optional[float] = None  # its first 'ask again' while the prefill engine was still storing
    waited_out: bool = False  # handoff_wait_ms passed with chunks still missing: they are computed


class HandoffDesk:
    """The scheduler half's P/D hand-offs through the node cache: reading a request's params, keying what a decode
    request may load, the deadline of its wait, the prefill side's tail chunk and its answer. Holds no request state
    itself (the scheduler's request state does); set up with the geometry once the workers' plans arrived."""

    def __init__(self, counters: TierCounters, wait_ms: int) -> None:
        self.counters = counters
        self.wait_s = wait_ms / 1000
        self.namespace = ""
        self.chunk_tokens = 0
        self.hash_block_size = 0
        self.plain = False  # every moved group keeps each token's row in whole blocks: a hit may end inside a chunk
        self._warned_no_writer = False

    def set_geometry(self, namespace: str, chunk_tokens: int, hash_block_size: int, plain: bool) -> None:
        self.namespace, self.chunk_tokens, self.hash_block_size, self.plain = (namespace, chunk_tokens,
                                                                               hash_block_size, plain)

    def read(self, request: Any) -> tuple[bool, Optional[Receiving]]:
        """(the request asks this prefill engine for a hand-off, the hand-off a decode request carries)."""
        params = adapter.handoff_params(request)
        if params is None or is_ask(params):
            return params is not None, None
        try:
            return False, Receiving(Handoff.from_params(params))
        except ValueError as exc:  # a client's or proxy's mistake: the request is served, its prompt computed
            self._refuse(request, f"kv_transfer_params[{adapter.HANDOFF_PARAMS_KEY!r}] is not a hand-off this plugin "
                                  f"made: {exc}")
            return False, None

    def _refuse(self, request: Any, why: str) -> None:
        self.counters.add(Metric.HANDOFFS_REFUSED)
        logger.warning("lmcache_npu: request %s: its P/D hand-off is not used (%s); looked up as any request",
                       request.request_id, why)

    def tail_key(self, request: Any, adapter_digest: Optional[bytes]) -> Optional[ChunkKey]:
        """The key of the prompt's partial last chunk, where one is stored for a hand-off (plain groups only: a
        windowed or compressed group's rows of a partial chunk are not those a hit ending there needs)."""
        if not self.plain or adapter.has_multimodal_inputs(request):
            return None
        num_prompt, token_ids = adapter.prompt_tokens(request)
        return tail_chunk_key(request.block_hashes, self.hash_block_size, self.chunk_tokens, self.namespace,
                              token_ids, num_prompt, adapter_digest=adapter_digest)

    def full_chunks(self, request: Any) -> int:
        """How many whole prompt chunks a hand-off names (plain groups: every one; otherwise those before the last
        token, which vLLM computes)."""
        num_prompt, chunk = int(request.num_prompt_tokens), self.chunk_tokens
        if chunk == 0:  # no geometry yet: nothing is stored or looked up
            return 0
        return num_prompt // chunk if self.plain else (num_prompt - 1) // chunk

    def settle(self, receiving: Receiving, request: Any, own: Sequence[ChunkKey],
               adapter_digest: Optional[bytes]) -> bool:
        """Keys `receiving` with this engine's own keys of the prompt (`own`: its whole chunks), as far as they equal
        the hand-off's (never a key the hand-off names alone), its tail included where it matches; False (counted,
        logged) where the hand-off is of no use to this request."""
        handoff = receiving.handoff
        num_prompt = int(request.num_prompt_tokens)
        keys: list[ChunkKey] = []
        if handoff.namespace != self.namespace:
            why = f"it is of namespace {handoff.namespace}, this engine's is {self.namespace} (another model or layout)"
        elif handoff.prompt_tokens != num_prompt or request.num_tokens != num_prompt:
            why = f"it names a {handoff.prompt_tokens}-token prompt, this request holds {request.num_tokens} tokens"
        else:
            why = ""
            for key, told in zip(own, handoff.chunk_hashes):
                if key.chunk_hash != told:
                    break
                keys.append(key)
            tail = self.tail_key(request, adapter_digest) if len(keys) == len(own) else None
            if tail is not None and tail.chunk_hash == handoff.tail_hash:
                keys.append(tail)
            if not keys and (handoff.chunk_hashes or handoff.tail_hash is not None):
                why = "none of its chunks is named as this engine names the prompt (PYTHONHASHSEED or hashing differ)"
        if why:
            self._refuse(request, why)
            return False
        receiving.keys, receiving.through = keys, self.plain
        return True

    def lookup(self, index: ChunkManager, receiving: Receiving, request: Any,
               num_computed_tokens: int) -> tuple[Optional[int], list[ChunkKey], LookupResult]:
        """(hit tokens, None to ask again; the hit's keys from chunk num_computed_tokens // chunk_tokens on; the
        index's answer) for a settled decode request: the writer's stores in flight are pending hits until the wait
        ends; the hit may end one token before the prompt's end where `through` (vLLM computes that token)."""
        first = num_computed_tokens // self.chunk_tokens
        keys = (receiving.keys or [])[first:]
        now = time.monotonic()
        awaiting = self.awaiting(receiving, now)
        result = (index.lookup_awaiting(request.request_id, keys, receiving.handoff.writer) if awaiting and keys
                  else index.lookup(request.request_id, keys))
        if self.answered(receiving, request.request_id, result, awaiting, len(keys), now):
            return None, [], result
        end = (first + result.ready_chunks) * self.chunk_tokens
        hit = (min(end, request.num_tokens - 1) if receiving.through else end) - num_computed_tokens
        return (hit if result.ready_chunks else 0), keys[:result.ready_chunks], result

    def store_tail(self, index: ChunkManager, request: Any,
                   adapter_digest: Optional[bytes]) -> tuple[Optional[ChunkKey], list[Store]]:
        """(the tail's key where it is stored or held, the store commands) of a computed hand-off prompt."""
        key = self.tail_key(request, adapter_digest)
        if key is None:
            return None, []
        commands = index.prepare_store(request.request_id, [(int(request.num_prompt_tokens) // self.chunk_tokens,
                                                             key)])
        self.counters.add(Metric.HANDOFF_TAIL_CHUNKS, len(commands))
        return (key if commands or index.presence([key], remote=False)[0] else None), commands

    def awaiting(self, receiving: Receiving, now: float) -> bool:
        """Whether a lookup still waits for the writer's stores in flight (until `wait_s` after the first wait)."""
        return not receiving.waited_out and (receiving.since is None or now - receiving.since < self.wait_s)

    def answered(self, receiving: Receiving, request_id: str, result: LookupResult, awaiting: bool, wanted: int,
                 now: float) -> bool:
        """After a lookup of `wanted` chunks: True to ask again (the writer is still storing some, within the wait);
        past the wait, what is missing is given up once (counted, logged) and computed."""
        if result.pending and awaiting:
            if receiving.since is None:
                receiving.since = now
            self.counters.add(Metric.HANDOFF_WAITS)
            return True
        if not awaiting and not receiving.waited_out and result.ready_chunks < wanted:
            receiving.waited_out = True
            self.counters.add(Metric.HANDOFFS_EXPIRED)
            logger.warning("lmcache_npu: request %s: %d of its %d hand-off chunks were not stored within "
                           "handoff_wait_ms=%d; they are computed", request_id, wanted - result.ready_chunks,
                           wanted, round(self.wait_s * 1000))
        return False

    def params(self, index: Optional[ChunkManager], request: Any, keys: Sequence[ChunkKey],
               tail: Optional[ChunkKey]) -> Optional[dict[str, Any]]:
        """What a finished hand-off request tells its decode engine (kv_transfer_params): its whole prompt chunks'
        hashes and the stored tail's, under this engine's lease; None where no other engine can read its stores."""
        writer = None if index is None else index.handoff_writer()
        if writer is None:
            if not self._warned_no_writer:
                self._warned_no_writer = True
                logger.warning("lmcache_npu: a request asked for a P/D hand-off through the node cache, but this "
                               "engine has no node cache attached (node_cache): its decode engine computes the prompt")
            return None
        self.counters.add(Metric.HANDOFFS_SENT)
        handoff = Handoff(writer, self.namespace, int(request.num_prompt_tokens), tuple(k.chunk_hash for k in keys),
                          None if tail is None else tail.chunk_hash)
        return {adapter.HANDOFF_PARAMS_KEY: handoff.to_params()}
