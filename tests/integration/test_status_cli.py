"""`lmcache-npu status` from a /metrics text: the plugin's counters and gauges as vLLM's Prometheus exposition
serves them, parsed back into tiers, use, hit rates and the namespace."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lmcache_npu.tools.cli import main
from lmcache_npu.integration.vllm import LMCacheNPUConnector
from lmcache_npu.integration.vllm.stats import GAUGES, STORE_INFO, LMCacheNPUStats
from lmcache_npu.tools.status import engine_status, metrics_url, parse_metrics, render, to_json

from .conftest import preset_engine, prompt

NAMESPACE = "0123456789abcdef0123456789abcdef"


def exposition(reports: list[dict], engine: str = "0") -> str:
    """The /metrics text vLLM serves after these per-step connector stats (vLLM's labels, a private registry)."""
    registry = CollectorRegistry()

    def bound(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry,
                                                                                             **k)})

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    metrics = LMCacheNPUConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                                     ["model_name", "engine"], {0: ["tiny", engine]})
    for report in reports:
        metrics.observe(LMCacheNPUStats.of(report).data)
    return generate_latest(registry).decode() + 'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0\n'


REPORTS = [
    {"lookups": 4, "lookup_tokens": 4096, "hit_tokens": 1024, "hit_chunks_cpu": 3, "hit_chunks_disk": 1,
     "cpu_capacity_chunks": 8, "cpu_used_chunks": 6, "disk_capacity_chunks": 100, "disk_used_chunks": 0,
     "chunk_bytes": 1 << 20, "chunk_tokens": 256, STORE_INFO: (NAMESPACE, "lru", "cpu,disk")},
    {"lookups": 1, "lookup_tokens": 1024, "hit_tokens": 256, "hit_chunks_cpu": 1, "cpu_used_chunks": 8,
     "disk_used_chunks": 2, "arena_bytes": 8 << 20, "arena_live_bytes": 4 << 20, "segments_live": 1,
     "segments_total": 2},
]


def test_a_captured_exposition_gives_tiers_use_hit_rates_and_namespace():
    (status,) = engine_status(parse_metrics(exposition(REPORTS)))
    assert status.engine == {"engine": "0", "model_name": "tiny"}
    assert (status.namespace, status.eviction_policy) == (NAMESPACE, "lru")
    assert (status.lookups, status.lookup_tokens, status.hit_tokens) == (5, 5120, 1280)
    assert status.hit_rate == 0.25
    cpu, disk = status.tiers
    assert (cpu.tier, cpu.used_chunks, cpu.capacity_chunks, cpu.used_bytes, cpu.capacity_bytes) == (
        "cpu", 8, 8, 8 << 20, 8 << 20)
    assert cpu.hit_chunks == 4 and cpu.hit_rate == 4 * 256 / 5120 and cpu.use == 1.0
    assert (disk.used_chunks, disk.capacity_chunks, disk.hit_chunks, disk.hit_rate) == (2, 100, 1, 256 / 5120)
    assert status.arena == {"arena_bytes": 8 << 20, "arena_live_bytes": 4 << 20, "segments_live": 1,
                            "segments_total": 2}
    text = render([status])
    assert NAMESPACE in text and "host arena" in text and "arena segments 1/2 live" in text
    data = json.loads(to_json([status]))["engines"][0]
    assert data["hit_rate"] == 0.25 and data["tiers"][0]["use"] == 1.0 and data["namespace"] == NAMESPACE


def test_a_gauge_falling_to_zero_and_a_changed_namespace_are_shown():
    later = REPORTS + [{"disk_used_chunks": 0, STORE_INFO: ("f" * 32, "arc", "cpu,disk")}]
    (status,) = engine_status(parse_metrics(exposition(later)))
    assert status.tiers[1].used_chunks == 0 and (status.namespace, status.eviction_policy) == ("f" * 32, "arc")


