"""`vllm bench serve --save-result --save-detailed` JSON read back: percentiles from the per-request lists (numpy's
"linear", what vLLM prints), TPOT as vLLM defines it, failed requests left out, inconsistent files refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.tools.servebench.load import LoadSpec, parse_result


def result(ttfts: list[float], latencies: list[float], output_lens: list[int], errors: list[str] | None = None,
           **overrides: Any) -> dict[str, Any]:
    errors = errors or [""] * len(ttfts)
    done = sum(1 for e, n in zip(errors, output_lens) if not e and n > 0)
    data = {"ttfts": ttfts, "latencies": latencies, "output_lens": output_lens, "errors": errors, "completed": done,
            "failed": len(ttfts) - done, "duration": 2.0, "request_throughput": done / 2.0,
            "output_throughput": sum(output_lens) / 2.0, "total_input_tokens": 100 * len(ttfts),
            "total_output_tokens": sum(output_lens)}
    data.update(overrides)
    return data


def test_numbers_of_a_small_run() -> None:
    got = parse_result(result([0.1, 0.2, 0.3, 0.4], [1.1, 1.2, 1.3, 2.4], [11, 11, 11, 11]))
    assert got.completed == 4 and got.failed == 0
    assert got.ttft_p50_ms == pytest.approx(250.0)
    assert got.ttft_p99_ms == pytest.approx(float(np.percentile([100, 200, 300, 400], 99)))
    assert got.tpot_p50_ms == pytest.approx(100.0)  # (1.1 - 0.1) / 10 s = 100 ms, three of four requests
    assert got.tpot_p99_ms == pytest.approx(float(np.percentile([100, 100, 100, 200], 99)))


def test_a_wrong_ttft_moves_the_percentile() -> None:  # negative control
    good = parse_result(result([0.1, 0.2, 0.3, 0.4], [1, 1, 1, 1], [5, 5, 5, 5]))
    bad = parse_result(result([0.1, 0.2, 0.3, 0.5], [1, 1, 1, 1], [5, 5, 5, 5]))
    assert bad.ttft_p99_ms != good.ttft_p99_ms


@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=40), st.sampled_from([50, 90, 99]))
def test_percentiles_match_numpy(ttfts: list[float], q: int) -> None:
    got = parse_result(result(ttfts, [t + 1.0 for t in ttfts], [3] * len(ttfts)))
    ms = [1000.0 * t for t in ttfts]
    assert got.ttft_p50_ms == pytest.approx(float(np.percentile(ms, 50)))
    assert got.ttft_p99_ms == pytest.approx(float(np.percentile(ms, 99)))
    assert got.tpot_p50_ms == pytest.approx(500.0)


def test_failed_requests_are_left_out() -> None:
    got = parse_result(result([0.1, 0.0, 0.3], [1.1, 0.0, 1.3], [11, 0, 11], ["", "boom", ""]))
    assert (got.completed, got.failed) == (2, 1)
    assert got.ttft_p50_ms == pytest.approx(200.0)


@pytest.mark.parametrize("change,message", [
    ({"completed": 3}, "says 3 requests completed"),
    ({"output_lens": [5, 5, 5]}, "differ in length"),
    ({"ttfts": None}, None),
])
def test_inconsistent_files_are_refused(change: dict[str, Any], message: str | None) -> None:
    data = result([0.1, 0.2], [1.0, 1.0], [5, 5])
    if change.get("ttfts", 1) is None:
        del data["ttfts"]
        message = "no 'ttfts'"
    else:
        data.update(change)
    with pytest.raises(ValueError, match=message):
        parse_result(data, "r.json")


def test_no_completed_request_is_an_error() -> None:
    with pytest.raises(ValueError, match="no request completed.*refused"):
        parse_result(result([0.0], [0.0], [0], ["refused"]))


def test_the_command_line_of_a_point(tmp_path: Path) -> None:
    spec = LoadSpec(("--dataset-name", "random"), 8, max_concurrency=2, seed=3)
    args = spec.arguments("http://h:1", "m", "tok", tmp_path / "r.json")
    assert args[args.index("--max-concurrency") + 1] == "2" and args[args.index("--seed") + 1] == "3"
    assert args[args.index("--result-filename") + 1] == "r.json" and "--save-detailed" in args
    assert "--max-concurrency" not in LoadSpec(("--dataset-name", "random"), 8).arguments("b", "m", "t", tmp_path / "r")
    for bad in ({"num_prompts": 0}, {"max_concurrency": 0}, {"request_rate": 0.0}, {"request_rate": math.nan}):
        with pytest.raises(ValueError):
            LoadSpec(("--dataset-name", "random"), **{"num_prompts": 8, **bad})  # type: ignore[arg-type]


def _without_latencies(data: dict[str, Any], itls: list[list[float]]) -> dict[str, Any]:
    """A vLLM 0.28 file: per-request inter-token latencies, no end-to-end latencies."""
    del data["latencies"]
    return {**data, "itls": itls}


@given(st.lists(st.tuples(st.floats(0.001, 2.0), st.lists(st.floats(0.0001, 0.5), min_size=1, max_size=12)),
                min_size=1, max_size=20))
def test_tpot_from_inter_token_latencies_equals_tpot_from_latencies(requests: list[tuple[float, list[float]]]) -> None:
    ttfts = [t for t, _ in requests]
    itls = [gaps for _, gaps in requests]
    lens = [len(gaps) + 1 for gaps in itls]
    with_latencies = parse_result(result(ttfts, [t + sum(g) for t, g in zip(ttfts, itls)], lens))
    with_itls = parse_result(_without_latencies(result(ttfts, [0.0] * len(ttfts), lens), itls))
    assert with_itls.tpot_p50_ms == pytest.approx(with_latencies.tpot_p50_ms)
    assert with_itls.tpot_p99_ms == pytest.approx(with_latencies.tpot_p99_ms)


def test_one_wrong_inter_token_gap_moves_the_tpot() -> None:  # negative control
    good = parse_result(_without_latencies(result([0.1], [0.0], [3]), [[0.2, 0.2]]))
    bad = parse_result(_without_latencies(result([0.1], [0.0], [3]), [[0.2, 0.3]]))
    assert good.tpot_p50_ms == pytest.approx(200.0) and bad.tpot_p50_ms == pytest.approx(250.0)


def test_a_file_without_latencies_or_inter_token_gaps_is_refused() -> None:
    data = result([0.1], [1.0], [3])
    del data["latencies"]
    with pytest.raises(ValueError, match="neither a 'latencies' nor an 'itls'"):
        parse_result(data, "r.json")
    with pytest.raises(ValueError, match="itls 2"):
        parse_result(_without_latencies(result([0.1], [0.0], [3]), [[0.2], [0.2]]), "r.json")
