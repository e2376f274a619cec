"""The node cache's Prometheus endpoint (metrics_port=0) parses as the exposition format, and `lmcache-npu status
--url` shows the node: its tiers with capacity and use, hit rates overall and per tier, its leases, and each
attached engine's lease with what its calls did."""

from __future__ import annotations

import json
import os
import re

from lmcache_npu.node.exporter import loopback, namespace_labeller
from lmcache_npu.tools.cli import main
from lmcache_npu.tools.status import engine_status, fetch_metrics, parse_metrics, render

from .harness import NAMESPACE, OBJECT_BYTES, keys_of, store_config


def served(start_node, node_dir):
    """A node with a disk tier where A stored 4 chunks and B looked up 6 (4 hits); its metrics address."""
    node = start_node(store_config(8, 2, disk_path=os.path.join(node_dir, "kv"), disk_bytes=1 << 20), metrics_port=0)
    a, b = node.engine("A"), node.engine("B")
    a.store("w", keys_of(0, 4))
    assert b.client.lookup("q", keys_of(0, 4) + keys_of(10, 2)).hit_chunks == 4
    host, port = node.service.metrics_address
    return node, f"http://{host}:{port}"


def test_the_endpoint_parses_and_status_reads_the_node_and_its_leases(start_node, node_dir):
    node, url = served(start_node, node_dir)
    samples = parse_metrics(fetch_metrics(url))
    assert all(sample.name.startswith("lmcache_npu:") for sample in samples)
    lease_a, lease_b, status = engine_status(samples)
    assert status.engine == {"engine": "node"}
    assert (status.namespace, status.eviction_policy, status.chunk_tokens) == (NAMESPACE, "arc", 256)
    assert (status.lookups, status.lookup_tokens, status.hit_tokens) == (1, 6 * 256, 4 * 256)
    cpu, disk = status.tiers
    assert (cpu.used_chunks, cpu.capacity_chunks, cpu.hit_chunks, cpu.hit_rate) == (4, 8, 4, 4 / 6)
    assert (cpu.used_bytes, cpu.capacity_bytes) == (4 * 2 * OBJECT_BYTES, 8 * 2 * OBJECT_BYTES)  # KV bytes, all ranks
    assert disk.capacity_chunks == node.pool.index.disk_chunks and disk.hit_chunks == 0
    assert status.node == {"node_connections": 6, "node_leases": 2, "node_refused_peers": 0}
    assert status.arena["segments_live"] == status.arena["segments_total"] == 2
    assert (lease_a.engine, lease_b.engine) == ({"engine": "A"}, {"engine": "B"})
    assert lease_a.lease["node_stores"] == 4 and lease_a.lease["node_lookup_chunks"] == 0
    assert (lease_b.lease["node_lookup_chunks"], lease_b.lease["node_lookup_hit_chunks"]) == (6, 4)
    assert lease_a.tiers == [] and lease_b.lease["node_lease_connections"] == 3
    text = render([lease_a, lease_b, status])
    assert "engine=B  (attached to the node cache: 3 connection(s), 0 command(s) in flight)" in text
    assert "looked-up chunks 6  hit chunks 4  hit rate 66.7%  stored 0  loaded 0" in text
    assert "node cache: 2 engine lease(s), 6 connection(s), 0 refused peer(s)" in text


def test_lmcache_npu_status_shows_the_node(start_node, node_dir, capsys):
    node, url = served(start_node, node_dir)
    assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    node_part = out[out.index("engine=node"):]
    assert f"namespace {NAMESPACE}  eviction policy arc  chunks of 256 tokens, 8.0 KiB" in node_part
    assert "lookups 1  looked-up tokens 1536  hit tokens 1024  hit rate 66.7%" in node_part
    assert [line.split()[:5] for line in node_part.splitlines() if line.startswith("  host arena")] == [
        ["host", "arena", "4", "8", "50.0%"]]
    assert "local disk" in node_part and "node cache: 2 engine lease(s)" in node_part
    assert main(["status", "--url", url, "--json"]) == 0
    engines = json.loads(capsys.readouterr().out)["engines"]
    assert [e["engine"] for e in engines] == [{"engine": "A"}, {"engine": "B"}, {"engine": "node"}]
    assert engines[2]["hit_rate"] == 4 / 6 and engines[1]["lease"]["node_lookup_hit_chunks"] == 4
    node.service.close()  # control: a node that is gone is an error naming the address, not an empty report
    assert main(["status", "--url", url, "--timeout", "2"]) == 2
    assert f"cannot read {url}/metrics" in capsys.readouterr().err


def test_every_family_has_one_type_line_named_as_its_samples(start_node, node_dir):
    node, url = served(start_node, node_dir)
    node.service.refused_peers = 2
    text = fetch_metrics(url)
    types: dict[str, str] = {}
    families_seen: list[str] = []  # family per sample line, in order
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"a second # TYPE line for {name}"
            types[name] = kind
        elif line and not line.startswith("#"):
            families_seen.append(line.split("{")[0])
    assert set(families_seen) == set(types)  # every sample typed under its exact name, no TYPE without samples
    runs = [name for i, name in enumerate(families_seen) if i == 0 or families_seen[i - 1] != name]
    assert len(runs) == len(set(runs)), "a family's samples are not together"
    assert types["lmcache_npu:node_refused_peers_total"] == "counter"
    assert types["lmcache_npu:segments_total"] == "gauge" and types["lmcache_npu:cpu_used_chunks"] == "gauge"
    assert all(kind == "counter" for name, kind in types.items()
               if name.endswith("_total") and name != "lmcache_npu:segments_total")
    assert 'lmcache_npu:node_refused_peers_total{engine="node"} 2' in text


def test_beyond_loopback_a_pool_is_labelled_by_a_pseudonym_not_its_namespace(start_node, node_dir):
    """The namespace names the weights a pool serves; a scrape from another host gets a keyed pseudonym (the
    control is the loopback endpoint above, which shows the namespace itself)."""
    node = start_node(store_config(8, 2), metrics_port=0, metrics_host="0.0.0.0")
    node.engine("A").store("w", keys_of(0, 2))
    text = fetch_metrics(f"http://127.0.0.1:{node.service.metrics_address[1]}")
    assert NAMESPACE not in text and "namespace=" in text
    labels = {sample.label("namespace") for sample in parse_metrics(text) if sample.label("namespace")}
    assert len(labels) == 1 and re.fullmatch(r"pool-[0-9a-f]{12}", labels.pop())


def test_which_metrics_addresses_are_loopback():
    assert [loopback(host) for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost")] == [True] * 4
    assert [loopback(host) for host in ("0.0.0.0", "::", "10.0.0.7", "node-7.example")] == [False] * 4
    same, other = namespace_labeller("0.0.0.0"), namespace_labeller("0.0.0.0")
    assert same(NAMESPACE) == same(NAMESPACE) != other(NAMESPACE)  # stable in a process, keyed per process
    assert namespace_labeller("127.0.0.1")(NAMESPACE) == NAMESPACE
