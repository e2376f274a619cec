"""The plugin's one configuration schema (DESIGN §9): connector keys plus the store's keys, from three sources.

Sources, each later one overriding keys of the earlier ones:
1. ``kv_connector_extra_config`` (the JSON of ``--kv-transfer-config``);
2. a YAML file, named by the ``config_file`` key or the ``LMCACHE_NPU_CONFIG`` environment variable;
3. ``LMCACHE_NPU_<KEY>`` environment variables (``LMCACHE_NPU_CPU_BYTES=64GiB``; objects and lists as JSON).

An unknown key in any source is an error that lists the valid keys; every value is checked here, with its key
named, before the connector allocates or registers anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .checks import check_int
from .ops.backend import BACKEND_NAMES, backend_class
from .store.config import StoreConfig, check_value_shape, key_list

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_NPU_"
CONFIG_FILE_ENV = "LMCACHE_NPU_CONFIG"
# LMCACHE_NPU_* variables that are not configuration keys: the config file, build switches, test knobs, the replay's
# model cache.
NON_KEY_ENV = frozenset({"CONFIG", "CUDA", "CUDA_ARCHS", "HYPOTHESIS_EXAMPLES", "HYPOTHESIS_RANDOM", "MODEL_CACHE",
                         "SECRET"})  # SECRET: the store secret (store/secret.py), never a config value
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# store keys that size or name the node cache's tiers: with `node_cache` they are the service's (its --config file);
# an engine keeps only how its own worker makes the shared pages DMA-able (pinned, npu_host_memory)
NODE_CACHE_KEYS = tuple(key for key in StoreConfig.keys() if key not in ("pinned", "npu_host_memory", "transfer_cpus"))


def check_backend_options(backend: str, options: Mapping[str, Any]) -> None:
    """Option names the backend's constructor takes; an unknown one is refused with the valid ones."""
    if backend == "auto":
        if options:
            raise ValueError("backend_options need a named backend (torch, emu, host, cuda or npu): with backend 'auto' the "
                             "options would apply to whichever backend the device picks")
        return
    valid = backend_class(backend).option_names()
    unknown = set(options) - set(valid)
    if unknown:
        raise ValueError(f"backend_options: {key_list(unknown)} not accepted by the {backend} backend; "
                         f"valid options: {', '.join(valid) or 'none'}")


