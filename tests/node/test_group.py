"""`lmcache-npu node-cache --group G`: G is a group name or a numeric gid (a container's /etc/group rarely names the
engines' group), and a peer of another uid is let in by its primary gid as SO_PEERCRED reports it, never by a
supplementary group (which is enough to open the 0660 socket, so the credential check is what refuses it)."""

from __future__ import annotations

import grp
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.node import wire
from lmcache_npu.node.capacity import NodeCapacity
from lmcache_npu.node.service import NodeCacheService, ServiceOptions, group_id
from lmcache_npu.store.config import StoreConfig

OTHER_UID = 54321  # a uid that is not the service's: only the group can let it in
GROUP_GID = 54322
OTHER_GID = 54323

ANSWERED, CLOSED, NO_ACCESS = 10, 11, 12  # the peer's exit codes


def _peer(socket_path: str, gid: int, extra_groups: list[int]) -> int:
    """Connects as OTHER_UID with primary `gid` from a forked child (an interpreter under /root would not run as
    another uid) and sends a well-formed message that is no Attach: a service that let the peer in
    answers with a Refused, one that did not closes the connection before reading."""
    framed = wire.encode(("hello",))
    pid = os.fork()
    if pid == 0:  # the child runs only syscalls of modules already imported, then leaves without cleanup
        code = 13
        try:
            os.setgroups(extra_groups)
            os.setgid(gid)
            os.setuid(OTHER_UID)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(socket_path)
            except PermissionError:
                code = NO_ACCESS
            else:
                try:
                    sock.sendall(framed)
                    code = ANSWERED if sock.recv(1 << 16) else CLOSED
                except (BrokenPipeError, ConnectionResetError):
                    code = CLOSED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _unknown_group_name() -> str:
    names = {group.gr_name for group in grp.getgrall()}
    return next(f"lmc-no-such-group-{n}" for n in range(1000) if f"lmc-no-such-group-{n}" not in names)


def test_a_group_name_is_looked_up() -> None:
    root = grp.getgrgid(0)
    assert group_id(root.gr_name) == 0


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 2))
def test_a_numeric_gid_is_taken_as_it_is(gid: int) -> None:
    try:
        named = grp.getgrnam(str(gid)).gr_gid  # a group literally named like the number wins: it is that group
    except KeyError:
        named = gid
    assert group_id(str(gid)) == named


@pytest.mark.parametrize("text", ["lmc-no-such-group", "12ab", "-5", "٣"])
def test_neither_a_group_nor_a_number_is_refused_by_name(text: str) -> None:
    if text == "lmc-no-such-group":
        text = _unknown_group_name()
    with pytest.raises(ValueError, match=rf"--group '{text}' is neither a group of this host .* nor a numeric gid"):
        group_id(text)


def test_the_cli_reports_an_unknown_group_as_an_error_not_a_traceback(tmp_path) -> None:
    name = _unknown_group_name()
    result = subprocess.run([sys.executable, "-m", "lmcache_npu.tools.cli", "node-cache", "--socket",
                             str(tmp_path / "n.sock"), "--cpu-bytes", "16MiB", "--group", name],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"lmcache-npu: --group '{name}' is neither a group" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a peer of another uid and gid needs root")
def test_a_peer_of_another_uid_gets_in_by_its_primary_gid_only() -> None:
    directory = tempfile.mkdtemp(prefix="lmc-grp-")
    os.chmod(directory, 0o711)  # the other uid may reach the socket; the socket's own mode decides the rest
    path = os.path.join(directory, "node.sock")
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(16 << 20), StoreConfig(hugepages="off"),
                                              group=str(GROUP_GID))).start()
    try:
        mode = os.stat(path)
        assert stat.S_IMODE(mode.st_mode) == 0o660 and mode.st_gid == GROUP_GID
        assert _peer(path, GROUP_GID, []) == ANSWERED
        assert service.refused_peers == 0
        # a supplementary membership opens the 0660 file, but SO_PEERCRED reports the primary gid: refused
        assert _peer(path, OTHER_GID, [GROUP_GID]) == CLOSED
        deadline = time.monotonic() + 5
        while service.refused_peers < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.refused_peers == 1
    finally:
        service.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a peer of another uid and gid needs root")
def test_negative_control_without_group_the_same_peer_cannot_even_open_the_socket() -> None:
    directory = tempfile.mkdtemp(prefix="lmc-grp-")
    os.chmod(directory, 0o711)
    path = os.path.join(directory, "node.sock")
    service = NodeCacheService(ServiceOptions(path, NodeCapacity(16 << 20), StoreConfig(hugepages="off"))).start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert _peer(path, GROUP_GID, []) == NO_ACCESS
        assert service.refused_peers == 0  # the file's mode refused it before the service saw it
    finally:
        service.close()
        shutil.rmtree(directory, ignore_errors=True)
