"""systemd's file-descriptor store, so a crashed or restarted node cache finds its host cache again: spoken here, as
`sd_notify` does, without libsystemd.

When systemd runs the service (`NOTIFY_SOCKET` set, `FileDescriptorStoreMax=` large enough) every pool made sends
systemd a duplicate of each segment file, and a small sealed memory file (its manifest: geometry, epoch, layout),
one datagram per descriptor (`FDSTORE=1`, `FDNAME=`, SCM_RIGHTS). systemd holds them while the service is away and
passes them to its next start (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`, from descriptor 3 on); that start
adopts each pool whose manifest and files agree (`rebuild.py` then verifies every slot before it serves it), and
gives every other one back to the kernel (`FDSTOREREMOVE=1`), so the store never holds memory no pool uses. A pool
given back for good (idle, or making room) is removed from the store too.

Names: `lmcnpu.<epoch>.m` for the manifest, `lmcnpu.<epoch>.r<rank>.s<segment>` for a segment (the epoch's "/" as
"."): a name says what a descriptor is without opening it, and descriptors of other names are left alone.
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import os
import re
import socket
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping, MutableMapping, Optional, Sequence

from .messages import PoolGeometry
from .rebuild import InheritedArena

if TYPE_CHECKING:
    from .pool import NodePool

logger = logging.getLogger(__name__)

PREFIX = "lmcnpu."
MANIFEST_FORMAT = 1
LISTEN_FDS_START = 3  # sd_listen_fds(3): the first descriptor systemd passes
MAX_MANIFEST_BYTES = 1 << 20
_NAME = re.compile(r"^lmcnpu\.(?P<pool>[0-9a-f]{1,64}\.[0-9]{1,9})\.(?:m|r(?P<rank>[0-9]{1,5})\.s(?P<seg>[0-9]{1,7}))$")
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class FdStoreError(ValueError):
    """What systemd passed cannot be adopted (names the pool and the rule): that pool starts cold."""


def notify(state: str, fds: Sequence[int] = (), environ: Mapping[str, str] = os.environ) -> bool:
    """Sends `state` (and `fds`) to the service manager at $NOTIFY_SOCKET; False when there is none."""
    path = environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path[0] not in "/@":
        raise OSError(f"NOTIFY_SOCKET={path!r} is not a Unix socket path (vsock is not spoken here)")
    address = "\0" + path[1:] if path[0] == "@" else path  # "@": an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([state.encode()], ancillary, 0, address)
    return True


def pool_tag(epoch: str) -> str:
    return epoch.replace("/", ".")


def manifest_of(pool: "NodePool") -> dict:
    arena = pool.arenas[0]
    geometry = pool.geometry
    return {"format": MANIFEST_FORMAT, "epoch": pool.epoch, "namespace": geometry.namespace,
            "layout_fingerprint": geometry.layout_fingerprint.hex(), "world": geometry.world,
            "object_bytes": geometry.object_bytes, "chunk_tokens": geometry.chunk_tokens,
            "num_slots": arena.num_slots, "segment_bytes": pool.store.arena_segment_bytes,
            "hugepages": pool.store.hugepages, "segments": len(arena.segment_fds),
            "next_cmd_id": pool.index.next_command_id}


def sealed_file(name: str, data: bytes) -> int:
    """A memory file holding `data`, sealed against any change (a manifest no later process can alter)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


class SystemdFdStore:
    """Keeps pools' memory in systemd's descriptor store (`pool_table.PoolKeeper`)."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self.environ = environ
        self.kept: dict[str, list[str]] = {}  # pool tag -> the names stored for it

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Optional["SystemdFdStore"]:
        return cls(environ) if environ.get("NOTIFY_SOCKET") else None

    def keep(self, pool: "NodePool") -> None:
        tag = pool_tag(pool.epoch)
        if tag in self.kept:  # inherited from the store: systemd holds it already
            return
        manifest = sealed_file(f"lmcache-npu-manifest-{tag}", json.dumps(manifest_of(pool)).encode())
        stored = [f"{PREFIX}{tag}.m"]
        try:
            self._store(stored[0], manifest)
            for rank in range(pool.geometry.world):
                for segment, fd in enumerate(pool.segment_fds(rank)):
                    name = f"{PREFIX}{tag}.r{rank}.s{segment}"
                    self._store(name, fd)
                    stored.append(name)
        finally:
            os.close(manifest)  # systemd holds its own duplicate
            self.kept[tag] = stored
        logger.info("node cache pool %s: its %d descriptor(s) are kept by systemd (a restart finds the host cache "
                    "again)", pool.epoch, len(stored))

    def _store(self, name: str, fd: int) -> None:
        notify(f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0", [fd], self.environ)

    def forget(self, pool: "NodePool") -> None:
        self.forget_tag(pool_tag(pool.epoch))

    def forget_tag(self, tag: str, names: Optional[list[str]] = None) -> None:
        for name in names if names is not None else self.kept.pop(tag, []):
            notify(f"FDSTOREREMOVE=1\nFDNAME={name}", (), self.environ)

    def adopted(self, tag: str, names: list[str]) -> None:
        """A pool inherited from the store: its descriptors are systemd's already (forget() removes them later)."""
        self.kept[tag] = list(names)

    def ready(self) -> None:
        """Tells systemd the service serves (Type=notify)."""
        notify("READY=1", (), self.environ)


