"""`lmcache-npu bench-node-restart`: what restarting the node cache costs an engine, restart by restart.

A service (`lmcache-npu node-cache`, a process of its own) holds one pool; an engine in this process (its scheduler
client and every rank's worker mapping, stepping every few milliseconds as the connector does) fills it, then the
service is restarted:
- cold: SIGTERM, then a new service (what a restart was before warm restarts);
- warm: a successor started with `--take-over` (a planned hand-over);
- crash: SIGKILL, then a new service handed the pool's memory as systemd's descriptor store hands it (this process
  plays systemd: it receives the FDSTORE datagrams and passes them on through LISTEN_FDS).
Measured from the moment of the restart: the time to the first hit and to every stored chunk being a hit again (or
to the first store for a cold restart, which finds nothing), and the peak extra memory meanwhile: the node cache's
memory files alive (their bytes, whoever holds them: services, workers, the descriptor store) and the summed PSS of
this process and the services, each above what they were before the restart.
"""

from __future__ import annotations

import array
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

# run before anything else in a service process systemd "starts": the passed descriptors at 3, 4, ... and LISTEN_*
# (the stand-in is loaded by its path: importing the package would import torch, which may open descriptors first)
_STAND_IN = str(Path(__file__).with_name("systemd_stand_in.py"))
_SYSTEMD_EXEC = f"""
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("systemd_stand_in", {_STAND_IN!r})
stand_in = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stand_in)
stand_in.place_passed_descriptors("BENCH_")
sys.argv = ["lmcache-npu", *sys.argv[1:]]
runpy.run_module("lmcache_npu.tools.cli", run_name="__main__")
"""
STEP_S = 0.005  # the engine's step: it names its epoch to its workers and asks for its first chunk
WAIT_S = 600.0


