"""LoRA adapters' content digests: `adapter_digest` digests an adapter directory by the rules of
`fingerprint_weights` under a distinct domain string (an adapter digest never equals a weights digest of the same
files) and reads adapters whole whenever they fit the budget. `AdapterDigests` caches adapter digests by path and the
(size, mtime_ns, inode) of every file under it."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

from .checkpoint_files import walk_files
from .weights import DEFAULT_MAX_READ_BYTES, DEFAULT_THREADS, FORMAT_VERSION, PathLike, fingerprint_directory

logger = logging.getLogger(__name__)

_ADAPTER_DOMAIN = b"lmcache-npu lora adapter v%d" % FORMAT_VERSION


def adapter_digest(adapter_dir: PathLike, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                   threads: int = DEFAULT_THREADS) -> bytes:
    """32 bytes over a LoRA adapter directory (adapter_config.json, adapter weights, new embeddings): the same
    rules as `fingerprint_weights` under a distinct domain, reading the adapter whole when it fits the budget."""
    return fingerprint_directory(adapter_dir, _ADAPTER_DOMAIN, max_read_bytes, max_read_bytes, threads).digest


class AdapterDigests:
    """Adapter digests computed once per adapter and again when any file in its directory changes (size, mtime_ns
    or inode); thread-safe. `get` gives None, and one warning per path, when a directory cannot be read."""

    def __init__(self, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES, threads: int = DEFAULT_THREADS) -> None:
        self._max_read_bytes = max_read_bytes
        self._threads = threads
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[tuple[str, int, int, int], ...], bytes]] = {}
        self._warned: set[str] = set()
        self.computed = 0  # digests computed (not served from the cache)

    @staticmethod
    def _signature(root: str) -> tuple[tuple[str, int, int, int], ...]:
        signature = []
        for name, path in walk_files(root):
            st = os.stat(path)
            signature.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(signature)

    def get(self, path: PathLike) -> Optional[bytes]:
        """The adapter's digest, from the cache while no file under it changed."""
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            try:
                signature = self._signature(key)  # taken first: a write during the digest shows up next time
                cached = self._cache.get(key)
                if cached is not None and cached[0] == signature:
                    return cached[1]
                digest = adapter_digest(key, max_read_bytes=self._max_read_bytes, threads=self._threads)
            except (OSError, ValueError) as exc:
                self._cache.pop(key, None)
                if key not in self._warned:
                    self._warned.add(key)
                    logger.warning("cannot digest LoRA adapter %s: %s", key, exc)
                return None
            self._warned.discard(key)
            self._cache[key] = (signature, digest)
            self.computed += 1
            return digest
