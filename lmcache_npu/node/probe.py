"""`lmcache-npu node-ping`: asks the node cache at a socket whether it serves, as a container probe would: a stale
socket file of a dead service (a reused emptyDir) fails where `test -S` passes, and the service answers without
taking the lock its verbs hold, so a probe never waits behind a slow verb."""

from __future__ import annotations

import socket
from typing import Any

from . import wire


class PingFailed(ConnectionError):
    """No node cache answered at the socket (none listens, it hung up, or it answered something else)."""


def ping(path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """What the service says of itself (its version, epoch, whether it accepts engines)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            wire.send(sock, ("ping",))
            reply = wire.receive(sock)
        except (OSError, wire.WireError) as exc:
            raise PingFailed(f"no node cache answered at {path}: {exc}") from exc
    if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "pong" and isinstance(reply[1], dict)):
        raise PingFailed(f"{path} answered {str(reply)[:120]}, not a node cache's pong")
    return reply[1]
