#!/usr/bin/env bash
# Installs lmcache_npu, non-editable, into $PYTHON's environment with every native module this machine can build:
#   _emu always (the AscendC kernel source on the x86 emulator);
#   the AscendC kernels and _npu when CANN is present (the toolkit's set_env.sh, or ASCEND_HOME_PATH) for $SOC_VERSION;
#   _cuda when nvcc and a CUDA build of torch are present (LMCACHE_NPU_CUDA=1 forces it).
# torch, vLLM, vllm-ascend and Mooncake stay as the environment pins them: only our small pure-Python dependencies
# are added. The Docker images run it; CI runs it on a CPU machine into a throwaway INSTALL_TARGET, where it builds
# _emu and logs why the NPU and CUDA modules are skipped.
#
#   PYTHON                 interpreter to install for (default python3)
#   SOC_VERSION            AscendC target, e.g. ascend910b1, ascend910_9391, ascend310p1 (default: what npu-smi reports;
#                          with neither, REQUIRE_MODULES=_npu fails at once)
#   INSTALL_TARGET         install into this directory (pip --target) instead of the environment
#   MOONCAKE_REQUIREMENT   a Mooncake requirement to add, e.g. mooncake-transfer-engine==0.3.13.post1 (default none:
#                          the vllm-ascend images already carry mooncake-transfer-engine-npu)
#   REQUIRE_MODULES        native modules that must have been built, e.g. "_npu" (the Ascend image); default none
# It also checks that the `lmcache-npu` command (doctor, status, node-cache) was installed and says where.
# No other LMCACHE_NPU_* variable is set here: the connector refuses ones that are not its keys.
set -euo pipefail

