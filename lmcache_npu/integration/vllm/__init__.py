"""The vLLM connector: `--kv-transfer-config '{"kv_connector": "LMCacheNPUConnector",
"kv_connector_module_path": "lmcache_npu.integration.vllm", "kv_role": "kv_both", ...}'`."""

from .connector import LMCacheNPUConnector

__all__ = ["LMCacheNPUConnector"]
