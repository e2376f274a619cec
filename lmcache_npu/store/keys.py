"""Chunk keys (DESIGN §7): vLLM's prefix-chained block hash at a chunk's last token, scoped by model and layout.

A chunk is named by the block hash vLLM computed for the hash block that ends where the chunk ends, so the LoRA
name, multimodal inputs and cache salt (all inside vLLM's hash) are already part of it; a LoRA request's hash is
re-keyed by its adapter's content digest, since vLLM's hash sees only the adapter's name. The namespace adds what
vLLM's hash does not see: which model produced the bytes (its weights' content, effective config, dtypes, TP
size: `model_fingerprint` over the workers' facts) and how they are laid out (`TransferPlan.fingerprint`: plan
geometry and format version).
Each parallel rank stores its own shard under its own storage name.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

from ..checks import hash_blocks_per_chunk

logger = logging.getLogger(__name__)

# vLLM's prefix-caching hash algorithms; all hash the same input to the same bytes in any process once
# NONE_HASH (the chain's seed) is fixed, which vLLM does only when PYTHONHASHSEED is set.
STABLE_HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# The ones whose collisions nobody can construct: a persistent or shared tier trusts a chunk's name to mean its prefix.
CRYPTOGRAPHIC_HASH_ALGORITHMS = ("sha256", "sha256_cbor")
# Appended to a chunk hash for the copy without end-state rows; a namespace fixes the hash algorithm (the model
# fingerprint names it), hence the hash length, so a marked hash never equals another chunk's hash.
_WITHOUT_END_STATE = b"\x00no-end-state"
# The fix a refused seed names: one value per deployment, chosen like a password.
_SEED_FIX = ("set PYTHONHASHSEED to one secret random value shared by the instances of this deployment, e.g. "
             "`python3 -c 'import secrets; print(secrets.randbelow(2**32 - 1) + 1)'`, kept like a password")
# Domain of a chunk hash re-keyed by a LoRA adapter's content digest.
_ADAPTER_DOMAIN = b"lmcache-npu adapter chunk v1\x00"
# Domain of a prompt's last, partial chunk (P/D hand-off): no vLLM block hash ends there, so it is named by its own.
_TAIL_DOMAIN = b"lmcache-npu prompt tail chunk v1\x00"


def check_stable_hashing(algorithm: str, environ: Optional[Mapping[str, str]] = None,
                         allow_fast_block_hash: bool = False) -> None:
    """Refuses a block-hash setup that would name the same prefix differently in another process or restart, or
    whose collisions can be constructed (a tier outliving the process trusts a chunk's name to mean its prefix);
    `allow_fast_block_hash` turns the second refusal into a loud warning. Called only with a disk or Mooncake tier,
    so a host-only arena runs with any PYTHONHASHSEED, `0` included."""
    env = os.environ if environ is None else environ
    if algorithm not in STABLE_HASH_ALGORITHMS:
        raise ValueError(f"prefix_caching_hash_algo {algorithm!r} is not stable across processes; a shared or "
                         f"persistent KV cache needs one of {', '.join(CRYPTOGRAPHIC_HASH_ALGORITHMS)}")
    if algorithm not in CRYPTOGRAPHIC_HASH_ALGORITHMS:
        why = (f"prefix_caching_hash_algo {algorithm!r} is not cryptographic: a prompt can be crafted whose block "
               f"hash equals another prompt's, and a disk or Mooncake tier would then serve that prompt's KV")
        if not allow_fast_block_hash:
            raise ValueError(f"{why}. Use --prefix-caching-hash-algo {' or '.join(CRYPTOGRAPHIC_HASH_ALGORITHMS)}, or "
                             "set allow_fast_block_hash: true to accept the risk")
        logger.warning("lmcache_npu: %s (allowed by allow_fast_block_hash)", why)
    seed = env.get("PYTHONHASHSEED")
    if seed is None or seed in ("", "random"):
        raise ValueError("PYTHONHASHSEED is not set: vLLM then seeds every block-hash chain with os.urandom, so no "
                         "other process or restart can find a stored chunk; set PYTHONHASHSEED to the same value "
                         "for every vLLM instance that shares this cache (a random one, kept like a password: with "
                         "0, anyone can compute every chunk's name from a prompt)")
    if seed.strip().isdigit() and int(seed) == 0:
        raise ValueError(f"PYTHONHASHSEED={seed} is refused with a disk or Mooncake tier (disk_path, mooncake): 0 "
                         "disables hash randomization, so every deployment that sets it computes the same block "
                         "hashes and the names of its chunks are predictable across unrelated deployments sharing a "
                         f"store; {_SEED_FIX}")


def model_fingerprint(**facts: Any) -> bytes:
    """16 bytes over what makes KV bytes of one model differ from another's (weights digest, effective config,
    dtypes, quantisation, parallel sizes): pass them as keywords; order does not matter."""
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


def storage_names_of(namespace: Optional[str] = None, rank: Optional[int] = None) -> Callable[[str], bool]:
    """A test of storage names (`ChunkKey.storage_name`) for those of `namespace` and `rank` (None: any); a tier
    scanning a directory other models and ranks share judges only the names it owns."""
    prefix = None if namespace is None else f"{namespace}-"
    suffix = None if rank is None else f"-r{rank}"

    def owns(name: str) -> bool:
        return (prefix is None or name.startswith(prefix)) and (suffix is None or name.endswith(suffix))

    return owns


def namespace_of(model: bytes, layout: bytes) -> str:
    return hashlib.sha256(model + layout).hexdigest()[:32]


def adapter_chunk_hash(block_hash: bytes, adapter_digest: bytes) -> bytes:
    """A chunk hash re-keyed by the content of the LoRA adapter that computed it: vLLM's block hash names the
    adapter only by `lora_name`, so another adapter loaded under the same name must not find these chunks."""
    return hashlib.sha256(_ADAPTER_DOMAIN + adapter_digest + bytes(block_hash)).digest()


def chunk_keys(block_hashes: Sequence[bytes], hash_block_size: int, chunk_tokens: int, namespace: str,
               num_tokens: Optional[int] = None, first_chunk: int = 0,
               adapter_digest: Optional[bytes] = None) -> list[ChunkKey]:
    """Keys of the request's full chunks from `first_chunk` on, in order: chunk c is named by the hash of block
    `(c + 1) * k - 1`, k = chunk_tokens / hash_block_size. `num_tokens` limits them to chunks the request already
    holds; `adapter_digest` (a LoRA request's adapter content) re-keys every chunk."""
    per_chunk = hash_blocks_per_chunk(chunk_tokens, hash_block_size)
    full = len(block_hashes) // per_chunk
    if num_tokens is not None:
        full = min(full, num_tokens // chunk_tokens)
    hashes = [bytes(block_hashes[(c + 1) * per_chunk - 1]) for c in range(first_chunk, full)]
    if adapter_digest is not None:
        hashes = [adapter_chunk_hash(h, adapter_digest) for h in hashes]
    return [ChunkKey(namespace, h) for h in hashes]


def tail_chunk_key(block_hashes: Sequence[bytes], hash_block_size: int, chunk_tokens: int, namespace: str,
                   token_ids: Sequence[int], num_tokens: int,
                   adapter_digest: Optional[bytes] = None) -> Optional[ChunkKey]:
    """The key of the partial chunk that ends at token `num_tokens` (a prompt's tail, stored for a P/D hand-off), or
    None where there is none to name: the tokens end on a chunk boundary, or no whole hash block precedes them (the
    chain's hash carries the LoRA name, cache salt and earlier multimodal inputs; the caller refuses a tail holding
    multimodal inputs of its own). Named by vLLM's hash of the last whole hash block and the token ids after it."""
    whole = num_tokens // hash_block_size
    if num_tokens % chunk_tokens == 0 or whole == 0 or len(block_hashes) < whole or len(token_ids) < num_tokens:
        return None
    tail = token_ids[whole * hash_block_size:num_tokens]
    body = b"".join(int(t).to_bytes(4, "little", signed=True) for t in tail)
    digest = hashlib.sha256(_TAIL_DOMAIN + bytes(block_hashes[whole - 1]) + num_tokens.to_bytes(8, "little")
                            + body).digest()
    if adapter_digest is not None:
        digest = adapter_chunk_hash(digest, adapter_digest)
    return ChunkKey(namespace, digest)