PYTHON=${PYTHON:-python3}
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${INSTALL_TARGET:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

say() { echo "lmcache_npu install: $*"; }

# CANN's environment, always: the vllm-ascend image sets ASCEND_HOME_PATH in its ENV but not the rest of set_env.sh
# (the toolkit's library and Python paths), so whether ASCEND_HOME_PATH is set says nothing about it. CANN 8.5+
# installs set_env.sh under cann/, older toolkits under ascend-toolkit/.
for env_script in /usr/local/Ascend/cann/set_env.sh /usr/local/Ascend/ascend-toolkit/set_env.sh; do
  if [[ -f $env_script ]]; then
    # shellcheck disable=SC1090
    set +u; source "$env_script"; set -u
    say "sourced $env_script"
    break
  fi
done
if [[ -n ${ASCEND_HOME_PATH:-} ]]; then say "CANN at $ASCEND_HOME_PATH, SOC_VERSION=${SOC_VERSION:-<from npu-smi>}"; fi
# The SoC comes from SOC_VERSION (in Dockerfile.ascend the build argument, else the base image's own ENV), else from
# npu-smi, which a driverless `docker build` cannot ask: fail now, not after a build that skips _npu.
if [[ -n ${ASCEND_HOME_PATH:-} && -z ${SOC_VERSION:-} && " ${REQUIRE_MODULES:-} " == *" _npu "* ]] \
  && ! npu-smi info > /dev/null 2>&1; then
  say "lmcache_npu._npu is required but no SoC is known: SOC_VERSION is unset (no --build-arg SOC_VERSION, no ENV"
  say "SOC_VERSION in the base image) and npu-smi cannot report one; set SOC_VERSION, e.g. ascend910b1"
  exit 1
fi

# For the build step only: the link of _npu (through libtorch_npu and CANN's runtime) needs libascend_hal.so, which
# the driver provides on a card and the toolkit's devlib/ stubs for a driverless `docker build`; and `import torch`
# (CMake asks torch for its C++ ABI) must not autoload torch_npu, which needs that driver.
build_ld_path=${LD_LIBRARY_PATH:-}
devlib=${ASCEND_HOME_PATH:-/nonexistent}/$(uname -m)-linux/devlib
if [[ -d $devlib ]]; then build_ld_path=$devlib${build_ld_path:+:$build_ld_path}; fi
build_env=(env TORCH_DEVICE_BACKEND_AUTOLOAD=0)
if [[ -n $build_ld_path ]]; then build_env+=("LD_LIBRARY_PATH=$build_ld_path"); fi

"$PYTHON" -m pip install -q "pybind11>=2.12" "setuptools>=77" wheel
# The wheel is built against the environment's own torch (no build isolation), so _cuda matches the torch it runs on.
"${build_env[@]}" "$PYTHON" -m pip wheel -v --no-deps --no-build-isolation -w "$WORK/dist" "$SRC" \
  > "$WORK/build.log" 2>&1 || {
  tail -60 "$WORK/build.log"; say "building the wheel failed"; exit 1; }
grep -h "lmcache_npu build:" "$WORK/build.log" | sed 's/^ *//' | sort -u || true
wheel=$(ls "$WORK"/dist/lmcache_npu-*.whl)

if [[ -n $TARGET ]]; then
  "$PYTHON" -m pip install -q --no-deps --target "$TARGET" "$wheel"
else
  "$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel"
  "$PYTHON" -m pip install -q "numpy>=1.24" "pyyaml>=6" "rich>=13" "xxhash>=3.4" "blake3>=0.4"
  if [[ -n ${MOONCAKE_REQUIREMENT:-} ]]; then "$PYTHON" -m pip install -q "$MOONCAKE_REQUIREMENT"; fi
fi

# What got built, from the installed copy (not the source tree), without importing any of it: importing lmcache_npu
# imports torch, which autoloads torch_npu (needs the driver), and loading _npu runs the AscendC launch stub's
# constructor, which asks the device for its SoC. The loader's view (readelf, ldd -r) is what the build must get right.
if [[ -n $TARGET ]]; then
  site=$TARGET
else
  site=$("$PYTHON" -m pip show lmcache-npu | sed -n 's/^Location: //p')
fi
pkg=$site/lmcache_npu
say "installed at $pkg"
module_file() { compgen -G "$pkg/$1.*.so" | head -n 1 || true; }
for name in _emu _cuda _npu; do
  say "lmcache_npu.$name: $([[ -n $(module_file "$name") ]] && echo built || echo "not built")"
done
[[ -n $(module_file _emu) ]] || { say "the emulator module is missing from the wheel"; exit 1; }
for name in ${REQUIRE_MODULES:-}; do
  [[ -n $(module_file "$name") ]] || { say "lmcache_npu.$name was required (REQUIRE_MODULES) but not built"; exit 1; }
done

# _npu as the dynamic loader will see it: RUNPATH $ORIGIN on it (else it cannot find the kernel library beside it),
# each library it NEEDs found where the loader looks first, and no symbol of ours undefined. The kernel library needs
# no RUNPATH (its NEEDED are CANN's, on LD_LIBRARY_PATH). What CANN's and torch_npu's own libraries lack in a
# driverless build is theirs and is not judged here.
verify_npu_module() {
  local npu=$1 kernels=$pkg/liblmcache_npu_kernels.so search_path report name first undefined
  [[ -f $kernels ]] || { say "$kernels is missing beside $npu"; return 1; }
  search_path=$(readelf -d "$npu" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
  # shellcheck disable=SC2016
  [[ ":$search_path:" == *':$ORIGIN:'* ]] || { say "$npu has no RUNPATH \$ORIGIN (has '$search_path')"; return 1; }
  # CANN's ascendc_library re-links the kernel library from link.txt without a shell, so a RUNPATH CMake gives it
  # arrives with its shell quoting (the literal "\$ORIGIN"): the sign that csrc/ascendc gives it one again.
  search_path=$(readelf -d "$kernels" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
  if [[ $search_path == *[\"\'\\]* ]]; then
    say "$kernels has a RUNPATH garbled by CANN's re-link ('$search_path'); it must have none"; return 1
  fi
  report=$("${build_env[@]}" ldd -r "$npu" 2>&1 || true)
  for name in $(readelf -d "$npu" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    # ldd lists a direct dependency first (the dynamic loader itself by its path)
    first=$(grep -m 1 -e "^[[:space:]]$name => " -e "/$name (" <<<"$report" || true)
    if [[ -z $first || $first == *"not found"* ]]; then say "$npu: $name not found (ldd -r)"; return 1; fi
  done
  # Python's C API comes from the interpreter that imports _npu
  undefined=$(grep '^undefined symbol:' <<<"$report" | grep -v '^undefined symbol: _\?Py' \
    | grep -F -e "($npu)" -e "($kernels)" || true)
  if [[ -n $undefined ]]; then echo "$undefined"; say "$npu: undefined symbols (ldd -r)"; return 1; fi
  say "lmcache_npu._npu: RUNPATH \$ORIGIN; its libraries and symbols resolve"
}
npu=$(module_file _npu)
if [[ -n $npu ]]; then verify_npu_module "$npu" || exit 1; fi

# The command the images' users run besides `vllm serve` (`lmcache-npu doctor`, and the node cache service:
# `docker run --entrypoint lmcache-npu IMAGE node-cache ...`, docs/deployment.md): where pip put it, from its record.
if [[ -n $TARGET ]]; then
  command_path=$TARGET/bin/lmcache-npu
else
  relative=$("$PYTHON" -m pip show -f lmcache-npu | sed -n 's|^ *\(.*bin/lmcache-npu\)$|\1|p' | head -n 1)
  command_path=$(realpath -m "$site/$relative")
fi
[[ -x $command_path ]] || { say "the lmcache-npu command was not installed (looked for $command_path)"; exit 1; }
say "lmcache-npu command: $command_path"
if [[ -z $TARGET && $(command -v lmcache-npu || true) != "$command_path" ]]; then
  say "note: $command_path is not the lmcache-npu on PATH ($PATH): run it by its full path"
fi
