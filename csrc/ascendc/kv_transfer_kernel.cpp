// Kernel entry for the paged <-> chunk-object copy (contract: csrc/common/transfer_plan.h).
// Built by ascendc_library for the SoC at hand, and for x86 against csrc/ascendc/emu with
// LMCACHE_KV_TRANSFER_KERNEL renamed per emulated target.
#include "kv_transfer.h"

#ifndef LMCACHE_KV_TRANSFER_KERNEL
#define LMCACHE_KV_TRANSFER_KERNEL lmcache_kv_transfer
#endif

extern "C" __global__ __aicore__ void LMCACHE_KV_TRANSFER_KERNEL(GM_ADDR planes, GM_ADDR groups, GM_ADDR runs,
                                                                GM_ADDR objects, GM_ADDR status, uint64_t total_items,
                                                                uint32_t num_planes, uint32_t num_groups,
                                                                uint32_t num_runs, uint32_t num_chunks,
                                                                uint32_t direction, uint32_t tile_bytes,
                                                                uint32_t zero_tile_bytes) {
#if LMCACHE_NPU_SOC_HAS_DATACOPY_PAD
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
#endif
  AscendC::TPipe pipe;
  lmcache_npu::KvTransfer<LMCACHE_NPU_SOC_HAS_DATACOPY_PAD != 0> op;
  op.Init(&pipe, planes, groups, runs, objects, status, total_items, num_planes, num_groups, num_runs, num_chunks,
          direction, tile_bytes, zero_tile_bytes);
  op.Process();
}
