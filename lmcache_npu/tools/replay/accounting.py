"""Where a request's prompt tokens came from: vLLM's own prefix cache, the plugin (per tier), a peer connector, or
computation.

vLLM reports one number per request, `num_cached_tokens`: its local prefix-cache hit plus what a connector loaded.
When both caches hit, vLLM takes its own hit first (block-aligned) and asks the connector only for what lies beyond
it, so the plugin's share is exactly the `num_external_tokens` vLLM passes to the connector's
`update_state_after_alloc`, and vLLM's own share is the rest. `HitLedger` records those calls in-process, per tier
(the chunk sources the scheduler half counted), and a turn's tokens split as `split_hits` says. A peer connector
(vLLM's MooncakeStoreConnector) is credited with what vLLM itself counted as external hits
(`vllm:external_prefix_cache_hits`, first admissions only, whatever the connector): the plugin's ledger never sees
them, so they can never be the plugin's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

logger = logging.getLogger(__name__)

TIERS = ("arena", "disk", "mooncake")  # the plugin's tiers, in the order a lookup prefers them
SOURCE_TIERS = {"cpu": "arena", "disk": "disk", "remote": "mooncake"}  # the scheduler half's names for them
SOURCES = ("vllm", *TIERS, "peer", "computed")  # every place a prompt token can come from
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"  # vLLM's count of tokens any connector loaded (first admissions)


@dataclass
class PluginHits:
    """Tokens the plugin loaded for first admissions, per tier, and what it loaded again after preemptions."""

    tokens: dict[str, int] = field(default_factory=lambda: {tier: 0 for tier in TIERS})
    reloaded_tokens: int = 0  # loads for preempted requests: vLLM counts a request's cached tokens only once
    mismatches: list[str] = field(default_factory=list)  # where the ledger and the plugin's counters disagreed

    @property
    def total(self) -> int:
        return sum(self.tokens.values())

    def add(self, other: "PluginHits") -> None:
        for tier in TIERS:
            self.tokens[tier] += other.tokens[tier]
        self.reloaded_tokens += other.reloaded_tokens
        self.mismatches += other.mismatches


@dataclass(frozen=True)
class TurnHits:
    """A turn's prompt tokens by source; the sources add up to the prompt."""

    prompt_tokens: int
    vllm: int  # vLLM's own prefix cache
    arena: int
    disk: int
    mooncake: int
    computed: int
    peer: int = 0  # a connector other than this plugin (vLLM's external hits on a peer run)

    @property
    def plugin(self) -> int:
        return self.arena + self.disk + self.mooncake

    @property
    def cached(self) -> int:
        return self.vllm + self.plugin + self.peer

    @property
    def external(self) -> int:
        """Tokens a connector loaded, this plugin or a peer: the column that compares them."""
        return self.plugin + self.peer

    def by_source(self) -> dict[str, int]:
        return {source: getattr(self, source) for source in SOURCES}

    @classmethod
    def summed(cls, turns: "list[TurnHits]") -> "TurnHits":
        return cls(sum(t.prompt_tokens for t in turns), **{s: sum(getattr(t, s) for t in turns) for s in SOURCES})


def split_hits(prompt_tokens: int, cached_tokens: int, plugin: PluginHits, peer_tokens: int = 0) -> TurnHits:
    """A turn's tokens by source from vLLM's `num_cached_tokens` sum (its cache and a connector's), the plugin's own
    ledger and a peer connector's external hits (`peer_tokens`, vLLM's counter): the plugin is credited only with
    what its ledger saw it load, the peer with what vLLM counted, vLLM's cache with the rest of the cached tokens."""
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached tokens ({cached_tokens}) must be within [0, prompt tokens = {prompt_tokens}]")
    if peer_tokens < 0:
        raise ValueError(f"a peer's external hits must be >= 0, got {peer_tokens}")
    if plugin.total and peer_tokens:
        raise ValueError(f"one run has one connector: the plugin's ledger has {plugin.total} tokens and a peer "
                         f"{peer_tokens}")
    if plugin.total + peer_tokens > cached_tokens:
        who = "the plugin's ledger credits it" if plugin.total else "vLLM's external hits credit the peer"
        raise ValueError(f"{who} with {plugin.total + peer_tokens} tokens but vLLM reported only {cached_tokens} "
                         f"cached: loads counted that vLLM did not use")
    return TurnHits(prompt_tokens, cached_tokens - plugin.total - peer_tokens, plugin.tokens["arena"],
                    plugin.tokens["disk"], plugin.tokens["mooncake"], prompt_tokens - cached_tokens, peer_tokens)


