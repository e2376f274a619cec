#!/usr/bin/env bash
# One device call: install carried wheels, build, run the cuda tests, run the benchmark matrix.
# Usage (on the GPU machine, repository root): bash lmcache_npu/tools/bench/gpu_session.sh [tests|bench|model|pipeline|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .wheels pybind11 setuptools wheel pytest hypothesis rich xxhash blake3 2>&1 | tail -2
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
LMCACHE_NPU_CUDA=1 LMCACHE_NPU_CUDA_ARCHS=90 python3 setup.py build_ext --inplace > "$OUT/build.txt" 2>&1 \
  || { tail -40 "$OUT/build.txt"; exit 1; }
export PYTHONPATH=$PWD
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/cuda tests/ops tests/bench 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m lmcache_npu.tools.bench.studies.cuda_matrix --json "$OUT/cuda_matrix.json" > "$OUT/bench.txt" 2>&1
  tail -60 "$OUT/bench.txt"
fi
if [[ $what == model || $what == all ]]; then  # the cost model's transfer side against the device (issue 40)
  python3 -m lmcache_npu.tools.bench.studies.transfer_model_check --json "$OUT/transfer_model.json" \
    --geometry lmcache_npu/tools/bench/geometries/{llama3-8b,deepseek-v3,deepseek-v4-flash}.json > "$OUT/model.txt" 2>&1
  tail -60 "$OUT/model.txt"
fi
if [[ $what == pipeline ]]; then  # slice-pipelined loads under a per-layer forward, per-slice stores (issue 41)
  python3 -m lmcache_npu.tools.bench.studies.layer_pipeline --json "$OUT/layer_pipeline.json" \
    --png "$OUT/layer_pipeline.png" --load-mb 64 256 \
    --geometry lmcache_npu/tools/bench/geometries/{llama3-8b,cuda/deepseek-v3}.json > "$OUT/pipeline.txt" 2>&1
  tail -60 "$OUT/pipeline.txt"
fi
