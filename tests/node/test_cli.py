"""`lmcache-npu node-cache` names what is wrong with its socket or metrics port instead of a traceback: a missing
directory, a file that is not a socket, a live service on the same path, a metrics port already taken."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.node.service import NodeCacheService, ServiceOptions
from lmcache_npu.store.config import StoreConfig


def _node_cache(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmcache_npu.tools.cli", "node-cache", "--cpu-bytes", "16MiB",
                           *arguments], capture_output=True, text=True, timeout=120)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # a Unix socket's path must fit in 108 bytes: pytest's tmp_path can be longer
    directory = Path(tempfile.mkdtemp(prefix="lmc-cli-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr


def test_a_missing_directory_is_named(short_dir: Path) -> None:
    path = short_dir / "absent" / "node.sock"
    _refused(_node_cache("--socket", str(path)),
             f"lmcache-npu: node-cache: cannot serve --socket {path}: No such file or directory")


def test_a_file_that_is_not_a_socket_is_left_alone(short_dir: Path) -> None:
    path = short_dir / "node.sock"
    path.write_text("not a socket")
    _refused(_node_cache("--socket", str(path)), f"node-cache: {path} exists and is not a socket")
    assert path.read_text() == "not a socket"


def test_a_live_service_on_the_path_is_named(short_dir: Path) -> None:
    path = str(short_dir / "node.sock")
    live = NodeCacheService(ServiceOptions(path, NodeCapacity(16 << 20), StoreConfig(hugepages="off"))).start()
    try:
        _refused(_node_cache("--socket", path), f"node-cache: a node cache already serves {path}")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)  # the live service's socket is still there and answers
        probe.close()
    finally:
        live.close()


def test_a_taken_metrics_port_is_named(short_dir: Path) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        path = short_dir / "node.sock"
        _refused(_node_cache("--socket", str(path), "--metrics-port", str(port)),
                 f"cannot serve --socket {path} and --metrics-port {port}: Address already in use")
    finally:
        taken.close()


def test_negative_control_a_dead_services_socket_is_replaced_and_served(short_dir: Path) -> None:
    path = str(short_dir / "node.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening: what a killed service leaves behind
    dead.close()
    process = subprocess.Popen([sys.executable, "-m", "lmcache_npu.tools.cli", "node-cache", "--cpu-bytes", "16MiB",
                                "--socket", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(f"lmcache-npu node-cache: serving {path}"), line + process.stderr.read()
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert process.returncode == 0
    assert not os.path.exists(path)  # SIGTERM closes the service, which removes its socket


def test_a_lease_slot_share_or_ttl_out_of_range_is_refused_before_the_socket_exists(short_dir: Path) -> None:
    path = short_dir / "node.sock"
    _refused(_node_cache("--socket", str(path), "--lease-slot-share", "2"),
             "lmcache-npu: a lease's slot share must be in (0, 1], got 2.0")
    _refused(_node_cache("--socket", str(path), "--reservation-ttl", "0"), "the reservation TTL must be positive")
    _refused(_node_cache("--socket", str(path), "--command-ttl", "120"),
             "node-cache: --command-ttl 120 must be more than the workers' command deadline (120 s)")
    assert not path.exists()


def test_a_command_ttl_past_the_workers_deadline_is_taken() -> None:
    from lmcache_npu.store.commands import COMMAND_DEADLINE_S, COMMAND_TTL_S
    from lmcache_npu.tools.node_commands import _command_ttl

    assert COMMAND_TTL_S > COMMAND_DEADLINE_S  # the default itself passes the rule
    assert _command_ttl(COMMAND_DEADLINE_S + 1) == COMMAND_DEADLINE_S + 1
    with pytest.raises(ValueError, match="must be more than the workers' command deadline"):
        _command_ttl(COMMAND_DEADLINE_S)


def _serving(path: str, *flags: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "lmcache_npu.tools.cli", "node-cache", "--cpu-bytes", "16MiB",
                                "--socket", path, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith(f"lmcache-npu node-cache: serving {path}"), line + process.stderr.read()  # type: ignore
    return process


def test_take_over_hands_the_cache_over_and_the_old_process_exits_or_waits(short_dir: Path) -> None:
    path = str(short_dir / "node.sock")
    old = _serving(path, "--after-hand-over", "wait")
    new = None
    try:
        new = _serving(path, "--take-over")
        assert old.stdout is not None
        said = old.stdout.readline()
        assert said.startswith("lmcache-npu node-cache: handed the host cache over") and "waiting" in said, said
        assert old.poll() is None  # it waits to be stopped: a restarted container would take the cache back
        newest = _serving(path, "--take-over", "--hand-over-drain-seconds", "0")
        new.wait(timeout=60)  # the default: once handed over, it exits
        assert new.returncode == 0
        new = newest
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
    assert old.returncode == 0 and not os.path.exists(path)  # the last one removed the socket when stopped


def test_take_over_with_a_bad_drain_time_is_refused_before_anything_is_asked(short_dir: Path) -> None:
    path = short_dir / "node.sock"
    _refused(_node_cache("--socket", str(path), "--take-over", "--hand-over-drain-seconds", "-1"),
             "--hand-over-drain-seconds must be 0-3600")