def passed_fds(environ: MutableMapping[str, str] = os.environ) -> dict[str, int]:
    """Name -> descriptor of what systemd passed this process (ours by their prefix; the variables are unset so no
    child inherits them). Empty when nothing was passed to this very process."""
    if environ.get("LISTEN_PID") != str(os.getpid()):
        return {}
    try:
        count = int(environ.get("LISTEN_FDS", "0"))
    except ValueError:
        count = 0
    names = environ.get("LISTEN_FDNAMES", "").split(":")
    for variable in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(variable, None)
    passed = {}
    for number in range(count):
        name = names[number] if number < len(names) else ""
        if name.startswith(PREFIX):
            fd = LISTEN_FDS_START + number
            os.set_inheritable(fd, False)
            passed[name] = fd
    return passed


def inherited_pools(passed: dict[str, int], store: Optional[SystemdFdStore]
                    ) -> list[tuple[PoolGeometry, InheritedArena, str, list[str]]]:
    """(geometry, arena, tag, names) of each pool whose manifest and files agree; every other pool's descriptors are
    closed (and removed from the store), with an error naming the pool and what is wrong."""
    grouped: dict[str, dict[str, int]] = defaultdict(dict)
    for name, fd in passed.items():
        match = _NAME.match(name)
        tag = match.group("pool") if match else name
        grouped[tag][name] = fd
    pools = []
    for tag, members in sorted(grouped.items()):
        names = sorted(members)
        try:
            geometry, arena = _pool_of(tag, members)
        except (FdStoreError, OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("node cache: the descriptor store's pool %s is not adopted (its chunks are lost, never "
                         "misread; the pool starts cold): %s", tag, exc)
            for fd in members.values():
                os.close(fd)
            if store is not None:
                store.forget_tag(tag, names)
            continue
        pools.append((geometry, arena, tag, names))
    return pools


def _pool_of(tag: str, members: dict[str, int]) -> tuple[PoolGeometry, InheritedArena]:
    manifest_fd = members.get(f"{PREFIX}{tag}.m")
    if manifest_fd is None:
        raise FdStoreError("no manifest among its descriptors")
    manifest = _read_manifest(manifest_fd)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise FdStoreError(f"manifest format {manifest.get('format')!r}, this release reads {MANIFEST_FORMAT}")
    if pool_tag(str(manifest.get("epoch"))) != tag:
        raise FdStoreError(f"its manifest names epoch {manifest.get('epoch')!r}")
    geometry = PoolGeometry(str(manifest["namespace"]), bytes.fromhex(manifest["layout_fingerprint"]),
                            int(manifest["world"]), int(manifest["object_bytes"]), int(manifest["chunk_tokens"]))
    segments = int(manifest["segments"])
    fds = []
    for rank in range(geometry.world):
        names = [f"{PREFIX}{tag}.r{rank}.s{segment}" for segment in range(segments)]
        missing = [name for name in names if name not in members]
        if missing:
            raise FdStoreError(f"rank {rank} lacks {len(missing)} of its {segments} segment(s) ({missing[0]} ...)")
        fds.append([members[name] for name in names])
    expected = 1 + geometry.world * segments
    if len(members) != expected:
        raise FdStoreError(f"{len(members)} descriptors, its manifest names {expected}")
    arena = InheritedArena(epoch=str(manifest["epoch"]), num_slots=int(manifest["num_slots"]),
                           segment_bytes=int(manifest["segment_bytes"]), hugepages=str(manifest["hugepages"]),
                           fds=fds, next_cmd_id=int(manifest.get("next_cmd_id", 0)), torn=None)
    os.close(manifest_fd)  # last: on any refusal above the caller closes every descriptor of the pool
    return geometry, arena


def _read_manifest(fd: int) -> dict:
    size = os.fstat(fd).st_size
    if not 0 < size <= MAX_MANIFEST_BYTES:
        raise FdStoreError(f"a manifest of {size} B")
    data = os.pread(fd, size, 0)
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise FdStoreError(f"its manifest is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise FdStoreError("its manifest is not a JSON object")
    return manifest