TP_SHARE_MODES = ("auto", "off")
# cost-model: claim the prefix of a hit whose load beats computing it (docs/performance.md "The cost model");
# load-all: claim every hit, however slow its tier (the plugin before issue 40; a baseline for studies)
LOAD_POLICIES = ("cost-model", "load-all")
# how a claimed hit loads (issue 41): auto picks per request from the cost model; async waits for the load before the
# request is scheduled (finished_recving); sliced schedules it at once and its forward waits per slice
LOAD_MODES = ("auto", "async", "sliced")
TP_SHARE_EXCHANGES = ("auto", "device", "host")


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything ``LMCacheNPUConnector`` reads. Store keys (``cpu_bytes``, ``disk_path``, ``mooncake``, ...) sit at
    the same level in every source and land in ``store``."""

    chunk_tokens: Optional[int] = None  # tokens per chunk (keying, storing, loading); None: the smallest multiple
    # of vLLM's hash block and every stored group's granularity that holds 128 tokens (`DEFAULT_CHUNK_TOKENS`: one
    # block on CPU/Ascend, reusing as much as vLLM's block-keyed connectors; docs/performance.md "The peer")
    backend: str = "auto"  # transfer backend; auto: npu on Ascend, cuda on NVIDIA, host for CPU tensors
    backend_options: Mapping[str, Any] = field(default_factory=dict)  # constructor options of a named backend
    store_decode_chunks: bool = True  # also store chunks completed during decode (multi-turn chat reuses them)
    skip_spec_kinds: tuple[str, ...] = ()  # KV-cache spec kinds never offloaded (see `lmcache-npu inspect`)
    model_name: Optional[str] = None  # a label mixed into the namespace (it never replaces the weights' content)
    # names the weights instead of reading their content: for loaders whose weights are not local files (a remote
    # URI, a custom loader); it must change whenever the weights do
    model_fingerprint: Optional[str] = None
    allow_fast_block_hash: bool = False  # persistent/shared tiers with vLLM's xxhash block hashing: warn, not refuse
    load_retries: int = 1  # a failed device load is retried this often before it is reported
    # auto: planes identical on every TP rank (MLA, indexers, one KV head) are stored once across the group, each
    # rank keeping a 1/tp share; off: every rank stores its whole chunk (docs/storage.md "Replicated KV")
    tp_share: str = "auto"
    # where a load's shares meet: device (NCCL/HCCL, each rank moves only its share to the device), host (gloo, each
    # rank moves whole objects); auto: device where the KV cache is on NPU/CUDA (measured faster on H100 x2 NVLink)
    tp_share_exchange: str = "auto"
    # a node cache service's socket (`lmcache-npu node-cache`): every engine on the node then shares its host cache,
    # disk tier and Mooncake client, and the store keys that size or name those are the service's (docs/deployment.md)
    node_cache: Optional[str] = None
    # how long an engine's start waits for its first attach to the node cache before it serves without it (and
    # attaches in the background); a pool being made takes longer, a live one milliseconds
    node_cache_start_wait_ms: int = 5000
    load_policy: str = "cost-model"  # which hits a request claims (LOAD_POLICIES)
    load_mode: str = "auto"  # how a claimed hit loads (LOAD_MODES)
    load_slices: int = 4  # slices of a sliced load (the first is the smallest: the forward waits for it first)
    # how long a decode engine waits for the chunks a P/D hand-off names that its prefill engine on the node is still
    # storing (docs/deployment.md "P/D through the node cache"); past it the decode engine computes them
    handoff_wait_ms: int = 30000
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        if self.chunk_tokens is not None:  # null: automatic
            check_int("chunk_tokens", self.chunk_tokens, lo=1)
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {self.backend!r}")
        if not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be an object, got {self.backend_options!r}")
        check_backend_options(self.backend, self.backend_options)
        if not isinstance(self.store_decode_chunks, bool):
            raise ValueError(f"store_decode_chunks must be true or false, got {self.store_decode_chunks!r}")
        if not isinstance(self.skip_spec_kinds, tuple) or not all(isinstance(k, str) for k in self.skip_spec_kinds):
            raise ValueError(f"skip_spec_kinds must be a list of spec kind names, got {self.skip_spec_kinds!r}")
        from .layout.discovery import LayoutPolicy

        LayoutPolicy(skip_spec_kinds=self.skip_spec_kinds)  # names an unknown kind
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise ValueError(f"model_name must be a non-empty string or null, got {self.model_name!r}")
        if self.model_fingerprint is not None and (not isinstance(self.model_fingerprint, str)
                                                   or len(self.model_fingerprint.strip()) < 8):
            raise ValueError("model_fingerprint must be a string of at least 8 characters that names the weights "
                             f"(e.g. a checkpoint's sha256 or a release tag), or null, got {self.model_fingerprint!r}")
        if not isinstance(self.allow_fast_block_hash, bool):
            raise ValueError(f"allow_fast_block_hash must be true or false, got {self.allow_fast_block_hash!r}")
        check_int("load_retries", self.load_retries, 0, 10)
        if self.tp_share not in TP_SHARE_MODES:
            raise ValueError(f"tp_share must be one of {', '.join(TP_SHARE_MODES)}, got {self.tp_share!r}")
        if self.node_cache is not None:
            self._check_node_cache()
        check_int("node_cache_start_wait_ms", self.node_cache_start_wait_ms, 0, 3_600_000)
        check_int("handoff_wait_ms", self.handoff_wait_ms, 0, 3_600_000)
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {', '.join(LOAD_MODES)}, got {self.load_mode!r}")
        check_int("load_slices", self.load_slices, 1, 8)
        if self.tp_share_exchange not in TP_SHARE_EXCHANGES:
            raise ValueError(f"tp_share_exchange must be one of {', '.join(TP_SHARE_EXCHANGES)}, got "
                             f"{self.tp_share_exchange!r}")

    def _check_node_cache(self) -> None:
        if not isinstance(self.node_cache, str) or not self.node_cache.startswith("/") or "\0" in self.node_cache:
            raise ValueError(f"node_cache must be the absolute path of the node cache service's socket, got "
                             f"{self.node_cache!r}")
        defaults = StoreConfig()
        theirs = [key for key in NODE_CACHE_KEYS if getattr(self.store, key) != getattr(defaults, key)]
        if theirs:
            raise ValueError(f"node_cache is set, so {key_list(theirs)} belong to the node cache service: give them to "
                             "`lmcache-npu node-cache` (its flags or its --config file) and remove them here (an "
                             "engine of a node cache has no arena, disk directory or Mooncake client of its own)")

    @property
    def outlives_engine(self) -> bool:
        """Whether a tier keeps chunks beyond this engine and shares them (disk, Mooncake, the node cache): their names
        must be stable across processes (`store.keys.check_stable_hashing`) and the weights named."""
        return self.store.disk_path is not None or self.store.mooncake is not None or self.node_cache is not None

    @classmethod
    def connector_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "store")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key a source may set, in the order `docs/configuration.md` lists them."""
        return cls.connector_keys() + StoreConfig.keys() + ("config_file",)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ConnectorConfig":
        """From one merged mapping (no config_file key); an unknown key is refused with the valid ones."""
        if not isinstance(values, Mapping):
            raise ValueError(f"the lmcache_npu config must be an object of config keys, got {type(values).__name__}")
        valid = cls.connector_keys() + StoreConfig.keys()
        unknown = set(values) - set(valid)
        if unknown:
            raise ValueError(f"unknown lmcache_npu config key(s) {key_list(unknown)}; valid keys: "
                             f"{', '.join(valid)}")
        connector = {k: v for k, v in values.items() if k in cls.connector_keys()}
        for key, value in connector.items():
            check_value_shape(key, value)  # store keys are checked by StoreConfig.from_dict
        if "skip_spec_kinds" in connector:
            kinds = connector["skip_spec_kinds"]
            if isinstance(kinds, str) or not isinstance(kinds, (list, tuple)):
                raise ValueError(f"skip_spec_kinds must be a list of spec kind names, got {kinds!r}")
            connector["skip_spec_kinds"] = tuple(kinds)
        if connector.get("backend_options") is None:
            connector.pop("backend_options", None)
        store = StoreConfig.from_dict({k: v for k, v in values.items() if k in StoreConfig.keys()})
        return cls(store=store, **connector)


