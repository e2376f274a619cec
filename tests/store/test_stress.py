"""≥ 10,000 chunks through one index and two ranks across arena, disk and Mooncake (tests/store/stress.py); every
load is checked against the checksum recorded when the chunk was stored."""

import json
import os
import sys
from pathlib import Path

import pytest

from lmcache_npu.tools.mooncake_local import run_in_loopback_netns

from . import stress
from .test_mooncake import _real_mooncake_reason

ROOT = Path(__file__).resolve().parents[2]
NO_MASTER = _real_mooncake_reason()


def _check(totals: dict) -> None:
    assert totals["chunks"] >= 10_000 and totals["stored"] == totals["chunks"]
    assert totals["mismatches"] == 0 and totals["loads_verified"] > 10_000
    # every tier served loads: arena hits, promotions from disk and from the remote store
    assert totals["promotions_disk"] > 1000 and totals["promotions_remote"] > 1000 and totals["spills"] > 1000
    assert totals["promote_failed"] == totals["put_failed"] == totals["spill_failed"] == 0


@pytest.mark.skipif(bool(NO_MASTER), reason=NO_MASTER or "ok")
def test_ten_thousand_chunks_across_arena_disk_and_mooncake():
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", "tests.store.stress", "--remote", "mooncake"], env=env,
                                 timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    totals = json.loads(done.stdout.strip().splitlines()[-1])
    assert totals["remote"] == "mooncake"
    _check(totals)


@pytest.mark.skipif(not NO_MASTER, reason="the Mooncake run above covers it")
def test_ten_thousand_chunks_with_an_in_memory_remote_where_no_master_can_run():
    _check(stress.run(10_000, "memory"))
