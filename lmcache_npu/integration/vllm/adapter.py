"""Everything that depends on the installed vLLM's version, in one place (DESIGN §8).

The connector targets the vLLM 0.23 API (what vllm-ascend 0.23 pins), which holds until 0.28. vLLM 0.29 breaks the
KV-cache interface (`tokens_per_state`, `KVCacheTensor(layers, ...)`, `[B,H,N,C]` views; layout discovery reads
both spec eras) and 0.30 adds `get_transfer_results` with request-level load failures. A new era is an addition
here: every other module asks this one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported for the connector)
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401
    KVConnectorPromMetrics,
    KVConnectorStats,
)

logger = logging.getLogger(__name__)


def _version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) from versions like 0.23.0, 0.32.0+cpu or 0.24.0.dev12+g1234."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"cannot read the vLLM version {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


VLLM_VERSION = _version(vllm.__version__)
MIN_VERSION = (0, 23, 0)
# 0.30+: the runner asks get_transfer_results, which may name requests whose load failed (failed_recving).
HAS_TRANSFER_RESULTS = hasattr(KVConnectorBase_V1, "get_transfer_results")
# vLLM 0.28 and 0.32 ask the scheduler's connector for stats every step (their scheduler.py); 0.23 only when a
# worker reported some, so there a worker's None on a quiet step would hold back the scheduler's counts (0.24-0.27
# unchecked: they keep reporting every step)
WORKER_STATS_MAY_BE_NONE = VLLM_VERSION >= (0, 28, 0)

if VLLM_VERSION < MIN_VERSION:
    raise ImportError(f"lmcache_npu needs vLLM >= {'.'.join(map(str, MIN_VERSION))} (the KV-connector API with "
                      f"SupportsHMA and per-group block ids); found {vllm.__version__}")


# ---- engine geometry --------------------------------------------------------------------------------------------

def block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size) as the engine resolves them; `Request.block_hashes` are computed
    per hash block. Looked up through the module so a platform's patch of the resolver (vllm-ascend) applies."""
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


@dataclass(frozen=True)
class ParallelPlace:
    """This process's rank among the workers of one engine (they share one scheduler), and how many there are."""

    rank: int
    world: int


def parallel_place(vllm_config: Any) -> ParallelPlace:
    """Tensor-parallel rank and size; the parallel modes whose ranks hold different token or layer subsets are refused
    with the setting named."""
    pc = vllm_config.parallel_config
    for name, value in (("pipeline_parallel_size", pc.pipeline_parallel_size),
                        ("decode_context_parallel_size", getattr(pc, "decode_context_parallel_size", 1)),
                        ("prefill_context_parallel_size", getattr(pc, "prefill_context_parallel_size", 1))):
        if value != 1:
            raise ValueError(f"{name}={value}: lmcache_npu stores whole chunks per tensor-parallel rank; pipeline and "
                             "context parallelism give ranks different layers or tokens and are not supported yet")
    world = int(pc.tensor_parallel_size)
    rank = int(getattr(pc, "rank", 0)) % world
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            rank = parallel_state.get_tensor_model_parallel_rank()
    except (ImportError, AssertionError, AttributeError):  # a scheduler process has no parallel state
        pass
    return ParallelPlace(rank, world)


def data_parallel_rank(vllm_config: Any) -> Optional[int]:
    """The data-parallel rank when several engines run side by side (each owns a scheduler and its own files)."""
    pc = vllm_config.parallel_config
    return int(pc.data_parallel_rank) if int(getattr(pc, "data_parallel_size", 1)) > 1 else None


def engine_name(vllm_config: Any) -> str:
    """This engine among others on the node: its KV transfer engine id (one per `vllm serve`, the same in its
    scheduler and worker processes) and its data-parallel rank (each DP rank is an engine of its own)."""
    transfer = vllm_config.kv_transfer_config
    engine_id = getattr(transfer, "engine_id", None) if transfer is not None else None
    if not engine_id:
        raise ValueError("node_cache: the engine has no kv_transfer_config.engine_id to be told apart by")
    return f"{engine_id}/dp{data_parallel_rank(vllm_config) or 0}"


def hash_algorithm(vllm_config: Any) -> str:
    return str(vllm_config.cache_config.prefix_caching_hash_algo)


# hf_config keys that name where the config came from, not what the model computes
_CONFIG_PROVENANCE_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                                     "_attn_implementation", "_attn_implementation_autoset",
                                     "_attn_implementation_internal"})
# load formats whose weights are read from the model's files, so the files' content names them
FILE_LOAD_FORMATS = frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors", "gguf", "mistral",
                               "bitsandbytes", "sharded_state"})


def _without_provenance(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if k not in _CONFIG_PROVENANCE_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_provenance(v) for v in value]
    return value


def effective_model_config(vllm_config: Any) -> str:
    """The model's config as vLLM runs it (config.json with `hf_overrides` and quantization config applied), as
    canonical JSON without the keys that only say where it was read from."""
    hf_config = vllm_config.model_config.hf_config
    as_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    return json.dumps(_without_provenance(as_dict), sort_keys=True, default=str)