def test_negative_controls_a_changed_byte_changes_the_status_and_no_plugin_is_an_error():
    text = exposition(REPORTS)
    assert 'lmcache_npu:cpu_used_chunks{engine="0",model_name="tiny"} 8.0' in text
    (wrong,) = engine_status(parse_metrics(text.replace(
        'lmcache_npu:cpu_used_chunks{engine="0",model_name="tiny"} 8.0',
        'lmcache_npu:cpu_used_chunks{engine="0",model_name="tiny"} 7.0')))
    assert wrong.tiers[0].used_chunks == 7 and wrong.tiers[0].use == 7 / 8
    with pytest.raises(ValueError, match="serves no lmcache_npu metrics"):
        engine_status(parse_metrics('vllm:num_requests_running{engine="0"} 1.0\n'))
    with pytest.raises(ValueError, match="line 2: labels 'engine=0' are malformed"):
        parse_metrics("# HELP x y\nlmcache_npu:lookups_total{engine=0} 1\n")
    with pytest.raises(ValueError, match="line 1 is not a Prometheus sample"):
        parse_metrics("lmcache_npu:lookups_total\n")
    with pytest.raises(ValueError, match="--url must be an http"):
        metrics_url("ftp://host:8000")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20),
       st.floats(allow_nan=False, allow_infinity=False, width=32))
@example("\\n", 1.0)  # a backslash then an n: unescaped in one pass, never read as a newline
def test_label_values_and_numbers_survive_the_exposition(value, number):
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    (sample,) = parse_metrics(f'lmcache_npu:x{{model_name="{escaped}",engine="1"}} {number!r}\n')
    assert sample.label("model_name") == value and sample.label("engine") == "1" and sample.value == number


def test_the_schedulers_stats_carry_the_gauges_only_when_they_change(make_engine):
    engine = preset_engine(make_engine, "llama3-8b", "ascend", num_blocks=24, extra_config={"chunk_tokens": 256})
    half = engine.connector.scheduler_half
    first = half.stats().data
    assert first["cpu_capacity_chunks"] == half.index.num_slots and first["cpu_used_chunks"] == 0
    assert first[STORE_INFO] == (half.namespace, half.index.eviction_policy, "cpu")
    assert first["chunk_tokens"] == half.chunk_tokens
    assert set(GAUGES) <= set(first)
    assert half.stats().is_empty(), "an idle engine reported its gauges again"
    engine.add(prompt(2 * 256 + 10, seed=81), max_tokens=2)
    engine.run()
    assert engine.stats.data["cpu_used_chunks"] == 2


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body if self.path == "/metrics" else b"")

    def log_message(self, *args: object) -> None:
        """Quiet: the test reads its own output."""


def test_the_command_reads_a_server_and_prints_json(capsys):
    _Metrics.body = exposition(REPORTS).encode()
    server = HTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["status", "--url", f"http://127.0.0.1:{server.server_port}", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)["engines"][0]
        assert data["namespace"] == NAMESPACE and data["tiers"][1]["used_chunks"] == 2
        assert main(["status", "--url", f"127.0.0.1:{server.server_port}"]) == 0
        assert "local disk" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()
    assert main(["status", "--url", f"http://127.0.0.1:{server.server_port}"]) == 2
    assert "cannot read" in capsys.readouterr().err


COST_REPORT = {"cost_step_base_seconds": 0.0102, "cost_step_token_seconds": 9.72e-4, "cost_step_attention_seconds": 0.0,
               "cost_step_observations": 120.0, "cost_load_latency_seconds": 5e-4, "cost_load_bytes_per_second": 15e9,
               "cost_disk_latency_seconds": 2e-3, "cost_disk_bytes_per_second": 0.2e9,
               "cost_claimed_tokens_faster": 512, "cost_declined_tokens_slower": 768, "cost_declined_tokens_late": 256,
               "cost_predicted_saved_seconds": 1.5, "cost_predicted_step_seconds": 2.0,
               "cost_observed_step_seconds": 2.2, "cost_predicted_disk_seconds": 0.5, "cost_observed_disk_seconds": 2.0}


def test_the_cost_models_fit_and_decisions_are_shown():
    (status,) = engine_status(parse_metrics(exposition(REPORTS + [COST_REPORT])))
    text = render([status])
    assert "cost model: step 10.2 ms + 972 us/token" in text and "(120 steps)" in text
    assert "arena->device 0.5 ms + 15 GB/s" in text and "disk->arena 2 ms + 0.2 GB/s" in text
    assert "claimed tokens faster 512, unfitted 0, load-all 0; declined slower 768, late 256" in text
    assert "predicted saving 1.5 s" in text and "observed / predicted: step 1.10, disk 4.00" in text
    assert json.loads(to_json([status]))["engines"][0]["cost"]["cost_declined_tokens_late"] == 256
    # negative control: an engine that reports no cost model shows none
    assert "cost model" not in render(engine_status(parse_metrics(exposition(REPORTS))))

