"""How an engine's weights are named for the chunk namespace, shared by the engine (`engine_identity`) and
`lmcache-npu doctor`: by their content when a local checkpoint holds them, else by nothing, and then tiers that keep
chunks beyond the engine refuse to start, with `unnamed_weights_refusal`'s message (docs/storage.md §1)."""

from __future__ import annotations

from typing import Optional, Union

from . import weights
from .weights import NoWeightsFound, WeightsFingerprint


def content_of(model: str, revision: Optional[str] = None,
               download_dir: Optional[str] = None) -> tuple[Union[WeightsFingerprint, str], str]:
    """(the fingerprint of the checkpoint `model` names, its directory), or (why nothing names them, "")."""
    model_dir = weights.find_model_dir(model, revision, download_dir)
    if model_dir is None:
        return f"{model!r} is neither a local directory nor a cached hub snapshot", ""
    try:
        return weights.fingerprint_weights(model_dir), model_dir  # looked up per call: tests scale its read budget
    except NoWeightsFound as exc:
        return str(exc), ""


def unnamed_weights_refusal(reason: str) -> str:
    """What the engine says when it refuses to start with unnamed weights (`reason`: why they are unnamed)."""
    return (f"lmcache_npu: the disk and Mooncake tiers and the node cache keep chunks beyond this engine (and share "
            f"them), so they need the weights named by their content, and here they cannot be ({reason}). "
            "Set model_fingerprint in kv_connector_extra_config to a string that names these exact weights (e.g. the "
            "checkpoint's sha256 or an immutable release tag, changed whenever the weights change), or run with the "
            "engine's own host arena alone (no disk_path, mooncake or node_cache)")
