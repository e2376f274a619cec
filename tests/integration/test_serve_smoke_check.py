"""The serve smoke test's verdict (tests/serve_smoke.py) notices what it must: no hits, too few hits, hits on the
first request, and one differing token."""

from __future__ import annotations

import pytest

from lmcache_npu.tools.servebench.metrics import PLUGIN_HITS, parse_counters

from ..serve_smoke import SmokeResult, check

TOKENS = (5, 6, 7, 8)


def test_a_good_run_passes() -> None:
    check(SmokeResult(TOKENS, TOKENS, 0, 1024, 1061), 256)


@pytest.mark.parametrize("result,message", [
    (SmokeResult(TOKENS, TOKENS, 0, 0, 1061), "loaded 0 tokens"),
    (SmokeResult(TOKENS, TOKENS, 0, 768, 1061), "loaded 768 tokens"),
    (SmokeResult(TOKENS, TOKENS, 256, 1280, 1061), "first request hit"),
    (SmokeResult(TOKENS, (5, 6, 7, 9), 0, 1024, 1061), "tokens differ"),
])
def test_negative_controls(result: SmokeResult, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check(result, 256)


def test_the_counter_is_read_from_prometheus_text() -> None:
    text = ('# HELP lmcache_npu:hit_tokens_total tokens loaded\n'
            'lmcache_npu:hit_tokens_total{engine="0",model_name="m"} 1024.0\n'
            'lmcache_npu:hit_tokens_created{engine="0",model_name="m"} 1.7e+09\n'
            'lmcache_npu:hit_tokens_total{engine="1",model_name="m"} 256.0\n')
    counters = parse_counters(text)
    assert counters[PLUGIN_HITS] == 1280.0  # both engines' samples summed, the _created timestamp left out
    # negative control: one engine's sample one token off moves the sum
    assert parse_counters(text.replace("} 256.0", "} 257.0"))[PLUGIN_HITS] == 1281.0
