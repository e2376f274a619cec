"""The store's configuration keys (the `kv_connector_extra_config` subset the store reads; DESIGN §9): the store
section, its `mooncake` object, and the parsing every section shares.

Sizes are bytes, given as integers or strings with a unit ("64GiB", "512MB", "1.5TiB"). Unknown keys are an error
that lists the valid ones; every value is checked here, before anything is allocated. Every parser here fails one
way: a ValueError that names the key and the rule, whatever the input (a YAML file can hold int or null keys,
400-digit sizes, alias bombs and self-referencing lists).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterable, Mapping, Optional

from ..checks import check_int
from ..platform.ascend_host import parse_requested
from ..platform.vm import SLOT_ALIGN_BYTES, parse_hugepages
from .policies import POLICIES

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# ASCII digits only: int() and Fraction() would also take other scripts' digits, which no operator means
_SIZE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]*)\s*$")
# sizes become u64 file offsets, mmap lengths and C size_t: past this they would overflow there, not here
MAX_SIZE_BYTES = 2**63 - 1
# no key takes a value nested deeper or holding more items; bounding them keeps every later check and error message
# (repr) finite, whatever a YAML file's anchors or a JSON string nest
MAX_VALUE_DEPTH = 16
MAX_VALUE_ITEMS = 10_000
_SIZE_RULE = ("expected a size in bytes (e.g. 68719476736 or \"64GiB\"; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; "
              f"at most {MAX_SIZE_BYTES})")


def parse_bytes(key: str, value: Any) -> int:
    """A size in bytes from an int or a string such as "64GiB"; the error names the key and the rule."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: {_SIZE_RULE}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) and match.group(2).lower() in _UNITS:
        # exact rational arithmetic: float() would round 19-digit sizes and turn 400 digits into inf
        size = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise ValueError(f"{key}: {_SIZE_RULE}, got {_shown(value)}")
    if size < 0:
        raise ValueError(f"{key}: a size cannot be negative, got {_shown(value)}")
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"{key}: a size must be at most {MAX_SIZE_BYTES} bytes (2**63 - 1), got {_shown(value)}")
    return size