def model_facts(vllm_config: Any, model_name: Optional[str]) -> dict[str, Any]:
    """What makes one model's KV bytes differ from another's besides its weights (DESIGN §7), from this process's
    engine config. Workers call it after the model is built, so a worker-side rewrite (vllm-ascend on A5 sets
    `cache_dtype` to fp8 in the worker only) is what enters the namespace; names and paths never do, except the
    operator's optional `model_name` label."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return {
        "label": model_name,
        "config": hashlib.sha256(effective_model_config(vllm_config).encode()).hexdigest(),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "quantization": getattr(mc, "quantization", None),
        "tensor_parallel_size": int(pc.tensor_parallel_size),
        "hash_algorithm": hash_algorithm(vllm_config),
    }


@dataclass(frozen=True)
class WeightsSource:
    """Where this engine's weights come from: a model directory or hub id, a revision, and how they are loaded."""

    model: str
    revision: Optional[str]
    download_dir: Optional[str]
    load_format: str

    @property
    def from_files(self) -> bool:
        """Weights read from the checkpoint's files (not random `dummy` weights, a remote streamer or a custom
        loader), so the files' content names them."""
        return self.load_format in FILE_LOAD_FORMATS


def weights_source(vllm_config: Any) -> WeightsSource:
    mc, lc = vllm_config.model_config, vllm_config.load_config
    load_format = getattr(lc, "load_format", "auto")
    load_format = str(getattr(load_format, "value", load_format)).lower()
    return WeightsSource(str(mc.model), getattr(mc, "revision", None), getattr(lc, "download_dir", None), load_format)


def attention_layers(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, Any]:
    """The attention layers the worker built, by name; empty where no model is registered in the config (the
    scheduler process, tests without a model)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    try:
        return dict(get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names)))
    except (AttributeError, KeyError, AssertionError):  # no static forward context: nothing registered
        return {}


def kv_cache_scales(vllm_config: Any, layer_names: Iterable[str]) -> tuple[tuple[str, float, float], ...]:
    """Each attention layer's KV-cache quantisation scales as the worker holds them (k, v), in layer order; empty
    where no model is registered. fp8 KV bytes are the values divided by these."""
    layers = attention_layers(vllm_config, layer_names)
    scales = []
    for name in sorted(layers):
        k, v = getattr(layers[name], "_k_scale_float", None), getattr(layers[name], "_v_scale_float", None)
        if k is not None and v is not None:
            scales.append((name, float(k), float(v)))
    return tuple(scales)


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, str]:
    """Each attention layer's backend name (`AttentionBackend.get_name()`), from the model the worker built."""
    backends = {}
    for name, layer in attention_layers(vllm_config, layer_names).items():
        try:
            backends[name] = str(layer.get_attn_backend().get_name())
        except (AttributeError, NotImplementedError):  # a layer kind without a backend (e.g. mamba mixers)
            continue
    return backends


def eagle_block_drop(vllm_config: Any) -> bool:
    """Whether vLLM drops the last matched block of its own prefix hits because a drafter reads the target's hidden
    states (EAGLE, EAGLE-3, MTP, DFlash: `SpeculativeConfig.use_eagle()`; 0.32+ can turn the drop off with
    `disable_eagle_block_drop`). ngram and draft-model drafting keep no state tied to the next token: no drop."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    if hasattr(spec, "use_eagle_block_drop"):
        return bool(spec.use_eagle_block_drop())
    return bool(spec.use_eagle())


def load_failure_policy(vllm_config: Any) -> str:
    """vLLM's `kv_load_failure_policy`: "recompute" or "fail" (the default)."""
    return str(getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail"))


def token_budget(vllm_config: Any) -> int:
    """The most tokens one step schedules (`max_num_batched_tokens`): a longer prefill takes several steps."""
    return int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 8192)


def kv_role(vllm_config: Any) -> tuple[bool, bool]:
    """(stores, loads): kv_producer only stores, kv_consumer only loads, kv_both does both."""
    config = vllm_config.kv_transfer_config
    return bool(config.is_kv_producer), bool(config.is_kv_consumer)


class FailureChannel(str, Enum):
    """How a failed load reaches the scheduler so vLLM recomputes it (the value is the name the logs and tests use)."""

    # vLLM >= 0.30 takes request ids (`get_transfer_results`), any number of groups
    FAILED_RECVING = "failed_recving"
    # block ids (`get_block_ids_with_load_errors`), which vLLM 0.23-0.29 maps through one group's block table only
    INVALID_BLOCKS = "invalid_blocks"
    # vLLM 0.23-0.29 with several KV-cache groups has no way to be told (its invalid-block handler unpacks a single
    # group and crashes), so a load that keeps failing stops the engine instead of serving wrong KV
    NONE = "none"


def failure_channel(num_groups: int) -> FailureChannel:
    """The channel this vLLM offers an engine with `num_groups` KV-cache groups."""
    if HAS_TRANSFER_RESULTS:
        return FailureChannel.FAILED_RECVING
    return FailureChannel.INVALID_BLOCKS if num_groups == 1 else FailureChannel.NONE


