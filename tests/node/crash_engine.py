"""An engine in a process of its own for the lease tests: it attaches to the node cache at argv[1] as engine
argv[3] (a scheduler client and rank 0's worker mapping, one rank), reserves and pins chunks 0-2 that another engine
stored (lookup, then loads of chunks 0 and 1: READING), takes slots for chunks 10-11 (stores: WRITING), writes
what it holds as JSON to argv[2], and waits to be killed. Run as `python -m tests.node.crash_engine` from the
repository root."""

from __future__ import annotations

import json
import os
import sys
import time

from lmcache_npu.node.attachment import attach_worker_arena
from lmcache_npu.node.client import NodeCacheClient

from tests.node.harness import WEIGHTS, geometry, keys_of


def main(argv: list[str]) -> int:
    path, ready, engine = argv[1], argv[2], argv[3]
    geo = geometry(world=1)
    client = NodeCacheClient(path, engine, geo, weights=WEIGHTS, connect_timeout_s=10.0)
    worker = attach_worker_arena(path, engine, geo, 0, weights=WEIGHTS, pinned=False, timeout_s=10.0,
                                 lease=client.lease)
    held = keys_of(0, 3)
    found = client.lookup("pinned", held)
    loads = client.prepare_load("pinned", [(0, held[0]), (1, held[1])])
    stores = client.prepare_store("writing", list(enumerate(keys_of(10, 2))))
    state = {"ready_chunks": found.ready_chunks, "epoch": worker.epoch, "pid": os.getpid(),
             "loads": [[c.cmd_id, c.slot] for c in loads], "stores": [[c.cmd_id, c.slot] for c in stores]}
    with open(ready + ".tmp", "w") as file:
        json.dump(state, file)
    os.rename(ready + ".tmp", ready)  # the parent never reads half a file
    while True:  # holds its connections until SIGKILL
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