def _shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` cut to `limit` characters for an error message; never raises (an int past Python's digit limit
    cannot be repr'd)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def key_list(keys: Iterable[Any]) -> str:
    """Keys of any type (a YAML file may use 1 or null as a key) sorted and quoted for an error message: string keys
    in their usual order, then the others."""
    return ", ".join(_shown(k) for k in sorted(keys, key=lambda k: (0, k) if isinstance(k, str) else (1, _shown(k))))


def check_value_shape(key: str, value: Any) -> None:
    """Refuses a value nested deeper than MAX_VALUE_DEPTH levels or holding more than MAX_VALUE_ITEMS items in all,
    without recursion (a self-referencing YAML list ends at the depth bound)."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    items = 0
    while pending:
        current, depth = pending.pop()
        if isinstance(current, Mapping):
            children: Iterable[Any] = [*current.keys(), *current.values()]
        elif isinstance(current, (list, tuple, set, frozenset)):
            children = current
        else:
            continue
        if depth >= MAX_VALUE_DEPTH:
            raise ValueError(f"{key}: the value nests deeper than {MAX_VALUE_DEPTH} levels; no config key takes such "
                             "a value")
        items += len(current)
        if items > MAX_VALUE_ITEMS:
            raise ValueError(f"{key}: the value holds more than {MAX_VALUE_ITEMS} items; no config key takes such a "
                             "value")
        pending.extend((child, depth + 1) for child in children)


def check_cpu_list(key: str, value: Any) -> tuple[int, ...]:
    """A non-empty list of distinct CPU ids (ints from 0) as a tuple; the error names the key."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key} must be a non-empty list of CPU ids (e.g. [1] or [2, 3]) or null, got {_shown(value)}")
    for cpu in value:
        check_int(f"{key} entry", cpu, 0, 65535)
    if len(set(value)) != len(value):
        raise ValueError(f"{key} names a CPU twice: {_shown(value)}")
    return tuple(value)


def parse_section(section: str, schema: type, values: Mapping[str, Any], sizes: tuple[str, ...] = ()) -> dict:
    """`values` checked against the fields of dataclass `schema`: an unknown key is refused with the valid ones;
    the `sizes` keys are parsed to bytes. Returns the keyword arguments for `schema`."""
    if not isinstance(values, Mapping):
        raise ValueError(f"the {section} config must be an object of {section} keys, got {_shown(values)}")
    valid = tuple(f.name for f in dataclasses.fields(schema))
    unknown = set(values) - set(valid)
    if unknown:
        raise ValueError(f"unknown {section} config key(s) {key_list(unknown)}; valid keys: {', '.join(valid)}")
    for key, value in values.items():
        check_value_shape(key if section == "store" else f"{section}.{key}", value)
    parsed = dict(values)
    for key in sizes:
        if key in parsed:
            parsed[key] = parse_bytes(key if section == "store" else f"{section}.{key}", parsed[key])
    return parsed


# ---- the mooncake object ---------------------------------------------------------------------------------------------

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
            check_int(f"mooncake.{key}", getattr(self, key), lo=0)
        for key in ("zero_copy", "trusted_network"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"mooncake.{key} must be true or false, got {getattr(self, key)!r}")
        if self.zero_copy and not self.trusted_network:
            raise ValueError("mooncake.zero_copy: true registers the whole host arena with the transfer engine, so any "
                             "host that reaches its ports can read every chunk and rewrite a slot after its check; it "
                             "needs mooncake.trusted_network: true (every such host trusted). Leave zero_copy false "
                             "(the default: a bounce buffer, each get checked in the slot) otherwise")
        check_int("mooncake.bounce_bytes", self.bounce_bytes, lo=1 << 20)  # 1 MiB
        for key in ("timeout_s", "retry_after_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"mooncake.{key} must be seconds in (0, 3600], got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MooncakeConfig":
        parsed = parse_section("mooncake", cls, values, ("global_segment_bytes", "local_buffer_bytes", "bounce_bytes"))
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


# ---- the store section -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreConfig:
    """Where chunks live. Capacities are per rank: every rank has its own arena and its own disk files."""

    cpu_bytes: int = 8 << 30  # host arena (L1) per rank
    numa_node: Optional[int] = None  # bind the arena to this NUMA node (the accelerator's); None: first touch
    pinned: Optional[bool] = None  # page-lock the arena; None: when an accelerator is present
    arena_segment_bytes: int = 2 << 30  # the arena is mapped and registered in pieces of this size (whole slots)
    hugepages: str = "auto"  # arena pages: auto (transparent hugepages where offered), off, 2M or 1G (MAP_HUGETLB)
    # how an Ascend host makes the arena DMA-able: auto (from its driver, kernel and SoC: aclrtHostRegister ->
    # aclrtMallocHost -> halHostRegister), or one of those three alone
    npu_host_memory: str = "auto"
    disk_path: Optional[str] = None  # L2: directory for chunk files (local NVMe); None: no disk tier
    disk_bytes: int = 0  # L2 capacity per rank; required with disk_path
    disk_max_pending_bytes: int = 256 << 20  # write-behind queue; a spill beyond it is dropped and counted
    disk_writer_threads: int = 2
    # every stored or promoted-from-remote chunk is also written to disk in the background, so a restart finds it;
    # false: the disk only receives evicted chunks
    disk_write_through: bool = True
    mooncake: Optional[Mapping[str, Any]] = None  # L3: MooncakeConfig keys (master, metadata, ...); None: off
    put_to_remote: bool = True  # write every stored chunk through to Mooncake (how other instances find it)
    io_threads: int = 4  # per worker: promotions and gets run on these, persists, puts and remote drops on as many more
    # background store work (sealing, disk write-through, puts) runs on cores the model leaves idle (Linux
    # SCHED_IDLE, platform/threads.py); work that waited YIELD_BOUND_S for one runs at normal priority, so a host the
    # engines saturate never starves it (docs/performance.md, "Turn 1")
    yield_to_compute: bool = True
    eviction_policy: str = "arc"  # the arena's eviction order: arc, lru or s3fifo (chosen in docs/performance.md)
    # reuse gates (0: off): a chunk is put to Mooncake only once this many later requests looked it up
    remote_admit_hits: int = 0
    # an evicted chunk is spilled to disk only once this many later requests looked it up (write-through, when on,
    # still writes every chunk at once)
    disk_admit_hits: int = 0
    # CPU ids the worker's transfer lanes pin their threads to (a CPU engine: keep the copies off the model's cores);
    # None: no pinning. Per engine, never the node cache's
    transfer_cpus: Optional[tuple[int, ...]] = None

    _SIZES = ("cpu_bytes", "disk_bytes", "disk_max_pending_bytes", "arena_segment_bytes")

    def __post_init__(self) -> None:
        if self.cpu_bytes <= 0:
            raise ValueError(f"cpu_bytes must be positive (the host arena is the first tier), got {self.cpu_bytes}")
        if self.numa_node is not None:  # null: first touch places the pages
            check_int("numa_node", self.numa_node, lo=0)
        if self.pinned is not None and not isinstance(self.pinned, bool):
            raise ValueError(f"pinned must be true, false or null (auto), got {self.pinned!r}")
        if self.arena_segment_bytes < SLOT_ALIGN_BYTES:
            raise ValueError(f"arena_segment_bytes must be at least one page ({SLOT_ALIGN_BYTES} B), got "
                             f"{self.arena_segment_bytes}")
        parse_hugepages(self.hugepages)
        parse_requested(self.npu_host_memory)
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path
                                           or "\0" in self.disk_path):  # the OS refuses NUL later, unnamed
            raise ValueError(f"disk_path must be a directory path (no NUL characters), got {self.disk_path!r}")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be set (> 0) when disk_path is ({self.disk_path!r}): it caps the "
                             f"chunk files each rank keeps there")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("disk_bytes is set but disk_path is not: name the directory for chunk files")
        for key in ("disk_writer_threads", "io_threads"):
            check_int(key, getattr(self, key), 1, 64)
        if self.disk_max_pending_bytes <= 0:
            raise ValueError(f"disk_max_pending_bytes must be positive, got {self.disk_max_pending_bytes}")
        if not isinstance(self.disk_write_through, bool):
            raise ValueError(f"disk_write_through must be true or false, got {self.disk_write_through!r}")
        if not isinstance(self.put_to_remote, bool):
            raise ValueError(f"put_to_remote must be true or false, got {self.put_to_remote!r}")
        if not isinstance(self.yield_to_compute, bool):
            raise ValueError(f"yield_to_compute must be true or false, got {self.yield_to_compute!r}")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(sorted(POLICIES))}, "
                             f"got {self.eviction_policy!r}")
        for key in ("remote_admit_hits", "disk_admit_hits"):
            check_int(key, getattr(self, key), 0, 1000)  # 0: no reuse gate
        if self.mooncake is not None:
            MooncakeConfig.from_dict(self.mooncake)  # its errors name the mooncake key
        if self.transfer_cpus is not None:
            object.__setattr__(self, "transfer_cpus", check_cpu_list("transfer_cpus", self.transfer_cpus))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "StoreConfig":
        """From the store's keys of `kv_connector_extra_config`; an unknown key is refused with the valid ones."""
        parsed = parse_section("store", cls, values, cls._SIZES)
        if parsed.get("mooncake") is not None and not isinstance(parsed["mooncake"], Mapping):
            raise ValueError(f"mooncake must be an object of Mooncake settings, got {parsed['mooncake']!r}")
        return cls(**parsed)

    def mooncake_config(self) -> Optional[MooncakeConfig]:
        """The parsed Mooncake settings, or None when the remote tier is off."""
        if self.mooncake is None:
            return None
        return MooncakeConfig.from_dict(self.mooncake)
