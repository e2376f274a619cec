"""The `mooncake` object of the store config (DESIGN §9): where the cluster is and how this client joins it.

Its own module so the store config can check it without importing the tier (and the tier without importing the
store config).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from .sections import parse_section

PROTOCOLS = ("tcp", "rdma", "ascend")
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


@dataclass(frozen=True)
class MooncakeConfig:
    """The `mooncake` object of the store config."""

    master: str  # "host:port" of mooncake_master's RPC service
    metadata: str  # metadata server: "http://host:8080/metadata", "etcd://host:2379" or "P2PHANDSHAKE"
    local_hostname: str = ""  # this client's address as others reach it; "": MC_TCP_BIND_ADDRESS or the route's
    protocol: str = "tcp"  # tcp, rdma, or ascend (the -npu build's transport)
    device_name: str = ""  # RDMA/ascend device list; "" lets the transfer engine choose
    global_segment_bytes: int = 1 << 30  # memory this client contributes to the cluster pool
    local_buffer_bytes: int = 64 << 20  # the client's own staging buffer (copy path)
    timeout_s: float = 5.0  # one batch call; past it: misses and counter "timeouts"
    retry_after_s: float = 5.0  # after a failure, answer misses without calling the client this long
    # true: the whole host arena is registered with the transfer engine (puts and gets move bytes straight from and
    # into slots, but every transfer-engine peer can read every slot and write one between its check and its load):
    # only with trusted_network; false: only a bounce buffer is registered, and a get is checked in the slot
    zero_copy: bool = False
    bounce_bytes: int = 32 << 20  # zero_copy false: the one registered buffer (batches are split to fit it)
    # a file holding the store-wide secret (>= 16 bytes): objects and disk files then carry an HMAC-SHA256 that a
    # client without it cannot forge; "" with LMCACHE_NPU_SECRET unset: digests only, no MAC (trusted_network only)
    secret_file: str = ""
    # the operator's statement that every host able to reach the Mooncake master, metadata server and transfer-engine
    # ports is trusted: needed to run without a store secret and for zero_copy
    trusted_network: bool = False

    def __post_init__(self) -> None:
        for key in ("master", "metadata", "local_hostname", "protocol", "device_name", "secret_file"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"mooncake.{key} must be a string, got {getattr(self, key)!r}")
        match = _HOST_PORT.match(self.master)
        if not match or not 0 < int(match.group(1)) < 65536:
            raise ValueError(f"mooncake.master must be host:port of mooncake_master's RPC service, got "
                             f"{self.master!r}")
        if not self.metadata:
            raise ValueError("mooncake.metadata must name the metadata server (e.g. http://host:8080/metadata, "
                             "etcd://host:2379 or P2PHANDSHAKE)")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        for key in ("global_segment_bytes", "local_buffer_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"mooncake.{key} must be a size in bytes >= 0, got {value!r}")
        for key in ("zero_copy", "trusted_network"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"mooncake.{key} must be true or false, got {getattr(self, key)!r}")
        if self.zero_copy and not self.trusted_network:
            raise ValueError("mooncake.zero_copy: true registers the whole host arena with the transfer engine, so any "
                             "host that reaches its ports can read every chunk and rewrite a slot after its check; it "
                             "needs mooncake.trusted_network: true (every such host trusted). Leave zero_copy false "
                             "(the default: a bounce buffer, each get checked in the slot) otherwise")
        if isinstance(self.bounce_bytes, bool) or not isinstance(self.bounce_bytes, int) or self.bounce_bytes < 1 << 20:
            raise ValueError(f"mooncake.bounce_bytes must be a size in bytes >= 1 MiB, got {self.bounce_bytes!r}")
        for key in ("timeout_s", "retry_after_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"mooncake.{key} must be seconds in (0, 3600], got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MooncakeConfig":
        parsed = parse_section("mooncake", cls, values, ("global_segment_bytes", "local_buffer_bytes",
                                                                 "bounce_bytes"))
        missing = [k for k in ("master", "metadata") if k not in values]
        if missing:
            raise ValueError(f"mooncake config needs {' and '.join(missing)} (e.g. \"master\": \"10.0.0.5:50051\", "
                             f"\"metadata\": \"http://10.0.0.5:8080/metadata\")")
        return cls(**parsed)

    def resolved_hostname(self) -> str:
        """The address other nodes reach this client at."""
        if self.local_hostname:
            return self.local_hostname
        if os.environ.get("MC_TCP_BIND_ADDRESS"):
            return os.environ["MC_TCP_BIND_ADDRESS"]
        host = self.master.rsplit(":", 1)[0].strip("[]")
        try:  # the source address of the route to the master (a UDP connect sends nothing)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, int(self.master.rsplit(":", 1)[1])))
                return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
