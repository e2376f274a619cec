"""Importing the connector module is light: vLLM imports it in the API server and the scheduler process too."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import lmcache_npu.integration.vllm as connector
import torch
heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch_npu'
               or m in ('lmcache_npu._emu', 'lmcache_npu._cuda', 'lmcache_npu._npu', 'vllm_ascend'))
print(json.dumps({"class": connector.LMCacheNPUConnector.__name__, "heavy": heavy,
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


def test_import_loads_no_npu_module_native_kernel_or_cuda() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"class": "LMCacheNPUConnector", "heavy": [], "cuda_initialized": False}


def test_the_connector_is_an_hma_connector_vllm_can_load() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

    config = KVTransferConfig(kv_connector="LMCacheNPUConnector", kv_role="kv_both",
                              kv_connector_module_path="lmcache_npu.integration.vllm")
    cls = KVConnectorFactory.get_connector_class(config)
    assert issubclass(cls, KVConnectorBase_V1) and supports_hma(cls)
