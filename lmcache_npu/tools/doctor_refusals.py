"""The refusals the engine makes at start, predicted by `lmcache-npu doctor` with the functions the engine itself calls,
so a configuration the engine refuses fails here with the engine's own message:

- the store secret and the Mooncake trust rule: `store.factory.store_sealer` (each worker's first step);
- the block-hash seed with a tier that outlives the engine: `store.keys.check_stable_hashing` (the scheduler's start);
- the disk tier's directory (`store.disk.root_refusal`) and, with data parallelism, its parent (`parent_refusal`);
- the node cache's socket: the process behind it (`node.client.check_service_peer`, what every attach asks).
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping, Optional

from ..config import ConnectorConfig
from ..node.client import NodeCacheUnavailable, check_service_peer
from ..store.disk import data_parallel_root, parent_refusal, root_refusal
from ..store.factory import store_sealer
from ..store.keys import check_stable_hashing
from ..store.secret import SECRET_ENV
from .doctor_verdict import FAIL, OK, SKIP, WARN, Check

REFUSED_FIX = "the engine refuses to start with this; fix what the message names"
CONNECT_TIMEOUT_S = 2.0


def check_secret(config: ConnectorConfig, environ: Mapping[str, str]) -> Check:
    """The store secret as the workers resolve it, and whether a Mooncake tier may run with what was found."""
    name = "store secret"
    try:
        keyed = store_sealer(config.store, environ).keyed
    except ValueError as exc:
        return Check(name, FAIL, str(exc), REFUSED_FIX)
    mooncake = config.store.mooncake_config()
    if keyed:
        source = (f"mooncake.secret_file {mooncake.secret_file}" if mooncake is not None and mooncake.secret_file
                  else SECRET_ENV)
        return Check(name, OK, f"from {source}: chunk envelopes carry a MAC")
    if mooncake is None and config.store.disk_path is None:
        return Check(name, SKIP, "none, and no disk or Mooncake tier that would use one")
    return Check(name, OK, "none: envelopes carry digests only (Mooncake with trusted_network, or a disk tier)",
                 "set mooncake.secret_file or LMCACHE_NPU_SECRET to key them (docs/configuration.md)")


def check_hash_seed(config: ConnectorConfig, algorithm: str, environ: Mapping[str, str]) -> Check:
    """PYTHONHASHSEED and the block-hash algorithm, when a tier outlives the engine (the scheduler's start check)."""
    name = "block hashes"
    if not config.outlives_engine:
        return Check(name, SKIP, "only the engine's host arena: chunk names need not outlive it")
    try:
        check_stable_hashing(algorithm, environ, allow_fast_block_hash=config.allow_fast_block_hash)
    except ValueError as exc:
        return Check(name, FAIL, str(exc), REFUSED_FIX)
    return Check(name, OK, f"prefix_caching_hash_algo {algorithm} with PYTHONHASHSEED set (in this shell: run doctor "
                 "where vllm serve runs)")


def check_disk_directory(disk_path: Optional[str], data_parallel_size: int) -> Check:
    """The disk tier's directory (each rank's under `disk_path` with data parallelism, and `disk_path` itself)."""
    name = "disk directory"
    if not disk_path:
        return Check(name, SKIP, "off (no disk_path)")
    if data_parallel_size > 1:
        refusals = [parent_refusal(disk_path)] + [root_refusal(data_parallel_root(disk_path, rank))
                                                  for rank in range(data_parallel_size)]
    else:
        refusals = [root_refusal(disk_path)]
    refusal = next((r for r in refusals if r is not None), None)
    if refusal is not None:
        return Check(name, FAIL, str(refusal), REFUSED_FIX)
    made = "" if os.path.lexists(disk_path) else " (missing: the engine makes it, mode 0700)"
    ranks = f", one dp<rank> directory for each of {data_parallel_size} ranks" if data_parallel_size > 1 else ""
    return Check(name, OK, f"{disk_path}: no one else may write it{made}{ranks}")


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def check_node_cache_socket(path: Optional[str], connect: Callable[[str], socket.socket] = _connect) -> Check:
    """Whether a node cache service listens at `path`, and whether the engine would trust the process behind it."""
    name = "node cache socket"
    if path is None:
        return Check(name, SKIP, "off (no node_cache)")
    try:
        sock = connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        return Check(name, WARN, f"no node cache service listens on {path} ({exc.strerror}): the engine serves "
                     "without it and attaches in the background once one does",
                     f"start `lmcache-npu node-cache --socket {path} ...` on this node (docs/deployment.md)")
    except OSError as exc:
        return Check(name, FAIL, f"{path}: {exc.strerror or exc}: the engine cannot attach",
                     "give the serving user access to the socket (the service's --group)")
    try:
        check_service_peer(sock, path)
    except NodeCacheUnavailable as exc:
        return Check(name, FAIL, str(exc), "the engine refuses this service; serve the node cache as this user or "
                     "root, or from a directory only its user may write")
    finally:
        sock.close()
    return Check(name, OK, f"{path}: a node cache service this engine trusts")


def check_refusals(config: Optional[ConnectorConfig], environ: Mapping[str, str], disk_path: Optional[str] = None,
                   data_parallel_size: int = 1, hash_algorithm: str = "sha256",
                   connect: Callable[[str], socket.socket] = _connect) -> list[Check]:
    """Every start-up refusal for `config` (none when the config itself was refused: its check says why)."""
    if config is None:
        return []
    return [check_secret(config, environ), check_hash_seed(config, hash_algorithm, environ),
            check_disk_directory(disk_path or config.store.disk_path, data_parallel_size),
            check_node_cache_socket(config.node_cache, connect)]
