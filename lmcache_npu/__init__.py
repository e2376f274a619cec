"""lmcache_npu: KV-cache offload for vLLM-Ascend (and vLLM on CUDA) with hybrid-attention models."""

from .ops.plan import LAYOUT_VERSION

__version__ = "0.1.0"
__all__ = ["LAYOUT_VERSION", "__version__"]
