"""The serve smoke test's verdict (tests/serve_smoke.py) notices what it must: no hits, too few hits, hits on the
first request, and one differing token."""

from __future__ import annotations

import pytest

from ..serve_smoke import HIT_TOKENS, SmokeResult, check

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
    assert sum(float(v) for v in HIT_TOKENS.findall(text)) == 1280.0
