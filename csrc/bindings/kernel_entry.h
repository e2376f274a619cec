// Signature shared by every build of the kv-transfer kernel entry.
#ifndef LMCACHE_NPU_KERNEL_ENTRY_H_
#define LMCACHE_NPU_KERNEL_ENTRY_H_
#include <cstdint>

using KvTransferEntry = void (*)(uint8_t* planes, uint8_t* groups, uint8_t* runs, uint8_t* objects, uint8_t* status,
                                 uint64_t total_items, uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
                                 uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes,
                                 uint32_t zero_tile_bytes);

extern "C" void lmcache_kv_transfer_a2(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint64_t, uint32_t, uint32_t,
                                       uint32_t, uint32_t, uint32_t, uint32_t, uint32_t);
extern "C" void lmcache_kv_transfer_310p(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint64_t, uint32_t,
                                         uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t);
#endif  // LMCACHE_NPU_KERNEL_ENTRY_H_