def segment_files(pids: list[int]) -> dict[int, int]:
    """inode -> bytes of every node cache segment file any of `pids` maps or holds."""
    files: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[5].startswith("/memfd:lmcache-npu-segment"):
                        low, high = (int(edge, 16) for edge in fields[0].split("-"))
                        files[int(fields[4])] = max(files.get(int(fields[4]), 0), high - low)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = f"/proc/{pid}/fd/{fd}"
                if os.readlink(target).startswith("/memfd:lmcache-npu-segment"):
                    status = os.stat(target)
                    files[status.st_ino] = max(files.get(status.st_ino, 0), status.st_size)
        except OSError:  # the process (or the descriptor) is gone meanwhile
            continue
    return files


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Samples memory every few milliseconds on a thread: the peaks above the first sample."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.peak_files = self.peak_pss = 0
        self.base_files = self.base_pss = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        pids = self.pids()
        files = sum(segment_files(pids).values())
        pss = sum(pss_bytes(pid) for pid in pids)
        if self.base_files < 0:
            self.base_files, self.base_pss = files, pss
        self.peak_files, self.peak_pss = max(self.peak_files, files), max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def __enter__(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class FakeSystemd:
    """This process as systemd's descriptor store: FDSTORE=1 datagrams on a socket, kept by name."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.fds: dict[str, int] = {}

    def receive(self, wanted: int, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.fds) < wanted and time.monotonic() < deadline:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4))
            except socket.timeout:
                continue
            fds = array.array("i")
            for _, _, payload in ancillary:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            state = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if state.get("FDSTORE") == "1" and fds:
                self.fds[state["FDNAME"]] = fds[0]
        if len(self.fds) < wanted:
            raise RuntimeError(f"the descriptor store received {len(self.fds)} of {wanted} descriptors")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


class Bench:
    """One service (restarted once) and the engine attached to it."""

    def __init__(self, directory: str, cpu_bytes: int, chunk_bytes: int, ranks: int, hugepages: str) -> None:
        from ...node.messages import WEIGHTS_CONTENT, PoolGeometry

        self.directory = directory
        self.path = os.path.join(directory, "node.sock")
        self.cpu_bytes = cpu_bytes
        self.config = os.path.join(directory, "node.yaml")
        with open(self.config, "w") as file:
            file.write(f"hugepages: '{hugepages}'\n")
        self.geometry = PoolGeometry("ab" * 16, b"bench-node-restart", ranks, chunk_bytes, 256)
        self.weights = WEIGHTS_CONTENT
        self.services: list[subprocess.Popen] = []
        self.systemd: Optional[FakeSystemd] = None

    def start_service(self, *flags: str, passed: Optional[dict[str, int]] = None) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        if self.systemd is not None:
            env["NOTIFY_SOCKET"] = self.systemd.path
        passed = passed or {}
        env.update(BENCH_PASSED_FDS=",".join(map(str, passed.values())), BENCH_PASSED_NAMES=":".join(passed))
        process = subprocess.Popen([sys.executable, "-c", _SYSTEMD_EXEC, "node-cache", "--socket", self.path,
                                    "--cpu-bytes", str(self.cpu_bytes), "--config", self.config,
                                    "--pool-idle-seconds", "3600", *flags], env=env, pass_fds=tuple(passed.values()),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.services.append(process)
        return process

    def pids(self) -> list[int]:
        return [os.getpid(), *(process.pid for process in self.services if process.poll() is None)]

    def close(self) -> None:
        for process in self.services:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=120)
        if self.systemd is not None:
            self.systemd.close()


def _wait_serving(path: str, process: subprocess.Popen) -> None:
    from ...node.probe import PingFailed, ping

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the node cache service exited {process.returncode} before serving")
        try:
            if ping(path, 1.0).get("serving"):
                return
        except PingFailed:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no node cache served {path} within {WAIT_S:.0f} s")


class _Serving:
    """When the new service (`pid`) first answers a ping on `path`, in seconds from `began` (on a thread)."""

    def __init__(self, path: str, pid: int, began: float) -> None:
        self.seconds: Optional[float] = None
        self._thread = threading.Thread(target=self._run, args=(path, pid, began), daemon=True)
        self._thread.start()

    def _run(self, path: str, pid: int, began: float) -> None:
        from ...node.probe import PingFailed, ping

        while time.monotonic() < began + WAIT_S:
            try:
                if ping(path, 1.0).get("pid") == pid:
                    self.seconds = time.monotonic() - began
                    return
            except PingFailed:
                pass
            time.sleep(0.01)

    def result(self) -> Optional[float]:
        self._thread.join()
        return self.seconds


def _engine(bench: Bench) -> tuple[Any, list[Any], list[Any]]:
    from ...node.client import NodeCacheClient
    from ...node.worker_mapping import WorkerNodeMapping
    from ...store.keys import ChunkKey
    from ...store.tier import TierCounters

    client = NodeCacheClient(bench.path, "bench", bench.geometry, weights=bench.weights, connect_timeout_s=WAIT_S,
                             retry_s=0.01)
    mappings = [WorkerNodeMapping(bench.path, "bench", bench.geometry, rank, TierCounters(), weights=bench.weights,
                                  pinned=False, retry_s=0.01) for rank in range(bench.geometry.world)]
    for mapping in mappings:
        mapping.start(WAIT_S)
        mapping.join(client.lease)
    keys = [ChunkKey(bench.geometry.namespace, i.to_bytes(32, "little")) for i in range(client.num_slots)]
    return client, mappings, keys


def _fill(client: Any, mappings: list[Any], keys: list[Any]) -> list[Any]:
    from ...store.commands import Completion

    stored = []
    for first in range(0, len(keys), 256):
        batch = keys[first:first + 256]
        stores = client.prepare_store("fill", list(enumerate(batch)))
        client.take_commands()
        for command in stores:
            for rank, mapping in enumerate(mappings):
                mapping.arena.slot_array(command.slot)[:] = (command.slot * 7 + rank) % 251
        client.on_completions([Completion(command.cmd_id, rank, True) for command in stores
                               for rank in range(len(mappings))])
        stored += [command.key for command in stores]
    client.presence([])  # one round trip: every answer was handled
    return stored


def _wait_sealed(mappings: list[Any], client: Any, stored: list[Any]) -> None:
    """Until every stored chunk's trailer names it on every rank (the service seals behind its stores)."""
    from ...store.envelope import ENVELOPE_BYTES, sealed_names

    slots = {client.location(key)[0] for key in stored}
    deadline = time.monotonic() + WAIT_S
    for mapping in mappings:
        arena = mapping.arena
        while time.monotonic() < deadline:
            named = set()
            for segment in arena.memory.segments:
                rows = arena.memory.segment_view(segment.index).reshape(segment.num_slots, arena.slot_bytes)
                names = sealed_names(rows[:, arena.object_bytes:arena.object_bytes + ENVELOPE_BYTES])
                named.update(segment.first_slot + row for row, name in enumerate(names) if name is not None)
            if slots <= named:
                break
            time.sleep(0.05)


def _step(client: Any, mappings: list[Any]) -> Optional[str]:
    epoch = client.poll_epoch()
    for mapping in mappings:
        mapping.follow(epoch or "", ())
    return epoch


def _watch(client: Any, mappings: list[Any], stored: list[Any], spare: Any, up: "_Serving", began: float,
           cold: bool) -> dict[str, Optional[float]]:
    """Steps the engine until the new service answers every stored chunk as a hit (cold: until it stores again):
    the longest stretch without a hit, and when the new service answered its first hit and every hit."""
    longest = 0.0
    missing_since: Optional[float] = 0.0
    first_new = every = None
    while time.monotonic() < began + WAIT_S and every is None:
        now = time.monotonic() - began
        epoch = _step(client, mappings)
        hit = whole = False
        if epoch is not None and all(mapping.epoch == epoch for mapping in mappings):
            if cold:
                hit = whole = bool(client.prepare_store("after", [(0, spare)]))
            else:
                found = client.lookup("after", stored)
                client.release("after")
                hit, whole = found.ready_chunks > 0, found.ready_chunks == len(stored)
        if hit and missing_since is not None:
            longest, missing_since = max(longest, now - missing_since), None
        elif not hit and missing_since is None:
            missing_since = now
        successor = up.seconds is not None  # the new service answers on the socket: what answers now is it
        if successor and hit and first_new is None:
            first_new = now
        if successor and whole:
            every = now
        time.sleep(STEP_S)
    return {"no_hit_s": longest if every is not None else None, "first_hit_s": first_new, "all_hits_s": every}


def run_one(mode: str, cpu_bytes: int, chunk_bytes: int, ranks: int, fill: float, hugepages: str) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="lmcn-bench-", dir="/tmp")
    bench = Bench(directory, cpu_bytes, chunk_bytes, ranks, hugepages)
    client = None
    mappings: list[Any] = []
    try:
        if mode == "crash":
            bench.systemd = FakeSystemd(directory)
        _wait_serving(bench.path, bench.start_service())
        client, mappings, keys = _engine(bench)
        stored = _fill(client, mappings, keys[:max(1, int(len(keys) * fill))])
        if bench.systemd is not None:  # the pool's files and its manifest kept, every store sealed behind
            bench.systemd.receive(1 + sum(len(mapping.arena.memory.segments) for mapping in mappings))
            _wait_sealed(mappings, client, stored)
        old = bench.services[-1]
        result: dict[str, Any] = {"mode": mode, "pool_bytes": cpu_bytes, "chunks": len(stored), "ranks": ranks}
        with Sampler(bench.pids) as sampler:
            began = time.monotonic()
            if mode == "warm":
                new = bench.start_service("--take-over")
            else:
                old.send_signal(signal.SIGKILL if mode == "crash" else signal.SIGTERM)
                old.wait(timeout=WAIT_S)
                passed = dict(bench.systemd.fds) if bench.systemd is not None else None
                new = bench.start_service(passed=passed)
            up = _Serving(bench.path, new.pid, began)
            timeline = _watch(client, mappings, stored, keys[-1], up, began, cold=mode == "cold")
            timeline["service_up_s"] = up.result()
        from ...store.metrics import Metric

        hits = 0 if mode == "cold" else client.lookup("count", stored).ready_chunks
        result.update(timeline, hits_after=hits,
                      worker_maps=sum(mapping.counters[Metric.EPOCH_CHANGES] for mapping in mappings),
                      worker_rebinds=sum(mapping.counters[Metric.NODE_REBINDS] for mapping in mappings),
                      extra_memfd_bytes=max(0, sampler.peak_files - sampler.base_files),
                      extra_pss_bytes=max(0, sampler.peak_pss - sampler.base_pss),
                      epoch_kept=mode != "cold")
        return result
    finally:
        if client is not None:
            client.close()
        for mapping in mappings:
            mapping.close()
        bench.close()
        shutil.rmtree(directory, ignore_errors=True)


