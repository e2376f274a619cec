import importlib.util
import os

import torch
from hypothesis import HealthCheck, settings

# xdist runs one process per core; torch's OpenMP workers spinning in two processes (and in the connector's
# transfer thread beside the test's own) slow some tests by 50x on a 2-core machine
torch.set_num_threads(1)

# vLLM on a host-only machine keeps the hybrid KV-cache manager on only with its CPU platform; it must be chosen
# before any test module imports vLLM (tests/integration/vllm_cpu.py does the same when run on its own). On an
# Ascend or CUDA box vLLM's own platform (vllm-ascend's plugin there) stays.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# block hashes a disk or Mooncake tier keeps (vLLM reads it); any fixed value but 0, which those tiers refuse
os.environ.setdefault("PYTHONHASHSEED", "20261127")
if importlib.util.find_spec("torch_npu") is None and not torch.cuda.is_available():
    try:
        import vllm.platforms as _platforms
        from vllm.platforms.cpu import CpuPlatform

        _platforms._current_platform = CpuPlatform()
    except ImportError:  # the suites that need vLLM skip or fail on their own
        pass

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("LMCACHE_NPU_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("LMCACHE_NPU_HYPOTHESIS_RANDOM") is None,
)
settings.load_profile("ci")
