"""What each NPU test needs, as skip marks with the reason a reader of `-rs` sees on a machine without it."""

from __future__ import annotations

import importlib.util

import pytest

NEEDS_TORCH_NPU = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                                     reason="no torch_npu: the NPU suite needs an Ascend NPU with CANN and torch_npu")
NEEDS_NPU_MODULE = pytest.mark.skipif(importlib.util.find_spec("lmcache_npu._npu") is None,
                                      reason="lmcache_npu._npu is not built (needs CANN at install time)")
NEEDS_VLLM_ASCEND = pytest.mark.skipif(importlib.util.find_spec("vllm_ascend") is None,
                                       reason="no vllm_ascend: these tests need the vllm-ascend image")
NPU_KERNELS = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]