def run_restart_bench(cpu_bytes: int, chunk_bytes: int = 2 << 20, ranks: int = 1, fill: float = 1.0,
                      modes: tuple[str, ...] = ("cold", "warm", "crash"), hugepages: str = "off") -> list[dict]:
    if not 0 < fill <= 1:
        raise ValueError(f"--fill must be in (0, 1], got {fill}")
    return [run_one(mode, cpu_bytes, chunk_bytes, ranks, fill, hugepages) for mode in modes]


def render(results: list[dict]) -> str:
    def seconds(value: Optional[float]) -> str:
        return "never" if value is None else f"{value:.2f}"

    lines = [f"{'restart':8} {'chunks':>7} {'serves s':>9} {'no hit s':>9} {'first hit s':>12} {'all hits s':>11} "
             f"{'hits after':>11} {'extra memfd GiB':>16} {'extra PSS GiB':>14} {'worker maps':>12}"]
    for row in results:
        lines.append(f"{row['mode']:8} {row['chunks']:>7} {seconds(row['service_up_s']):>9} "
                     f"{seconds(row['no_hit_s']):>9} "
                     f"{seconds(row['first_hit_s']):>12} {seconds(row['all_hits_s']):>11} {row['hits_after']:>11} "
                     f"{row['extra_memfd_bytes'] / 2**30:>16.2f} {row['extra_pss_bytes'] / 2**30:>14.2f} "
                     f"{row['worker_maps']:>12}")
    pool = results[0]["pool_bytes"] / 2**30 if results else 0
    lines.append(f"(a pool of {pool:.2f} GiB, {results[0]['ranks'] if results else 0} rank(s); seconds from the "
                 "restart: the new service answers, the longest stretch without a hit, the first hit and every hit "
                 "answered by the new service; cold: nothing is a hit, its columns say when the engine could store "
                 "again; worker maps: ranks that mapped and registered the pool again)")
    return "\n".join(lines)
