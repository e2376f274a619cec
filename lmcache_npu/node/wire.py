"""The node cache's wire format: length-prefixed messages over a Unix stream socket, file descriptors beside them.

What a peer sends the service (its Attach, then its requests) is in the closed encoding of `codec.py`: the service
decodes nothing else, so no message can run code or make the service build more than a bounded multiple of its size
(a peer passed the service's `SO_PEERCRED` check, but a bug or a hostile process of the same user or `--group` must
still not get either). The service's replies are pickles that may name only the classes below (an allow-list
unpickler, no builtins callable): an engine reads them from a service whose credentials it checked
(`client.check_service_peer`), and its replies carry the index's own types at C speed. Descriptors (the shared
segment files) travel as `SCM_RIGHTS` ancillary data of the message that names them.
"""

from __future__ import annotations

import array
import io
import os
import pickle
import socket
import struct
from typing import Any, Sequence

from . import codec

MAX_MESSAGE_BYTES = 64 << 20  # a 128K-token lookup is ~40 KB; anything near this is a broken or hostile peer
MAX_FDS = 4096  # segment files in one attach reply (a 2 TB arena of 1 GiB segments is 2048)
_LENGTH = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")  # struct ucred of SO_PEERCRED: pid, uid, gid
_PROTOCOL = 5  # the first with opcodes for sets and bytearrays: a reply names no builtin

# (module, name) a reply may contain: our plain values. No builtins: pickle protocol 5 has an opcode for every
# builtin container, and a named builtin is a callable (`bytearray(1 << 40)` from a 30-byte message)
_ALLOWED = {
    ("lmcache_npu.store.keys", "ChunkKey"),
    *(("lmcache_npu.store.commands", name) for name in ("Tier", "Medium", "Store", "Load", "Spill", "Promote", "Put",
                                                         "Persist", "Drop", "Completion")),
    *(("lmcache_npu.store.index.contract", name) for name in ("LookupResult", "SlotState", "DiskState", "ChunkView")),
    *(("lmcache_npu.node.messages", name) for name in ("Attach", "Attached", "PoolGeometry", "Refused")),
}


class WireError(ConnectionError):
    """The peer sent something that is not a message of this protocol, or the connection broke mid-message."""


class PickledRequest(WireError):
    """A peer sent the service a pickle: an engine of a release from before the closed encoding (it can read a
    pickled Refused that says so)."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise WireError(f"a node cache message may not contain {module}.{name}")
        return super().find_class(module, name)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel recorded them at connect."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def _framed(payload: bytes) -> bytes:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a node cache message of {len(payload)} B exceeds {MAX_MESSAGE_BYTES} B")
    return _LENGTH.pack(len(payload)) + payload


def encode(message: Any) -> bytes:
    """A message to the service (or any message of plain values and the protocol's dataclasses), framed."""
    return _framed(codec.encode(message))


def encode_reply(message: Any) -> bytes:
    """A reply of the service, framed: an allow-listed pickle (protocol 5: builtins need no class reference)."""
    return _framed(pickle.dumps(message, protocol=_PROTOCOL))


def decode_request(payload: bytes) -> Any:
    """What a peer sent the service: the closed encoding only."""
    if payload[:1] == b"\x80":  # a pickle's PROTO opcode: never decoded, but told apart for a clear refusal
        raise PickledRequest("the peer sent a pickle: it is an engine of an older lmcache-npu than this node cache "
                             "service (which reads only its own encoding); upgrade the engine or the service")
    try:
        return codec.decode(payload)
    except (ValueError, TypeError, OverflowError, struct.error) as exc:  # CodecError, a bad UTF-8 or field value
        raise WireError(f"undecodable node cache message: {exc}") from exc


def decode(payload: bytes) -> Any:
    """What the service sent an engine: a reply pickle, or a message of the closed encoding."""
    if payload[:len(codec.MAGIC)] == codec.MAGIC:
        return decode_request(payload)
    try:
        return _AllowListUnpickler(io.BytesIO(payload)).load()
    except WireError:
        raise
    except Exception as exc:  # truncated or garbled: the connection is unusable either way
        raise WireError(f"undecodable node cache message: {exc}") from exc


def send(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """Sends `message` in the closed encoding (what the service reads), with `fds` beside it."""
    _send(sock, encode(message), fds)


def send_reply(sock: socket.socket, message: Any) -> None:
    """The service's answer to a verb (a pickle of the index's types, read by engines)."""
    _send(sock, encode_reply(message), ())


def _send(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
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


def _receive_payload(sock: socket.socket) -> bytes:
    header = _read_exact(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise WireError(f"a node cache message announced {length} B (at most {MAX_MESSAGE_BYTES})")
    return _read_exact(sock, length)


def receive(sock: socket.socket) -> Any:
    """A message from the service (an engine's side)."""
    return decode(_receive_payload(sock))


def receive_request(sock: socket.socket) -> Any:
    """A message from a peer (the service's side): the closed encoding only, never a pickle."""
    return decode_request(_receive_payload(sock))


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


def peek_message(sock: socket.socket) -> Any:
    """The whole message waiting at the head of `sock`, left there (None when there is none, or only part of one);
    never blocks. How a worker, which reads nothing after its attach, finds what the service said before closing."""
    try:
        data = sock.recv(_LENGTH.size + 4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return None
    if len(data) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(data[:_LENGTH.size])
    if len(data) < _LENGTH.size + length:
        return None
    try:
        return decode(data[_LENGTH.size:_LENGTH.size + length])
    except WireError:
        return None


def close_fd(fd: int) -> None:
    """Closes a received descriptor nobody will map (a refused attach, a failed mapping)."""
    try:
        os.close(fd)
    except OSError:
        pass
