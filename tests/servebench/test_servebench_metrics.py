"""/metrics parsing: sums over label sets, `_total` folded, `_created` dropped, a bad line named; a point's
difference refuses counters that went down (another server)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.tools.servebench.metrics import ServerCounters, parse_counters

PAGE = ('# HELP lmcache_npu:hit_tokens_total tokens loaded\n'
        '# TYPE lmcache_npu:hit_tokens_total counter\n'
        'lmcache_npu:hit_tokens_total{engine="0",model_name="m"} 1024.0\n'
        'lmcache_npu:hit_tokens_created{engine="0",model_name="m"} 1.7e+09\n'
        'lmcache_npu:hit_tokens_total{engine="1",model_name="m"} 256.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1280.0\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 4096.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 2304.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')


def test_a_page_becomes_sums_by_name() -> None:
    counters = parse_counters(PAGE)
    assert counters["lmcache_npu:hit_tokens"] == 1280.0
    assert "lmcache_npu:hit_tokens_created" not in counters
    assert counters["vllm:prompt_tokens"] == 4096.0  # not mixed with prompt_tokens_by_source
    assert counters["vllm:prompt_tokens_by_source"] == 2304.0
    server = ServerCounters.from_counters(counters)
    assert (server.prompt_tokens, server.vllm_queries, server.vllm_hits, server.connector_hits, server.plugin_hits) \
        == (4096.0, 4096.0, 512.0, 1280.0, 1280.0)


def test_one_changed_sample_changes_the_sum() -> None:  # negative control: a wrong value is noticed
    changed = PAGE.replace('{engine="1",model_name="m"} 256.0', '{engine="1",model_name="m"} 257.0')
    assert parse_counters(changed)["lmcache_npu:hit_tokens"] == 1281.0


def test_a_line_that_is_no_sample_is_named() -> None:
    with pytest.raises(ValueError, match="line 2 is not a Prometheus sample"):
        parse_counters('vllm:prompt_tokens_total 1\nthis is not { a sample\n')
    with pytest.raises(ValueError, match="many.* is not a number"):
        parse_counters('vllm:prompt_tokens_total{a="b"} many\n')


@given(st.lists(st.tuples(st.sampled_from(["0", "1", "2"]), st.integers(0, 10**9)), min_size=1, max_size=6))
def test_label_sets_sum(samples: list[tuple[str, int]]) -> None:
    text = "".join(f'vllm:prefix_cache_hits_total{{engine="{e}"}} {v}.0\n' for e, v in samples)
    assert parse_counters(text)["vllm:prefix_cache_hits"] == sum(v for _, v in samples)


def test_the_difference_over_a_point() -> None:
    before = ServerCounters(prompt_tokens=100, vllm_hits=10, plugin_hits=5)
    after = ServerCounters(prompt_tokens=300, vllm_hits=60, plugin_hits=105)
    delta = after.minus(before)
    assert (delta.prompt_tokens, delta.vllm_hits, delta.plugin_hits, delta.connector_hits) == (200, 50, 100, 0)
    with pytest.raises(ValueError, match="plugin_hits went down"):
        ServerCounters(prompt_tokens=300, vllm_hits=60, plugin_hits=1).minus(before)
