"""Another Mooncake instance for benchmarks: a child process that contributes the global segment and puts sealed
chunk objects into it, so that the parent's gets (from a client that contributes no memory) cross the transfer
engine's TCP transport instead of being served as a local memcpy.

    with MooncakePeer(master, specs, secret) as peer:   # the objects exist once __enter__ returns
        ...                                             # the parent gets them; they live until __exit__

The child reads one JSON line from stdin (the master, the segment size, the secret as hex and the objects), puts
every object, answers one JSON line on stdout, then holds its segment until stdin closes. Run as a script only by
`MooncakePeer` (`python -m lmcache_npu.tools.bench.studies.mooncake_peer`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

from lmcache_npu.store.arena import HostArena
from lmcache_npu.store.envelope import Sealer, seal, sealed_bytes
from lmcache_npu.store.keys import ChunkKey

_SEGMENT_HEADROOM = 1.25  # the master evicts near a full segment: keep every object well below the watermark
_SEGMENT_SLACK = 64 << 20


@dataclass(frozen=True)
class PeerObject:
    """One sealed chunk object the peer puts: the payload is `object_bytes` seeded random bytes, the trailer seals
    it for (`namespace`, `chunk_hash_hex`) at rank 0 with `digest` (under the secret when `keyed`)."""

    namespace: str
    chunk_hash_hex: str
    object_bytes: int
    seed: int
    digest: str
    keyed: bool

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.namespace, bytes.fromhex(self.chunk_hash_hex))

    @property
    def name(self) -> str:
        return self.key.storage_name(0)

    @property
    def sealed_size(self) -> int:
        return sealed_bytes(self.object_bytes)

    def sealed(self, secret: Optional[bytes], out: Optional[np.ndarray] = None) -> np.ndarray:
        """The object's bytes as the peer puts them (payload + envelope), written into `out` when given."""
        data = np.empty(self.sealed_size, dtype=np.uint8) if out is None else out[:self.sealed_size]
        if data.nbytes != self.sealed_size:
            raise ValueError(f"a buffer of {out.nbytes if out is not None else 0} bytes cannot hold a sealed object "
                             f"of {self.sealed_size}")
        data[:self.object_bytes] = np.random.default_rng(self.seed).integers(0, 256, self.object_bytes,
                                                                              dtype=np.uint8)
        seal(data, self.key, 0, Sealer(secret if self.keyed else None, digest=self.digest))
        return data


def segment_bytes_for(objects: Sequence[PeerObject]) -> int:
    """A global segment that holds every object with room to spare."""
    return int(sum(o.sealed_size for o in objects) * _SEGMENT_HEADROOM) + _SEGMENT_SLACK


class MooncakePeer:
    """The child process that owns the global segment; `__enter__` returns once every object is stored."""

    def __init__(self, master: str, metadata: str, objects: Sequence[PeerObject], secret: bytes,
                 start_timeout_s: float = 600.0) -> None:
        if not objects:
            raise ValueError("MooncakePeer needs at least one object to put")
        self.master = master
        self.metadata = metadata
        self.objects = list(objects)
        self.secret = secret
        self.start_timeout_s = start_timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.put_s = 0.0

    def __enter__(self) -> "MooncakePeer":
        request = {"master": self.master, "metadata": self.metadata, "secret": self.secret.hex(),
                   "segment_bytes": segment_bytes_for(self.objects), "objects": [asdict(o) for o in self.objects]}
        self.process = subprocess.Popen([sys.executable, "-m", __spec__.name], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()  # the child answers once every put is done, or dies
        if not line:
            code = self.process.wait(self.start_timeout_s)
            raise RuntimeError(f"the Mooncake peer process exited with {code} before storing its objects "
                               f"(its errors are on stderr above)")
        answer = json.loads(line)
        if answer.get("failed"):
            self.__exit__()
            raise RuntimeError(f"the Mooncake peer could not put {answer['failed']}")
        self.put_s = float(answer["put_s"])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()  # the child's signal to unmount its segment and exit
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None


def _serve(request: dict[str, Any]) -> int:
    """The child: contributes the segment, puts every object, holds them until stdin closes."""
    from lmcache_npu.store.mooncake import MooncakeConfig, MooncakeTier

    config = MooncakeConfig(master=request["master"], metadata=request["metadata"], local_hostname="127.0.0.1",
                            global_segment_bytes=int(request["segment_bytes"]), local_buffer_bytes=16 << 20,
                            timeout_s=120.0, retry_after_s=1.0, zero_copy=True, trusted_network=True)
    tier = MooncakeTier(config)
    secret = bytes.fromhex(request["secret"])
    objects = [PeerObject(**fields) for fields in request["objects"]]
    # one registered staging buffer, put from zero-copy: the client's copy path stages through its local buffer,
    # which refuses objects larger than that buffer (-600)
    staging = HostArena(1, max(o.object_bytes for o in objects), pinned=False)
    if not tier.register(staging.base_address, staging.total_bytes):
        raise RuntimeError("the peer could not register its staging buffer with the transfer engine")
    failed = []
    start = time.perf_counter()
    for peer_object in objects:
        data = peer_object.sealed(secret, out=staging.sealed_array(0))
        result = tier.put([peer_object.name], [memoryview(data)])[0]
        if not result.ok:
            failed.append(f"{peer_object.name}: {result.reason}")
    print(json.dumps({"put_s": time.perf_counter() - start, "failed": failed}), flush=True)
    sys.stdin.read()  # hold the segment (and so the objects) until the parent closes our stdin
    tier.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_serve(json.loads(sys.stdin.readline())))
