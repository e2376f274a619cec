"""Chunk keys (DESIGN §7): vLLM's prefix-chained block hash at a chunk's last token, scoped by model and layout.

A chunk is named by the block hash vLLM computed for the hash block that ends where the chunk ends, so LoRA,
multimodal inputs and cache salt (all inside vLLM's hash) are already part of it. The namespace adds what vLLM's
hash does not see: which model produced the bytes and how they are laid out (plan geometry and format
version). Each parallel rank stores its own shard under its own storage name.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from ..ops import LAYOUT_VERSION, TransferPlan

# vLLM's prefix-caching hash algorithms; all hash the same input to the same bytes in any process once
# NONE_HASH (the chain's seed) is fixed, which vLLM does only when PYTHONHASHSEED is set.
STABLE_HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# Appended to a chunk hash for the copy without end-state rows; a namespace fixes the hash algorithm (the model
# fingerprint names it), hence the hash length, so a marked hash never equals another chunk's hash.
_WITHOUT_END_STATE = b"\x00no-end-state"


def check_stable_hashing(algorithm: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuses a block-hash setup that would name the same prefix differently in another process or restart."""
    env = os.environ if environ is None else environ
    if algorithm not in STABLE_HASH_ALGORITHMS:
        raise ValueError(f"prefix_caching_hash_algo {algorithm!r} is not stable across processes; a shared or "
                         f"persistent KV cache needs one of {', '.join(STABLE_HASH_ALGORITHMS)}")
    if env.get("PYTHONHASHSEED") in (None, "", "random"):
        raise ValueError("PYTHONHASHSEED is not set: vLLM then seeds every block-hash chain with os.urandom, so no "
                         "other process or restart can find a stored chunk; set PYTHONHASHSEED to the same fixed "
                         "value (e.g. 0) for every vLLM instance that shares this cache")


def layout_fingerprint(plan: TransferPlan) -> bytes:
    """16 bytes over the plan's geometry and the format version: the same model laid out the same way matches
    across processes and device families; addresses and block counts do not enter it."""
    h = hashlib.sha256(f"lmcache-npu layout v{LAYOUT_VERSION} chunk {plan.chunk_tokens}".encode())
    for g in plan.groups:
        h.update(repr((g.tokens_per_block, g.compress_ratio, g.sliding_window, g.skip)).encode())
    for p, offset in zip(plan.moved_planes, plan.object_offsets):
        h.update(repr((p.group, p.rows_per_block, p.row_bytes, int(p.layout), p.nz_unit_bytes, str(p.dtype),
                       offset)).encode())
    h.update(str(plan.object_bytes).encode())
    return h.digest()[:16]


def model_fingerprint(**facts: Any) -> bytes:
    """16 bytes over what makes KV bytes of one model differ from another's (name, revision, dtypes, quantisation,
    parallel sizes): pass them as keywords; order does not matter."""
    text = ";".join(f"{k}={facts[k]!r}" for k in sorted(facts))
    return hashlib.sha256(text.encode()).digest()[:16]


class ChunkKey(NamedTuple):
    """One chunk of one model and layout; the index works with these, tiers with `storage_name(rank)`. A named tuple:
    a 128K-token prompt looks up 512 of them per scheduling step, and tuples are made and hashed fast."""

    namespace: str  # 32 hex chars: model and layout fingerprints together
    chunk_hash: bytes  # vLLM's block hash at the chunk's last token

    def without_end_state(self) -> "ChunkKey":
        """The same chunk stored without its end-state rows (a recurrent state vLLM did not keep at this chunk's
        end): usable inside a longer hit, never as its last chunk. A distinct key, so a complete copy and this one
        live side by side in every tier."""
        return ChunkKey(self.namespace, self.chunk_hash + _WITHOUT_END_STATE)

    def storage_name(self, rank: int) -> str:
        """The name a rank's shard has on disk and in Mooncake: flat, filesystem and URL safe."""
        return f"{self.namespace}-{self.chunk_hash.hex()}-r{rank}"

    @classmethod
    def from_storage_name(cls, name: str) -> tuple["ChunkKey", int]:
        """The key and rank a storage name was made from (a restart rebuilds the index from file names)."""
        parts = name.split("-")
        if len(parts) != 3 or len(parts[0]) != 32 or not parts[2].startswith("r") or not parts[2][1:].isdigit():
            raise ValueError(f"{name!r} is not a chunk storage name (namespace-hash-r<rank>)")
        try:
            return cls(parts[0], bytes.fromhex(parts[1])), int(parts[2][1:])
        except ValueError as exc:
            raise ValueError(f"{name!r} is not a chunk storage name: {exc}") from None


def namespace_of(model: bytes, layout: bytes) -> str:
    return hashlib.sha256(model + layout).hexdigest()[:32]


def chunk_keys(block_hashes: Sequence[bytes], hash_block_size: int, chunk_tokens: int, namespace: str,
               num_tokens: Optional[int] = None, first_chunk: int = 0) -> list[ChunkKey]:
    """Keys of the request's full chunks from `first_chunk` on, in order: chunk c is named by the hash of block
    `(c + 1) * k - 1`, k = chunk_tokens / hash_block_size. `num_tokens` limits them to chunks the request already
    holds."""
    if chunk_tokens % hash_block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of the hash block size {hash_block_size}")
    per_chunk = chunk_tokens // hash_block_size
    full = len(block_hashes) // per_chunk
    if num_tokens is not None:
        full = min(full, num_tokens // chunk_tokens)
    return [ChunkKey(namespace, bytes(block_hashes[(c + 1) * per_chunk - 1])) for c in range(first_chunk, full)]
