"""What each CUDA test needs, as skip marks with the reason a reader of `-rs` sees on a machine without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

CUDA_KERNELS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
    pytest.mark.skipif(importlib.util.find_spec("lmcache_npu._cuda") is None,
                       reason="lmcache_npu._cuda is not built (needs nvcc and a CUDA build of torch)"),
]
