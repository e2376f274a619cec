#!/usr/bin/env bash
# Syntax-checks the AscendC kernel (csrc/ascendc/kv_transfer_kernel.cpp) against the real open AscendC headers, for
# A2/A3 and 310P, with every C++ compiler found (g++, clang++). The CI proves the kernel under our emulator; this
# proves the same source is well-formed against the vendor's API (parameter structs, template arity, member names).
#
#   ASC_DEVKIT   a checkout of asc-devkit (holds include/ and impl/, kernel_operator.h)        [required]
#   ASC_TOOLS    a checkout of asc-tools (cpudebug/include: kern_fwk.h, stub_def.h)           [required]
#   STUB_FUN_DIR a directory holding stub_fun.h, the CPU-debug intrinsic declarations that ship with a CANN
#                toolkit (tools/tikicpulib/lib/include/stub_fun.h)                              [required]
#   KERNEL_SOURCE the file to check (default: the kernel; tests pass a broken copy as a negative control)
#   CXX_LIST     compilers to try (default: "g++ clang++", those on PATH)
#
# Exit: 0 every (SoC, compiler) pair is clean in our files; 1 a diagnostic in our files or an error anywhere;
# 77 skipped: a required input is missing (the message names it).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SOURCE=${KERNEL_SOURCE:-$ROOT/csrc/ascendc/kv_transfer_kernel.cpp}

missing=()
[[ -n ${ASC_DEVKIT:-} && -d ${ASC_DEVKIT} && -n $(find "$ASC_DEVKIT" -name kernel_operator.h -print -quit) ]] \
  || missing+=("ASC_DEVKIT (an asc-devkit checkout with kernel_operator.h)")
[[ -n ${ASC_TOOLS:-} && -f ${ASC_TOOLS}/cpudebug/include/kern_fwk.h ]] || missing+=("ASC_TOOLS (an asc-tools checkout with cpudebug/include/kern_fwk.h)")
[[ -n ${STUB_FUN_DIR:-} && -f ${STUB_FUN_DIR}/stub_fun.h ]] || missing+=("STUB_FUN_DIR (a directory with stub_fun.h from a CANN toolkit)")
if ((${#missing[@]})); then
  printf 'check_ascendc_headers: skipped, missing: %s\n' "${missing[@]}"
  exit 77
fi
compilers=()
for cxx in ${CXX_LIST:-g++ clang++}; do command -v "$cxx" >/dev/null && compilers+=("$cxx"); done
if ((${#compilers[@]} == 0)); then echo "check_ascendc_headers: skipped, no C++ compiler on PATH"; exit 77; fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# kernel_operator.h includes a generated kernel_tiling/kernel_tiling.h: asc-devkit ships its generator.
python3 "$ASC_DEVKIT/impl/adv_api/cmake/scripts/gen_kernel_tiling_data_def.py" "$ASC_DEVKIT/include/adv_api" \
  "$work/tiling/kernel_tiling/kernel_tiling.h" > /dev/null || { echo "check_ascendc_headers: tiling header generation failed"; exit 1; }

includes=(-isystem "$ASC_TOOLS/cpudebug/include" -isystem "$STUB_FUN_DIR" -isystem "$work/tiling" -isystem "$ASC_DEVKIT")
for d in include/basic_api include/utils include/adv_api include/c_api include/simt_api include impl impl/basic_api \
         impl/utils impl/c_api impl/simt_api; do
  [[ -d $ASC_DEVKIT/$d ]] && includes+=(-isystem "$ASC_DEVKIT/$d")
done
common=(-std=c++17 -fsyntax-only -Wall -Wextra -DASCENDC_CPU_DEBUG=1 -D__CCE_KT_TEST__=1 -D_GLIBCXX_USE_CXX11_ABI=0
        -I"$ROOT/csrc/ascendc" -I"$ROOT/csrc")
declare -A socs=(
  [a2]="-D__NPU_ARCH__=2201 -D__CCE_AICORE__=220 -D__DAV_C220__ -D__DAV_C220_VEC__ -D__DAV_VEC__"
  [310p]="-D__NPU_ARCH__=2002 -D__CCE_AICORE__=200 -D__DAV_M200__ -DLMCACHE_NPU_SOC_310P=1"
)
status=0
for soc in a2 310p; do
  for cxx in "${compilers[@]}"; do
    log="$work/$soc-$cxx.log"
    # shellcheck disable=SC2086
    "$cxx" "${common[@]}" ${socs[$soc]} "${includes[@]}" "$SOURCE" > "$log" 2>&1
    rc=$?
    ours=$(grep -E "^($ROOT|$(dirname "$SOURCE"))/[^:]+:[0-9]+:[0-9]+: (warning|error)" "$log" | sort -u)
    errors=$(grep -cE ": (fatal )?error:" "$log")
    if [[ $rc -ne 0 || -n $ours ]]; then
      status=1
      echo "check_ascendc_headers: $soc $cxx: FAIL (exit $rc, $errors errors)"
      { [[ -n $ours ]] && echo "$ours"; grep -E ": (fatal )?error:" "$log" | head -20; } | sed 's/^/  /'
    else
      echo "check_ascendc_headers: $soc $cxx: ok (no diagnostic in our files)"
    fi
  done
done
exit $status
