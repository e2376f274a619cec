"""The engine's model identity (DESIGN §7): what a worker knows about the model it runs, as the `model_fingerprint`
half of every chunk's namespace.

Workers compute it after the model is built and before any chunk is named (`register_kv_caches`), from what they
actually hold: the weights' content (`identity.weights.fingerprint_weights` over the checkpoint vLLM loaded), the
effective config, dtypes and KV-cache dtype as this process set them, the KV-cache scales of the attention layers,
TP size and the block-hash algorithm. The scheduler never computes its own: it adopts the workers' namespace from
the handshake, so a worker-side rewrite (vllm-ascend's fp8 `cache_dtype` on A5) cannot split the two halves.

Weights that are not local files (random `dummy` weights, a remote streamer, a custom loader, a hub id that is not
in the local cache) have no content fingerprint: the operator names them with `model_fingerprint`, or only the
engine's own host arena runs (it lives and dies with this engine, so nothing another model computed can reach it).
The disk and Mooncake tiers and the node cache keep chunks beyond the engine and share them with other engines, so
they refuse such weights (and the node cache service refuses an engine whose attach says so).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from ...config import ConnectorConfig
from ...identity.naming import content_of, unnamed_weights_refusal
from ...node.messages import WEIGHTS_UNNAMED
from ...store.keys import model_fingerprint
from . import adapter

logger = logging.getLogger(__name__)

# The namespace of an engine whose weights could not be named: usable only by tiers that die with the engine.
UNNAMED_WEIGHTS = WEIGHTS_UNNAMED


class UnnamedWeightsError(ValueError):
    """Persistent or shared tiers (disk, Mooncake, the node cache) are configured, but nothing names the weights:
    their chunks could be loaded by an engine running other weights."""


@dataclass(frozen=True)
class EngineIdentity:
    """The model fingerprint of one engine and, for logs, `doctor` and `inspect`, what it was made of."""

    fingerprint: bytes
    weights: str  # "sha256:<hex>" (content), "named:<model_fingerprint>" or UNNAMED_WEIGHTS
    description: tuple[tuple[str, str], ...]

    def describe(self) -> dict[str, str]:
        return dict(self.description)

    @property
    def weights_naming(self) -> str:
        """How the weights are named: "sha256" (content), "named" (model_fingerprint) or "unnamed" (node.messages'
        WEIGHTS_*, what a node cache attach says)."""
        return self.weights.split(":", 1)[0]


def _weights(config: ConnectorConfig, vllm_config: Any) -> tuple[str, dict[str, str]]:
    """The weights' name and how it was found; UNNAMED_WEIGHTS with the reason when nothing names them."""
    if config.model_fingerprint is not None:
        return f"named:{config.model_fingerprint.strip()}", {"weights": "named by the model_fingerprint key"}
    source = adapter.weights_source(vllm_config)
    if not source.from_files:
        return UNNAMED_WEIGHTS, {"weights": f"load_format {source.load_format!r} does not read the weights from "
                                            "local files"}
    weights, model_dir = content_of(source.model, source.revision, source.download_dir)
    if isinstance(weights, str):
        return UNNAMED_WEIGHTS, {"weights": weights}
    facts = {f"weights.{k}": str(v) for k, v in weights.describe().items()}
    return f"sha256:{weights.digest.hex()}", {"weights": f"content of {model_dir}", **facts}


def engine_identity(config: ConnectorConfig, vllm_config: Any, layer_names: Iterable[str],
                    persistent_tiers: bool) -> EngineIdentity:
    """This worker's model identity. Raises `UnnamedWeightsError` when `persistent_tiers` (disk, Mooncake or the
    node cache: anything that keeps chunks beyond this engine) are configured and the weights cannot be named."""
    started = time.perf_counter()
    weights, how = _weights(config, vllm_config)
    if weights == UNNAMED_WEIGHTS and persistent_tiers:
        raise UnnamedWeightsError(unnamed_weights_refusal(how["weights"]))
    facts = adapter.model_facts(vllm_config, config.model_name)
    facts["weights"] = weights
    facts["kv_cache_scales"] = adapter.kv_cache_scales(vllm_config, layer_names)
    fingerprint = model_fingerprint(**facts)
    seconds = time.perf_counter() - started
    description = {**how, **{k: str(v) for k, v in facts.items() if k not in ("kv_cache_scales", "weights")},
                   "kv_cache_scales": f"{len(facts['kv_cache_scales'])} layers", "model_fingerprint":
                   fingerprint.hex(), "seconds": f"{seconds:.3f}"}
    logger.info("lmcache_npu model identity %s (%s) in %.3f s", fingerprint.hex(), how["weights"], seconds)
    return EngineIdentity(fingerprint, weights, tuple(sorted(description.items())))