def warn_about_failed_loads(channel: FailureChannel, policy: str) -> None:
    """Once per engine: what a chunk that cannot be loaded (a lost disk file, a remote fault) does to a request."""
    if channel is FailureChannel.NONE:
        logger.warning("lmcache_npu: this vLLM cannot be told a load of a model with several KV-cache groups failed "
                       "(vLLM >= 0.30 can): a failed load stops the engine rather than serve KV that may be wrong")
    elif policy != "recompute":
        logger.warning("lmcache_npu: kv_load_failure_policy is %r: a chunk that cannot be loaded fails its request; "
                       "'recompute' computes those tokens instead", policy)


# ---- scheduler objects ------------------------------------------------------------------------------------------

class ScheduledRequest(NamedTuple):
    """One request in a scheduler output: its block ids (all of them for new and resumed requests, the newly
    allocated ones otherwise) and the tokens computed before this step (a tuple: built per request per step, and a
    frozen dataclass costs ~1 µs more each)."""

    request_id: str
    block_ids: Optional[tuple[list[int], ...]]
    replace: bool  # block_ids are the whole table (new or resumed request), not an append
    num_computed_tokens: int


def scheduled_requests(scheduler_output: Any) -> Iterator[ScheduledRequest]:
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(new.req_id, tuple(new.block_ids), True, int(new.num_computed_tokens))
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", set())
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        yield ScheduledRequest(req_id, None if new_ids is None else tuple(new_ids), req_id in resumed,
                               int(cached.num_computed_tokens[i]))




def block_ids_of(blocks: Any) -> tuple[list[int], ...]:
    """Per-group block ids of a `KVCacheBlocks` (null blocks included, as id 0)."""
    return tuple(list(ids) for ids in blocks.get_block_ids())


def running(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.RUNNING


def waiting_for_remote_kv(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def skips_prefix_cache(request: Any) -> bool:
    """The request asked not to read any prefix cache (vLLM's `skip_reading_prefix_cache`)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def worker_metadata(connector_output: Any) -> Any:
    return getattr(connector_output, "kv_connector_worker_meta", None)


def composed(connector: Any) -> bool:
    """Whether `connector` is one child of the engine's KV connector (vLLM's MultiConnector, vllm-ascend's
    AscendMultiConnector). Read on a worker, where vLLM keeps the engine's connector; False where it keeps none."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return has_kv_transfer_group() and get_kv_transfer_group() is not connector


def remote_prefill(request: Any) -> bool:
    """The request's prompt KV is to come from a prefill engine (a P/D connector's `do_remote_prefill`)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


# our key in a request's kv_transfer_params (a P/D hand-off through the node cache); no P/D connector uses it
HANDOFF_PARAMS_KEY = "lmcache_npu_node_pd"


def handoff_params(request: Any) -> Any:
    """What the request's kv_transfer_params hold under our key (None: no P/D hand-off through the node cache)."""
    params = getattr(request, "kv_transfer_params", None)
    return params.get(HANDOFF_PARAMS_KEY) if isinstance(params, dict) else None


def prompt_tokens(request: Any) -> tuple[int, Sequence[int]]:
    """(number of prompt tokens, the token ids) of a request (`prompt_token_ids` is None for embeds-only prompts)."""
    ids = getattr(request, "prompt_token_ids", None)
    return int(request.num_prompt_tokens), (ids if ids is not None else ())


def has_multimodal_inputs(request: Any) -> bool:
    """The request carries multimodal inputs (0.23's `mm_positions`, later `mm_features`): their content is in
    vLLM's block hashes only, never in the token ids."""
    return bool(getattr(request, "mm_features", None) or getattr(request, "mm_positions", None))


def transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> Any:
    """vLLM >= 0.30's `KVConnectorTransferResults`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_sending=finished_sending, finished_recving=finished_recving,
                                      failed_recving=failed_recving)


def first_live_window_token(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """The first token whose block a sliding-window group still holds once vLLM has pruned the request at
    `num_computed_tokens` (0.23: `get_num_skipped_tokens` = n - window + 1, freed in whole blocks). vllm-ascend's
    async patch prunes less, never more, so a row at or past this token is still in a live block."""
    skipped = max(0, num_computed_tokens - sliding_window + 1)
    return skipped // block_size * block_size


@dataclass(frozen=True)
class LoraRef:
    """The LoRA adapter a request runs with, as vLLM's LoRARequest names it (every era has these fields)."""

    name: str
    int_id: int  # vLLM's id: one loaded adapter per id
    path: str  # "" when vLLM did not say where the adapter's files are
    load_inplace: bool  # vLLM reloads the files for this request


def lora_adapter(request: Any) -> Optional[LoraRef]:
    """The LoRA adapter a request runs with, None without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None) or ""
    return LoraRef(str(getattr(lora, "lora_name", "")), int(getattr(lora, "lora_int_id", 0) or 0), str(path),
                   bool(getattr(lora, "load_inplace", False)))


def blocks_to_zero(scheduler_output: Any) -> Sequence[int]:
    """Blocks vLLM zeroes before this step's forward (vLLM >= 0.32 names them; earlier eras zero nothing)."""
    return getattr(scheduler_output, "new_block_ids_to_zero", None) or ()
