"""Per-source hit accounting: the plugin is credited only with the loads vLLM took from it, per tier, and vLLM's own
prefix cache with the rest of what vLLM reported cached."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from lmcache_npu.tools.replay.accounting import HitLedger, PluginHits, TurnHits, attribute_chunks, split_hits


def plugin_hits(arena=0, disk=0, mooncake=0) -> PluginHits:
    return PluginHits(tokens={"arena": arena, "disk": disk, "mooncake": mooncake})


def test_hits_from_vllms_cache_are_not_credited_to_the_plugin():
    """The negative control: 900 cached tokens, none of them loaded by the plugin, are all vLLM's."""
    hits = split_hits(prompt_tokens=1000, cached_tokens=900, plugin=PluginHits())
    assert (hits.vllm, hits.plugin, hits.computed) == (900, 0, 100)


def test_both_caches_split_by_what_the_plugin_loaded():
    hits = split_hits(prompt_tokens=1000, cached_tokens=900, plugin=plugin_hits(arena=512, disk=128))
    assert hits.by_source() == {"vllm": 260, "arena": 512, "disk": 128, "mooncake": 0, "peer": 0, "computed": 100}
    assert hits.cached == 900 and sum(hits.by_source().values()) == 1000


def test_a_plugin_credited_beyond_what_vllm_cached_is_refused():
    with pytest.raises(ValueError, match="credits it with 640 tokens but vLLM reported only 600 cached"):
        split_hits(prompt_tokens=1000, cached_tokens=600, plugin=plugin_hits(arena=640))
    with pytest.raises(ValueError, match=r"cached tokens \(1001\) must be within \[0, prompt tokens = 1000\]"):
        split_hits(prompt_tokens=1000, cached_tokens=1001, plugin=PluginHits())


@given(prompt=st.integers(0, 5000), data=st.data())
def test_sources_always_add_up_to_the_prompt(prompt, data):
    cached = data.draw(st.integers(0, prompt))
    arena = data.draw(st.integers(0, cached))
    disk = data.draw(st.integers(0, cached - arena))
    hits = split_hits(prompt, cached, plugin_hits(arena=arena, disk=disk))
    assert sum(hits.by_source().values()) == prompt and hits.vllm == cached - arena - disk >= 0


def test_a_partial_first_chunk_counts_only_the_tokens_beyond_vllms_hit():
    # vLLM's cache held 320 tokens (block-aligned); the plugin loads up to 768 from chunks 1 (arena) and 2 (disk)
    assert attribute_chunks(320, 448, 256, {1: "cpu", 2: "disk"}) == {"arena": 192, "disk": 256, "mooncake": 0}
    assert attribute_chunks(0, 512, 256, {0: "remote", 1: "cpu"}) == {"arena": 256, "disk": 0, "mooncake": 256}
    with pytest.raises(ValueError, match="chunk 0: unknown source 'tape'"):
        attribute_chunks(0, 256, 256, {0: "tape"})


class FakeCounters:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        self.values[name] = self.values.get(name, 0) + amount

    def snapshot(self) -> dict[str, float]:
        return dict(self.values)


class FakeConnector:
    """The scheduler connector's surface the ledger reads: its half's requests, counters and chunk size; counting
    as the real one does (hit tokens, one hit chunk per source)."""

    def __init__(self, chunk_tokens: int = 256, miscount: int = 0) -> None:
        self.scheduler_half = SimpleNamespace(requests={}, counters=FakeCounters(), chunk_tokens=chunk_tokens)
        self.calls: list[int] = []
        self.miscount = miscount

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.calls.append(num_external_tokens)
        half = self.scheduler_half
        state = half.requests.get(request.request_id)
        if num_external_tokens <= 0 or state is None:
            return
        half.counters.add("hit_tokens", num_external_tokens + self.miscount)
        first, chunk = state.lookup.num_computed_tokens, half.chunk_tokens
        for index in range(first // chunk, -(-(first + num_external_tokens) // chunk)):
            half.counters.add(f"hit_chunks_{state.found_in.get(index, 'cpu')}")
        state.lookup = None


def admit(connector, request_id: str, first: int, hit: int, sources: dict, preemptions: int = 0) -> None:
    request = SimpleNamespace(request_id=request_id, num_preemptions=preemptions)
    connector.scheduler_half.requests[request_id] = SimpleNamespace(
        lookup=SimpleNamespace(num_computed_tokens=first), found_in=sources)
    connector.update_state_after_alloc(request, None, hit)


def test_the_ledger_records_accepted_loads_per_tier_and_calls_through():
    connector = FakeConnector()
    ledger = HitLedger()
    ledger.attach(connector)
    admit(connector, "a", 0, 512, {0: "cpu", 1: "disk"})
    admit(connector, "b", 256, 256, {1: "remote"})
    admit(connector, "c", 512, 0, {})  # vLLM took nothing from the plugin (its own cache covered it)
    assert connector.calls == [512, 256, 0]
    taken = ledger.take()
    assert taken.tokens == {"arena": 256, "disk": 256, "mooncake": 256} and not taken.mismatches
    assert ledger.take().total == 0  # taken: the next turn starts from nothing


def test_a_preempted_requests_reload_is_kept_apart():
    connector = FakeConnector()
    ledger = HitLedger()
    ledger.attach(connector)
    admit(connector, "a", 0, 256, {0: "cpu"}, preemptions=1)
    taken = ledger.take()
    assert taken.total == 0 and taken.reloaded_tokens == 256


def test_the_ledger_notices_counters_that_disagree():
    """Negative control: a plugin counting one token more than vLLM took is reported, not trusted."""
    connector = FakeConnector(miscount=1)
    ledger = HitLedger()
    ledger.attach(connector)
    admit(connector, "a", 0, 256, {0: "cpu"})
    assert ledger.take().mismatches == ["request a: the plugin counted 257 hit tokens, vLLM took 256"]


def test_turn_hits_sum():
    a, b = TurnHits(10, 1, 2, 3, 0, 4), TurnHits(20, 5, 5, 0, 5, 5)
    assert TurnHits.summed([a, b]) == TurnHits(30, 6, 7, 3, 5, 9)


def test_a_peers_hits_are_its_own_never_the_plugins():
    hits = split_hits(prompt_tokens=1000, cached_tokens=900, plugin=PluginHits(), peer_tokens=640)
    assert hits.by_source() == {"vllm": 260, "arena": 0, "disk": 0, "mooncake": 0, "peer": 640, "computed": 100}
    assert hits.plugin == 0 and hits.external == 640 and hits.cached == 900
    plugin_run = split_hits(prompt_tokens=1000, cached_tokens=900, plugin=plugin_hits(arena=640))
    assert plugin_run.peer == 0 and plugin_run.external == 640  # negative control: the same column, the plugin's
    with pytest.raises(ValueError, match="one run has one connector"):
        split_hits(1000, 900, plugin_hits(arena=128), peer_tokens=128)
    with pytest.raises(ValueError, match="external hits credit the peer with 901"):
        split_hits(1000, 900, PluginHits(), peer_tokens=901)
    with pytest.raises(ValueError, match="must be >= 0"):
        split_hits(1000, 900, PluginHits(), peer_tokens=-1)
