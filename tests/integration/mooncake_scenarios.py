"""Connector scenarios with a real mooncake_master, run INSIDE a loopback-only network namespace (test_faults.py
starts them there): `python -m tests.integration.mooncake_scenarios <scenario>`. Two engines (two vLLM instances)
share one Mooncake store; each prints one JSON line of findings last and exits non-zero on a failed check."""

from __future__ import annotations

import json
import os
import sys

from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

from .conftest import prompt
from .engine import Engine, EngineSpec


# a Mooncake tier needs a store secret (or mooncake.trusted_network): these engines share one, as a cluster would
os.environ.setdefault("LMCACHE_NPU_SECRET", "a-secret-the-two-test-instances-share")


def _engine(master: LocalMooncakeMaster, put_to_remote: bool = True) -> Engine:
    config = {"master": master.master, "metadata": master.metadata, "global_segment_bytes": "256MiB",
              "local_buffer_bytes": "16MiB", "timeout_s": 2, "retry_after_s": 2}
    return Engine(EngineSpec(preset="gpt-oss-120b", family="cuda",
                             extra_config={"mooncake": config, "put_to_remote": put_to_remote}))


def share() -> dict:
    """What one instance stored, another finds through Mooncake and loads exactly (pages checked every step)."""
    with LocalMooncakeMaster() as master:
        writer = _engine(master)
        text = prompt(2 * 256 + 10, seed=31)
        writer.add(text, max_tokens=2, request_id="a")
        writer.run()
        reader = _engine(master)
        reader.add(text + [1, 2], max_tokens=2, request_id="b")
        reader.run()
        found = {"loaded": reader.loaded_tokens.get("b", 0), "remote_hits": reader.stats.data.get("hit_chunks_remote")}
        reader.close()
        writer.close()
        return found


def master_killed() -> dict:
    """With the master gone, an instance keeps serving hits from its own arena while its puts fail, and a new
    instance finds nothing and computes from scratch; nothing hangs or fails."""
    with LocalMooncakeMaster() as master:
        writer = _engine(master)
        text = prompt(2 * 256 + 10, seed=32)
        writer.add(text, max_tokens=2, request_id="a")
        writer.run()
        master.kill()
        writer.add(text + prompt(300, seed=33), max_tokens=2, request_id="again")  # its new chunks' puts fail
        writer.run()
        reader = _engine(master, put_to_remote=False)
        reader.add(text, max_tokens=2, request_id="b")
        reader.run()
        found = {"local_hit": writer.loaded_tokens.get("again", 0), "remote_loaded": reader.loaded_tokens.get("b", 0),
                 "put_failures": writer.connector.scheduler_half.index.counters["put_failed"]}
        reader.close()
        writer.close()
        return found


if __name__ == "__main__":
    result = {"share": share, "master_killed": master_killed}[sys.argv[1]]()
    print(json.dumps(result))
