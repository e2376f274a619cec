"""The content identity of a LoRA adapter as vLLM runs it, not as its files say now (issue 31, finding N2).

vLLM loads an adapter's weights for a `lora_int_id` the first time a request names it and keeps them for that id;
it reads the files again only for a request with `load_inplace`. The files may change in the meantime (an adapter
updated in place), and an adapter evicted from vLLM's LoRA cache is reloaded from whatever the files then hold. So:

* an id's digest is taken from its files when a request first names the id (vLLM loads the adapter for it), and
  kept for that id;
* a `load_inplace` request takes it again (vLLM reloads the files for it);
* when the files change under a kept digest, which weights vLLM computes with is unknown (the old ones while they
  stay loaded, the new ones after an eviction reloads them): the id's requests bypass the plugin (no lookups, no
  stores: vLLM computes) until a `load_inplace` request or a restart, with one warning. No KV is ever filed under a
  digest of weights vLLM may not be running.

The window left: the files changing between the digest and vLLM's load of the same request, seconds at most.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

from ...identity.adapters import AdapterDigests
from .adapter import LoraRef

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    path: str
    digest: bytes
    stale: str = ""  # why the digest may no longer be the weights vLLM runs ("": it is)


class LoadedAdapters:
    """Digest per `lora_int_id` as vLLM loaded it (see the module docstring); thread-safe."""

    def __init__(self, digests: Optional[AdapterDigests] = None) -> None:
        self._digests = digests if digests is not None else AdapterDigests()
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()
        self.stale_ids: set[int] = set()  # ids bypassed since their files changed under them (for stats and tests)

    def digest(self, lora: LoraRef) -> Optional[bytes]:
        """The digest that names `lora`'s KV, or None when nothing may name it (unreadable files, or files that
        changed under the weights vLLM holds): such a request bypasses the plugin."""
        current = self._digests.get(lora.path) if lora.path else None
        with self._lock:
            held = self._held.get(lora.int_id)
            if held is None or lora.load_inplace:
                if current is None:
                    self._held.pop(lora.int_id, None)
                    return None
                if held is not None and held.digest != current:
                    logger.info("LoRA adapter %s (id %d) reloaded in place: its KV is named by the new files' digest",
                                lora.name, lora.int_id)
                self._held[lora.int_id] = _Held(lora.path, current)
                self.stale_ids.discard(lora.int_id)
                return current
            if held.stale:
                return None
            if lora.path != held.path:
                held.stale = f"its path changed from {held.path} to {lora.path} without load_inplace"
            elif current != held.digest:
                held.stale = "its files changed after vLLM loaded it" + (" (and cannot be read now)"
                                                                           if current is None else "")
            if held.stale:
                self.stale_ids.add(lora.int_id)
                logger.warning("LoRA adapter %s (id %d): %s; vLLM may run either version, so its requests bypass "
                               "lmcache_npu until a request with load_inplace=True reloads it (or vLLM restarts)",
                               lora.name, lora.int_id, held.stale)
                return None
            return held.digest