def _field_types() -> dict[str, Any]:
    """The default value of every key, which tells how an environment string is parsed."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                for f in dataclasses.fields(ConnectorConfig) if f.name != "store"}
    defaults.update({f.name: f.default for f in dataclasses.fields(StoreConfig)})
    return defaults


# optional strings: "" and "null" both mean unset
_STRING_OR_NULL = {"model_name", "model_fingerprint", "disk_path", "node_cache"}
_INT_OR_NULL = {"numa_node", "chunk_tokens"}
_BOOL_OR_NULL = {"pinned"}
_SIZES = set(StoreConfig._SIZES)


def _parse_env_value(key: str, name: str, text: str) -> Any:
    """An environment string as the type its key takes; errors name the variable."""
    default = _field_types()[key]
    stripped = text.strip()
    if stripped.lower() in ("null", "none") and (key in _STRING_OR_NULL | _INT_OR_NULL | _BOOL_OR_NULL
                                                 or key in ("mooncake", "transfer_cpus")):
        return None
    if key in _SIZES:
        return stripped
    if key in _STRING_OR_NULL:
        return stripped or None
    if isinstance(default, bool) or key in _BOOL_OR_NULL:
        if stripped.lower() in _TRUE:
            return True
        if stripped.lower() in _FALSE:
            return False
        raise ValueError(f"{name}: expected true or false, got {text!r}")
    if isinstance(default, int) or key in _INT_OR_NULL:
        try:
            return int(stripped)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {text!r}") from None
    if key in ("mooncake", "backend_options", "skip_spec_kinds", "transfer_cpus"):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: expected JSON ({exc.msg}), got {text[:200]!r}") from None
        except (ValueError, RecursionError) as exc:  # an int past Python's digit limit; nesting past the stack
            raise ValueError(f"{name}: expected JSON of a config object or list, got text that cannot be one "
                             f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return stripped


def _env_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    valid = ConnectorConfig.connector_keys() + StoreConfig.keys()
    out: dict[str, tuple[Any, str]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name[len(ENV_PREFIX):] in NON_KEY_ENV:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in valid:
            raise ValueError(f"environment variable {name} is not a lmcache_npu config key; valid variables: "
                             f"{', '.join(ENV_PREFIX + k.upper() for k in valid)} (and {CONFIG_FILE_ENV})")
        out[key] = (_parse_env_value(key, name, text), f"env {name}")
    return out


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML (or JSON) file of config keys, as a mapping; the keys are checked when merged."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a dependency
        raise ValueError(f"config_file {path!r}: reading YAML needs pyyaml ({exc})") from exc
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"config_file {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config_file {path!r}: not valid YAML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config_file {path!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # pyyaml's constructors: an int past
        # Python's digit limit, nesting past the stack, a NUL in the path
        raise ValueError(f"config_file {path!r}: not a readable YAML config ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config_file {path!r}: the top level must be a mapping of config keys, got "
                         f"{type(data).__name__}")
    if "config_file" in data:
        raise ValueError(f"config_file {path!r}: a config file cannot name another config_file")
    return dict(data)


def load_config(extra_config: Optional[Mapping[str, Any]] = None,
                environ: Optional[Mapping[str, str]] = None) -> ConnectorConfig:
    """The merged, checked configuration (extra_config < YAML file < environment); logs where each set key came
    from."""
    env = os.environ if environ is None else environ
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ValueError(f"kv_connector_extra_config must be an object of lmcache_npu config keys, got "
                         f"{type(extra_config).__name__}")
    merged: dict[str, tuple[Any, str]] = {k: (v, "kv_connector_extra_config") for k, v in (extra_config or {}).items()}
    file_entry = merged.pop("config_file", None)
    path = env.get(CONFIG_FILE_ENV) or (file_entry[0] if file_entry else None)
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"config_file must be a path to a YAML file, got {path!r}")
        merged.update({k: (v, f"file {path}") for k, v in read_config_file(path).items()})
    merged.update(_env_values(env))
    config = ConnectorConfig.from_dict({k: v for k, (v, _) in merged.items()})
    for key in sorted(merged):
        logger.info("lmcache_npu config: %s = %r (%s)", key, merged[key][0], merged[key][1])
    return config
