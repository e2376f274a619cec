#!/usr/bin/env bash
# Installs lmcache_npu, non-editable, into $PYTHON's environment with every native module this machine can build:
#   _emu always (the AscendC kernel source on the x86 emulator);
#   the AscendC kernels and _npu when CANN is present (ASCEND_HOME_PATH, or the toolkit's set_env.sh) for $SOC_VERSION;
#   _cuda when nvcc and a CUDA build of torch are present (LMCACHE_NPU_CUDA=1 forces it).
# torch, vLLM, vllm-ascend and Mooncake stay as the environment pins them: only our small pure-Python dependencies
# are added. The Docker images run it; CI runs it on a CPU machine into a throwaway INSTALL_TARGET, where it builds
# _emu and logs why the NPU and CUDA modules are skipped.
#
#   PYTHON                 interpreter to install for (default python3)
#   SOC_VERSION            AscendC target, e.g. ascend910b1, ascend910_9391, ascend310p1 (default: what npu-smi reports)
#   INSTALL_TARGET         install into this directory (pip --target) instead of the environment
#   MOONCAKE_REQUIREMENT   a Mooncake requirement to add, e.g. mooncake-transfer-engine==0.3.13.post1 (default none:
#                          the vllm-ascend images already carry mooncake-transfer-engine-npu)
# No other LMCACHE_NPU_* variable is set here: the connector refuses ones that are not its keys.
set -euo pipefail

PYTHON=${PYTHON:-python3}
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${INSTALL_TARGET:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

say() { echo "lmcache_npu install: $*"; }

# CANN images source the toolkit's environment in their shells; a RUN step or CI shell may not have.
if [[ -z ${ASCEND_HOME_PATH:-} && -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  set +u; source /usr/local/Ascend/ascend-toolkit/set_env.sh; set -u
fi
if [[ -n ${ASCEND_HOME_PATH:-} ]]; then say "CANN at $ASCEND_HOME_PATH, SOC_VERSION=${SOC_VERSION:-<from npu-smi>}"; fi

"$PYTHON" -m pip install -q "pybind11>=2.12" "setuptools>=77" wheel
# The wheel is built against the environment's own torch (no build isolation), so _cuda matches the torch it runs on.
"$PYTHON" -m pip wheel -v --no-deps --no-build-isolation -w "$WORK/dist" "$SRC" > "$WORK/build.log" 2>&1 || {
  tail -60 "$WORK/build.log"; say "building the wheel failed"; exit 1; }
grep -h "lmcache_npu build:" "$WORK/build.log" | sed 's/^ *//' | sort -u || true
wheel=$(ls "$WORK"/dist/lmcache_npu-*.whl)

if [[ -n $TARGET ]]; then
  "$PYTHON" -m pip install -q --no-deps --target "$TARGET" "$wheel"
  check_path=$TARGET
else
  "$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel"
  "$PYTHON" -m pip install -q "numpy>=1.24" "pyyaml>=6" "rich>=13" "xxhash>=3.4" "blake3>=0.4"
  if [[ -n ${MOONCAKE_REQUIREMENT:-} ]]; then "$PYTHON" -m pip install -q "$MOONCAKE_REQUIREMENT"; fi
  check_path=
fi

# What got built, from the installed copy (not the source tree).
cd "$WORK"
PYTHONPATH=$check_path "$PYTHON" - <<'PY'
import importlib.util

import lmcache_npu

print(f"lmcache_npu install: {lmcache_npu.__file__}")
for name in ("_emu", "_cuda", "_npu"):
    found = importlib.util.find_spec(f"lmcache_npu.{name}") is not None
    print(f"lmcache_npu install: lmcache_npu.{name}: {'built' if found else 'not built'}")
if importlib.util.find_spec("lmcache_npu._emu") is None:
    raise SystemExit("lmcache_npu install: the emulator module is missing from the wheel")
PY
