"""The CUDA backend: the work-order planner (work_order.py), its knobs (tuning.py), the bridge to lmcache_npu._cuda
(native.py) and CudaBackend (backend.py)."""
