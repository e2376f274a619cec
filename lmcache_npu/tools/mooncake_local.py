"""A local `mooncake_master` for tests and `lmcache-npu store-bench`, and a loopback-only network namespace.

The master binary ships in the Mooncake wheel (next to the Python interpreter's scripts or inside the `mooncake`
package). Everything here binds 127.0.0.1: the master's RPC port, its metrics/admin server (0.0.0.0 unless told
otherwise) and the HTTP metadata server, which runs as the wheel's separate `mooncake.http_metadata_server` (the
master's built-in one binds 0.0.0.0 whatever --http_metadata_server_host says, in 0.3.13). Tests additionally run
inside `unshare -n` so nothing can leave the machine; `listening_addresses` lets them check the binding.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..store.mooncake import MooncakeConfig

LOOPBACK = "127.0.0.1"


def find_master_binary() -> str:
    """Path of `mooncake_master`: beside this interpreter, inside the mooncake package, or on PATH."""
    candidates = [Path(sys.executable).parent / "mooncake_master"]
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) / "mooncake_master" for p in spec.submodule_search_locations]
    except ImportError:
        pass
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                            "(and apt-get install libibverbs1 librdmacm1)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((LOOPBACK, port)) == 0


class LocalMooncakeMaster:
    """`with LocalMooncakeMaster() as master: tier = MooncakeTier(master.config())`: a master and an HTTP metadata
    server on 127.0.0.1, both stopped (and reaped) on exit."""

    def __init__(self, rpc_port: Optional[int] = None, http_port: Optional[int] = None,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 20.0,
                 metrics_port: Optional[int] = None) -> None:
        self.rpc_port = rpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.metadata_process: Optional[subprocess.Popen] = None
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)

    def __enter__(self) -> "LocalMooncakeMaster":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)  # our clients listen on loopback too
        argv = [find_master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={LOOPBACK}",
                f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}", *self.extra_args]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        self.metadata_process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mooncake.http_metadata_server import main; sys.exit(main())",
             "--host", LOOPBACK, "--port", str(self.http_port), "--log-level", "WARNING"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        while not (_port_open(self.rpc_port) and _port_open(self.http_port)):
            if (self.process.poll() is not None or self.metadata_process.poll() is not None
                    or time.monotonic() > deadline):
                log = self.log_tail()
                self.stop()
                raise RuntimeError(f"mooncake_master did not come up on {LOOPBACK}:{self.rpc_port}: {log}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def master(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> MooncakeConfig:
        values: dict[str, Any] = {"master": self.master, "metadata": self.metadata, "local_hostname": LOOPBACK,
                                  "global_segment_bytes": 64 << 20, "local_buffer_bytes": 16 << 20,
                                  "timeout_s": 5.0, "retry_after_s": 1.0}
        values.update(overrides)
        return MooncakeConfig(**values)

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    def kill(self) -> None:
        """SIGKILL, as a crashed master (fault tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        for process in (self.process, self.metadata_process):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        self._log.close()

    def pids(self) -> list[int]:
        """The processes serving this master (the master and its metadata server)."""
        return [p.pid for p in (self.process, self.metadata_process) if p is not None]

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def allocated_bytes(self) -> int:
        """The bytes the master has allocated across every mounted segment (its /metrics)."""
        from .status import fetch_metrics, parse_metrics

        return master_allocated_bytes(parse_metrics(fetch_metrics(f"http://{LOOPBACK}:{self.metrics_port}/metrics")))


def master_allocated_bytes(samples: Sequence[Any]) -> int:
    """`master_allocated_bytes` of mooncake_master's /metrics samples (tools.status.Sample): exactly one."""
    found = [s.value for s in samples if s.name == "master_allocated_bytes"]
    if len(found) != 1:
        raise ValueError(f"mooncake_master metrics: expected one master_allocated_bytes sample, found {len(found)}")
    return int(found[0])


def _ip_binary() -> Optional[str]:
    """iproute2's ip(8): on PATH, or in /usr/sbin, which a non-root PATH often lacks."""
    return shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)


def netns_available() -> tuple[bool, str]:
    """Whether this process may run commands in a fresh loopback-only network namespace, and why not."""
    unshare = shutil.which("unshare")
    ip = _ip_binary()
    if unshare is None or ip is None:
        return False, "unshare(1) or ip(8) is not installed (util-linux, iproute2)"
    try:
        probe = subprocess.run([unshare, "-n", ip, "link", "set", "lo", "up"], capture_output=True, text=True,
                               timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"unshare -n failed: {exc}"
    if probe.returncode != 0:
        return False, f"cannot create a network namespace here (unshare -n: {probe.stderr.strip() or probe.returncode})"
    return True, ""


def run_in_loopback_netns(argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
                          timeout: Optional[float] = 300.0, capture: bool = True) -> subprocess.CompletedProcess:
    """Runs `argv` inside a new network namespace with only `lo` up and MC_TCP_BIND_ADDRESS=127.0.0.1; `capture`
    false: its output goes to this process's stdout and stderr (a tool that re-runs itself there)."""
    ip = _ip_binary() or "ip"
    script = f'{ip} link set lo up && exec "$@"'
    child_env = dict(os.environ if env is None else env, MC_TCP_BIND_ADDRESS=LOOPBACK)
    return subprocess.run(["unshare", "-n", "sh", "-c", script, "sh", *argv], env=child_env, capture_output=capture,
                          text=True, timeout=timeout)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode_address(text: str) -> str:
    """/proc/net/tcp's hex address (host byte order words) as dotted IPv4 or colon-hex IPv6."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, read from its own network namespace's
    /proc/<pid>/net/tcp and tcp6 (the sockets matched by inode to its open descriptors)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                found.append((_decode_address(address), int(port, 16)))
    return sorted(found)
