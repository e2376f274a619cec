"""A node cache service in a process of its own, started the way systemd starts one, for the descriptor-store tests.

argv: socket path, ready file, slots per rank, ranks. Descriptors this process inherited and should find as
systemd passes them are named in LMCN_PASSED_FDS (comma-separated) and LMCN_PASSED_NAMES (colon-separated): they
are moved to 3, 4, ... and announced in LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID, as systemd does between fork and
exec; NOTIFY_SOCKET comes from the environment. Once it serves (and any pool it inherited is rebuilt) it writes what
it adopted as JSON to the ready file, and serves until it is killed. Run as `python -m tests.node.systemd_child`
from the repository root."""

from __future__ import annotations

import fcntl
import os
import sys


def _place_passed() -> None:
    """The inherited descriptors at 3, 4, ... (first out of the way, so none is overwritten before it moved)."""
    passed = [int(fd) for fd in os.environ.pop("LMCN_PASSED_FDS", "").split(",") if fd]
    if not passed:
        return
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in passed]
    for fd in passed:
        os.close(fd)
    for number, fd in enumerate(high):
        os.dup2(fd, 3 + number)
        os.close(fd)
    os.environ["LISTEN_FDS"] = str(len(passed))
    os.environ["LISTEN_FDNAMES"] = os.environ.pop("LMCN_PASSED_NAMES", "")
    os.environ["LISTEN_PID"] = str(os.getpid())


_place_passed()  # before any import opens a descriptor of its own

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

from lmcache_npu.node.service import NodeCacheService, ServiceOptions  # noqa: E402

from tests.node.harness import WAIT_S, store_config  # noqa: E402


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="child %(name)s: %(message)s")
    path, ready, slots, world = argv[1], argv[2], int(argv[3]), int(argv[4])
    service = NodeCacheService(ServiceOptions(path, store_config(slots, world))).start()
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