def attribute_chunks(first_token: int, hit_tokens: int, chunk_tokens: int, sources: Mapping[int, str]) -> dict[str,
                                                                                                            int]:
    """Tokens per tier of a load of [first_token, first_token + hit_tokens): each chunk's tokens inside that span go
    to the tier its lookup found it in (`sources`: chunk index -> "cpu", "disk" or "remote"; missing: the arena).
    The first chunk may be partial: vLLM's own hit covered its start."""
    if chunk_tokens < 1 or first_token < 0 or hit_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 1 and the span non-negative, got chunk_tokens={chunk_tokens}, "
                         f"first_token={first_token}, hit_tokens={hit_tokens}")
    out = {tier: 0 for tier in TIERS}
    end = first_token + hit_tokens
    for chunk in range(first_token // chunk_tokens, -(-end // chunk_tokens)):
        source = sources.get(chunk, "cpu")
        if source not in SOURCE_TIERS:
            raise ValueError(f"chunk {chunk}: unknown source {source!r}; known: {', '.join(SOURCE_TIERS)}")
        out[SOURCE_TIERS[source]] += min(end, (chunk + 1) * chunk_tokens) - max(first_token, chunk * chunk_tokens)
    return out


class HitLedger:
    """Records, in this process, every load vLLM accepts from the plugin: wraps the scheduler connector's
    `update_state_after_alloc` (vLLM calls it once per admission with the tokens it takes from the connector)."""

    def __init__(self) -> None:
        self._pending = PluginHits()

    def attach(self, connector: Any) -> None:
        """Starts recording `connector`'s (an `LMCacheNPUConnector`'s) accepted loads."""
        half = connector.scheduler_half
        original: Callable[[Any, Any, int], None] = connector.update_state_after_alloc

        def recorded(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens <= 0:
                original(request, blocks, num_external_tokens)
                return
            state = half.requests.get(request.request_id)
            lookup = getattr(state, "lookup", None)
            sources = dict(getattr(state, "found_in", {}) or {})
            before = half.counters.snapshot()
            original(request, blocks, num_external_tokens)
            after = half.counters.snapshot()
            self.record(request, num_external_tokens, None if lookup is None else lookup.num_computed_tokens,
                        half.chunk_tokens, sources, {k: after.get(k, 0) - before.get(k, 0) for k in after})

        connector.update_state_after_alloc = recorded

    def record(self, request: Any, num_external_tokens: int, first_token: "int | None", chunk_tokens: int,
               sources: Mapping[int, str], counted: Mapping[str, float]) -> None:
        """One accepted load: `first_token` where it starts (the lookup's), `counted` what the plugin's own counters
        grew by during the call (its hit tokens and chunks per source), checked against the attribution."""
        hits = PluginHits()
        if first_token is None:
            hits.mismatches.append(f"request {request.request_id}: no lookup recorded for a load of "
                                   f"{num_external_tokens} tokens (credited to the arena)")
            first_token = 0
            tokens = {"arena": num_external_tokens, "disk": 0, "mooncake": 0}
        else:
            tokens = attribute_chunks(first_token, num_external_tokens, chunk_tokens, sources)
        if counted.get("hit_tokens", 0) != num_external_tokens:
            hits.mismatches.append(f"request {request.request_id}: the plugin counted {counted.get('hit_tokens', 0)} "
                                   f"hit tokens, vLLM took {num_external_tokens}")
        chunks = {SOURCE_TIERS[s]: int(counted.get(f"hit_chunks_{s}", 0)) for s in SOURCE_TIERS}
        spanned = {tier: 0 for tier in TIERS}
        for chunk in range(first_token // chunk_tokens, -(-(first_token + num_external_tokens) // chunk_tokens)):
            spanned[SOURCE_TIERS.get(sources.get(chunk, "cpu"), "arena")] += 1
        if chunks != spanned:
            hits.mismatches.append(f"request {request.request_id}: chunks per tier {spanned} by the lookup's sources, "
                                   f"{chunks} by the plugin's counters")
        if int(getattr(request, "num_preemptions", 0) or 0) > 0:
            hits.reloaded_tokens = num_external_tokens  # vLLM's num_cached_tokens keeps the first admission's
        else:
            hits.tokens = tokens
        for text in hits.mismatches:
            logger.warning("hit accounting: %s", text)
        self._pending.add(hits)

    def take(self) -> PluginHits:
        """What was recorded since the last `take` (a turn's loads)."""
        taken, self._pending = self._pending, PluginHits()
        return taken
