"""The sliced_timeline study's reading of a GPU timeline (pure Python: runs without a GPU): per-stream summaries and
the forward stream's idle gaps, with a negative control that a gap at the threshold is not reported and one above it
is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.tools.bench.studies.sliced_timeline import DeviceSpan, idle_gaps, render, stream_summaries

FORWARD, LOAD = 7, 16


def _forward(starts_and_lengths: list[tuple[float, float]]) -> list[DeviceSpan]:
    return [DeviceSpan(start, length, "gemm", FORWARD) for start, length in starts_and_lengths]


def test_streams_are_summed_apart() -> None:
    spans = _forward([(10, 5), (20, 5)]) + [DeviceSpan(0, 100, "Memcpy HtoD", LOAD), DeviceSpan(100, 8, "kernel", LOAD)]
    forward, load = stream_summaries(sorted(spans, key=lambda s: s.start_us))
    assert (forward.stream, forward.spans, forward.busy_us) == (FORWARD, 2, 10)
    assert (forward.first_us, forward.last_us) == (10, 25)
    assert (load.stream, load.spans, load.busy_us, load.first_us, load.last_us) == (LOAD, 2, 108, 0, 108)
    assert load.names == {"Memcpy HtoD": 1, "kernel": 1}


@given(gap=st.integers(0, 200), threshold=st.integers(1, 100))  # whole µs: the sums stay exact
def test_a_gap_is_listed_exactly_when_it_is_longer_than_the_threshold(gap: int, threshold: int) -> None:
    spans = _forward([(0, 10), (10 + gap, 10)]) + [DeviceSpan(5, 500, "Memcpy HtoD", LOAD)]
    found = idle_gaps(spans, FORWARD, threshold)
    if gap > threshold:
        assert found == [(10, gap)]
    else:
        assert found == []  # the load's stream, busy throughout, never fills the forward's gap


def test_overlapping_spans_leave_no_gap_and_the_longest_end_counts() -> None:
    spans = _forward([(0, 100), (10, 5), (50, 10), (130, 5)])
    assert idle_gaps(spans, FORWARD, 20) == [(100, 30)]  # from the first span's end, not the short ones'


def test_the_tables_name_the_gaps_and_the_load() -> None:
    from rich.console import Console

    result = {"geometry": "deepseek-v3", "ratio": 1.5, "slices": 4, "t_load_ms": 4.7, "matmul_rows": 256,
              "matmuls_per_layer": 3, "forward_alone_ms": [3.8], "ttft_ms": [6.3, 7.5],
              "forward_gaps_us": [(4987.0, 198.6)],
              "load_spans": [{"start_us": 0.0, "duration_us": 1120.0, "name": "Memcpy HtoD (Pinned -> Device)"}]}
    console = Console(record=True, width=200)
    for table in render(result):
        console.print(table)
    text = console.export_text()
    assert "4987: 199" in text and "Memcpy HtoD" in text and "7.50" in text
