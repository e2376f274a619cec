"""The node cache's wire format: length-prefixed messages over a Unix stream socket, file descriptors beside them.

A message is a 4-byte big-endian length and a pickle that may name only the classes below (an allow-list
unpickler): a peer passed the service's `SO_PEERCRED` check, but a bug or a hostile process of the same user must
still not get code run by sending a crafted pickle. Descriptors (the shared segment files) travel as `SCM_RIGHTS`
ancillary data of the message that names them.
"""

from __future__ import annotations

import array
import io
import os
import pickle
import socket
import struct
from typing import Any, Sequence

MAX_MESSAGE_BYTES = 64 << 20  # a 128K-token lookup is ~40 KB; anything near this is a broken or hostile peer
MAX_FDS = 4096  # segment files in one attach reply (a 2 TB arena of 1 GiB segments is 2048)
_LENGTH = struct.Struct(">I")

# (module, name) a message may contain: our plain values and the builtins they are made of
_ALLOWED = {
    ("builtins", name) for name in ("set", "frozenset", "dict", "list", "tuple", "bytes", "bytearray", "str", "int",
                                    "float", "bool", "complex")
} | {
    ("lmcache_npu.store.keys", "ChunkKey"),
    *(("lmcache_npu.store.commands", name) for name in ("Tier", "Medium", "Store", "Load", "Spill", "Promote", "Put",
                                                         "Persist", "Drop", "Completion")),
    *(("lmcache_npu.store.index.contract", name) for name in ("LookupResult", "SlotState", "DiskState", "ChunkView")),
    *(("lmcache_npu.node.messages", name) for name in ("Attach", "Attached", "PoolGeometry", "Refused")),
}


class WireError(ConnectionError):
    """The peer sent something that is not a message of this protocol, or the connection broke mid-message."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise WireError(f"a node cache message may not contain {module}.{name}")
        return super().find_class(module, name)


def encode(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a node cache message of {len(payload)} B exceeds {MAX_MESSAGE_BYTES} B")
    return _LENGTH.pack(len(payload)) + payload


def decode(payload: bytes) -> Any:
    try:
        return _AllowListUnpickler(io.BytesIO(payload)).load()
    except WireError:
        raise
    except Exception as exc:  # truncated or garbled: the connection is unusable either way
        raise WireError(f"undecodable node cache message: {exc}") from exc


def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    data = encode(message)
    if fds:
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} descriptors in one message (at most {MAX_FDS})")
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _read_exact(sock: socket.socket, nbytes: int) -> bytes:
    chunks, got = [], 0
    while got < nbytes:
        chunk = sock.recv(min(nbytes - got, 1 << 20))
        if not chunk:
            raise WireError("the node cache connection closed" + (" mid-message" if got else ""))
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket) -> Any:
    header = _read_exact(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise WireError(f"a node cache message announced {length} B (at most {MAX_MESSAGE_BYTES})")
    return decode(_read_exact(sock, length))


def receive_with_fds(sock: socket.socket) -> tuple[Any, list[int]]:
    """A message whose first bytes may carry descriptors (an attach reply); the caller owns the descriptors."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(_LENGTH.size, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            close_fd(fd)
        raise WireError("the node cache sent more descriptors than this process accepts")
    if not data:
        raise WireError("the node cache connection closed")
    try:
        header = data + _read_exact(sock, _LENGTH.size - len(data))
        (length,) = _LENGTH.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            raise WireError(f"a node cache message announced {length} B (at most {MAX_MESSAGE_BYTES})")
        return decode(_read_exact(sock, length)), list(fds)
    except BaseException:
        for fd in fds:
            close_fd(fd)
        raise


def close_fd(fd: int) -> None:
    """Closes a received descriptor nobody will map (a refused attach, a failed mapping)."""
    try:
        os.close(fd)
    except OSError:
        pass
