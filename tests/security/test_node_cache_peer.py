"""An engine trusts a node cache only when its process is this user's or root's, or another user's socket in a
directory nobody else can write: a socket someone else placed at a shared path first is refused before a byte of
KV crosses it."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from lmcache_npu.node.client import NodeCacheUnavailable, check_service_peer


class _Peer:
    """A connected socket as getsockopt(SO_PEERCRED) would describe it."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_PEERCRED)
        return struct.pack("3i", 4242, self.uid, self.uid)


OTHER = 54321  # no user of this machine


def _socket_file(directory, uid: int, mode: int) -> str:
    path = directory / "node.sock"
    path.write_bytes(b"")
    os.chown(path, uid, -1)
    os.chown(directory, uid, -1)
    os.chmod(directory, mode)
    return str(path)


def test_this_users_and_roots_services_are_trusted(tmp_path) -> None:
    path = str(tmp_path / "node.sock")
    check_service_peer(_Peer(os.getuid()), path)
    check_service_peer(_Peer(0), path)


@pytest.mark.skipif(os.getuid() != 0, reason="giving files to another uid needs root")
def test_another_users_socket_is_trusted_only_in_a_directory_only_it_writes(tmp_path) -> None:
    private = tmp_path / "private"
    private.mkdir()
    check_service_peer(_Peer(OTHER), _socket_file(private, OTHER, 0o750))  # its own 0750 directory: trusted
    shared = tmp_path / "shared"
    shared.mkdir()
    with pytest.raises(NodeCacheUnavailable, match=f"served by uid {OTHER}"):
        check_service_peer(_Peer(OTHER), _socket_file(shared, OTHER, 0o1777))  # /tmp-like: anyone placed it
    squatted = tmp_path / "squatted"
    squatted.mkdir()
    path = _socket_file(squatted, OTHER, 0o750)
    os.chown(path, OTHER + 1, -1)  # the socket is not even the serving user's
    with pytest.raises(NodeCacheUnavailable):
        check_service_peer(_Peer(OTHER), path)


def test_a_foreign_peer_is_refused_where_nothing_vouches_for_it(tmp_path) -> None:
    with pytest.raises(NodeCacheUnavailable, match="cannot be checked"):
        check_service_peer(_Peer(OTHER), str(tmp_path / "missing" / "node.sock"))
