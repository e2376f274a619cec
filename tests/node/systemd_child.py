"""A node cache service in a process of its own, started the way systemd starts one, for the descriptor-store tests.

argv: socket path, ready file, slots per rank, ranks. Descriptors this process inherited and should find as
systemd passes them are named in LMCN_PASSED_FDS (comma-separated) and LMCN_PASSED_NAMES (colon-separated): they
are moved to 3, 4, ... and announced in LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID, as systemd does between fork and
exec; NOTIFY_SOCKET comes from the environment. Once it serves (and any pool it inherited is rebuilt) it writes what
it adopted as JSON to the ready file, and serves until it is killed. Run as `python -m tests.node.systemd_child`
from the repository root."""

from __future__ import annotations

import importlib.util
import os
import sys

# by its path: importing the package would import torch, which may open descriptors before they are in place
_spec = importlib.util.spec_from_file_location("systemd_stand_in", "lmcache_npu/tools/bench/systemd_stand_in.py")
_stand_in = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_stand_in)  # type: ignore[union-attr]
_stand_in.place_passed_descriptors("LMCN_")

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

from lmcache_npu.node.service import NodeCacheService, ServiceOptions  # noqa: E402

from tests.node.harness import WAIT_S, store_config  # noqa: E402


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="child %(name)s: %(message)s")
    path, ready, slots, world = argv[1], argv[2], int(argv[3]), int(argv[4])
    store = store_config(slots, world)
    service = NodeCacheService(ServiceOptions(path, store.capacity, store.tiers)).start()
    pools = []
    for pool in list(service.pools.values()):
        if pool.rebuild is not None:
            pool.rebuild.done.wait(WAIT_S)
            report = pool.rebuild.report
            pools.append({"epoch": pool.epoch, "adopted": report.adopted, "candidates": report.candidates,
                          "rejected": dict(report.rejected)})
    with open(ready + ".tmp", "w") as file:
        json.dump({"pid": os.getpid(), "pools": pools}, file)
    os.rename(ready + ".tmp", ready)  # the parent never reads half a file
    while True:  # serves until SIGKILL or SIGTERM
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
