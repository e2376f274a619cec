"""Builds the scheduler's half of the store from a `StoreConfig` (the index), and the store sealer both halves use;
each rank's executor is built beside the worker pipeline (`transfer.pipeline.build_executor`).

Both halves derive their sizes from the same config and chunk object size, so slot numbers chosen by the index
mean the same slot in every rank's arena. Disk files and Mooncake objects hold the sealed object (chunk object and
its envelope trailer, `envelope.sealed_bytes`); the store secret that keys the envelopes' MAC is resolved once here
(`store_sealer`) for both tiers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional, Sequence

from .arena import slots_for_capacity
from .config import StoreConfig
from .disk import HEADER_BYTES, disk_chunks_for_capacity, scan_disk_directory
from .envelope import Sealer, sealed_bytes
from .index.chunk_index import ChunkIndex
from .index.contract import Admission
from .keys import ChunkKey, storage_names_of
from .secret import resolve_secret

logger = logging.getLogger(__name__)


def disk_keys_on_every_rank(path: str, layout_fingerprint: bytes, namespace: str,
                            num_ranks: int) -> tuple[list[ChunkKey], list[ChunkKey]]:
    """Chunks of `namespace` under `path`: those whose file every rank has, least recently written first (what a
    restarted scheduler adopts), and those only some ranks have (a crash mid-spill: useless, to be dropped)."""
    newest: dict[ChunkKey, float] = {}
    ranks: dict[ChunkKey, set[int]] = {}
    for entry in scan_disk_directory(path, layout_fingerprint, owns=storage_names_of(namespace)):
        try:
            key, rank = ChunkKey.from_storage_name(entry.name)
        except ValueError:
            continue
        if rank >= num_ranks:
            continue
        ranks.setdefault(key, set()).add(rank)
        newest[key] = max(newest.get(key, 0.0), entry.mtime)
    complete = [key for key, held in ranks.items() if len(held) == num_ranks]
    partial = [key for key, held in ranks.items() if len(held) < num_ranks]
    return sorted(complete, key=lambda k: newest[k]), partial


def remote_exists_for(client: Any, num_ranks: int):
    """A batch existence check for the index: a chunk is in the remote store when every rank's shard is."""

    def exists(keys: Sequence[ChunkKey]) -> list[bool]:
        names = [key.storage_name(rank) for key in keys for rank in range(num_ranks)]
        present = client.exists(names)
        return [all(present[i * num_ranks:(i + 1) * num_ranks]) for i in range(len(keys))]

    return exists


def build_index(config: StoreConfig, object_bytes: int, num_ranks: int, namespace: str, layout_fingerprint: bytes,
                remote_client: Optional[Any] = None, num_slots: Optional[int] = None,
                first_cmd_id: int = 1, admission: Optional[Admission] = None) -> ChunkIndex:
    """The scheduler's index; with a disk tier it adopts what a previous run left on disk. `remote_client` (a
    `MooncakeTier` the scheduler owns, only for existence checks) is built from the config when not given.
    `num_slots` caps the arena slots the index hands out (the smallest arena any rank reported); `admission` is the
    cost model's say on slow-tier writes (`cost.SlowTierAdmission.pays`)."""
    disk_chunks = 0
    if config.disk_path is not None:
        disk_chunks = disk_chunks_for_capacity(config.disk_bytes, sealed_bytes(object_bytes))
        if disk_chunks == 0:
            raise ValueError(f"disk_bytes {config.disk_bytes} holds no chunk file of "
                             f"{sealed_bytes(object_bytes) + HEADER_BYTES} B")
    remote_exists = None
    if config.mooncake is not None:
        if remote_client is None:
            remote_client = scheduler_mooncake_client(config)
        remote_exists = remote_exists_for(remote_client, num_ranks)
    slots = slots_for_capacity(config.cpu_bytes, object_bytes)
    index = ChunkIndex(slots if num_slots is None else min(slots, num_slots), num_ranks, disk_chunks=disk_chunks,
                       remote_exists=remote_exists, put_to_remote=config.put_to_remote,
                       disk_write_through=config.disk_write_through, eviction_policy=config.eviction_policy,
                       remote_admit_hits=config.remote_admit_hits, disk_admit_hits=config.disk_admit_hits,
                       first_cmd_id=first_cmd_id)
    index.admission = admission
    if config.disk_path is not None:
        complete, partial = disk_keys_on_every_rank(config.disk_path, layout_fingerprint, namespace, num_ranks)
        adopted = index.adopt_disk(complete)
        index.drop_disk_copies(partial)
        logger.info("store index: %d slots (%s), %d disk chunks (%d found on disk, %d partial ones dropped)%s%s",
                    index.num_slots, index.eviction_policy, disk_chunks, adopted, len(partial),
                    ", Mooncake" if remote_exists else "",
                    f", reuse gates: Mooncake {config.remote_admit_hits}, disk {config.disk_admit_hits}")
    return index


def scheduler_mooncake_client(config: StoreConfig, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The scheduler's Mooncake client, for existence checks only: it contributes no memory to the pool (its
    restart must not lose workers' chunks) and waits at most a second (a lookup must not stall on a sick master).
    The trust rule is checked here too, so the scheduler refuses to start as the workers would."""
    from .mooncake import MooncakeTier

    mooncake = config.mooncake_config()
    check_remote_trust(config, resolve_secret(mooncake.secret_file, environ) is not None)
    return MooncakeTier(dataclasses.replace(mooncake, global_segment_bytes=0, timeout_s=min(mooncake.timeout_s, 1.0)),
                        exists_only=True)


def check_remote_trust(config: StoreConfig, has_secret: bool) -> None:
    """A Mooncake tier without a store secret loads any object of the right name and length that anyone reaching the
    cluster wrote: refused unless the operator states, in `mooncake.trusted_network`, that no such host is hostile."""
    mooncake = config.mooncake_config()
    if mooncake is not None and not has_secret and not mooncake.trusted_network:
        raise ValueError("mooncake: no store secret is configured, so any host that reaches the Mooncake master or a "
                         "transfer-engine port could plant chunks this engine would load as its own KV. Set "
                         "mooncake.secret_file (a file of at least 16 random bytes, mode 0600, the same on every "
                         "instance) or LMCACHE_NPU_SECRET, or set mooncake.trusted_network: true if every host that "
                         "can reach those ports is trusted (docs/configuration.md, \"Mooncake\")")


def store_sealer(config: StoreConfig, environ: Optional[Mapping[str, str]] = None) -> Sealer:
    """The envelope sealer of every tier of this store: keyed by the store secret (`mooncake.secret_file` or
    LMCACHE_NPU_SECRET) when one is configured, a plain digest otherwise (a Mooncake tier then needs
    `trusted_network`)."""
    mooncake = config.mooncake_config()
    secret = resolve_secret(mooncake.secret_file if mooncake is not None else "", environ)
    check_remote_trust(config, secret is not None)
    if secret is None and (config.disk_path is not None or mooncake is not None):
        logger.info("secret: not configured; envelopes carry digests only (anyone who can write the disk directory "
                    "or reach the Mooncake master can forge chunks)")
    return Sealer(secret)
