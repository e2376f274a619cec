// The transfer contract of csrc/common/transfer_plan.h run with plain memcpy over host memory (vLLM's CPU platform).
//
// For a work item (run, plane) of group g (items are plane-major inside a group, like the device kernels):
//   slot = run.first_slot (kSkipSlot: a zero run)
//   page = base + (slot / rows_per_block) * block_stride + (slot % rows_per_block) * row_bytes      (ND)
//   obj  = object[run.chunk] + object_offset + run.first_row * row_bytes
//   store: page -> obj, num_rows * row_bytes (a zero run writes zeros)   load: obj -> page (a zero run moves nothing)
// FRACTAL_NZ pages are [cols][rows_per_block][nz_unit_bytes]: unit j of block row t sits at
// (j * rows_per_block + t) * nz_unit_bytes, so each row moves as `cols` unit copies.
// Every item is checked against the plane and group geometry before a byte moves; a failing item is counted as
// rejected and left alone, so no table, however forged, makes this code write outside a plane or an object.
#ifndef LMCACHE_NPU_KV_TRANSFER_HOST_H_
#define LMCACHE_NPU_KV_TRANSFER_HOST_H_

#include <stdint.h>

#include "../common/transfer_plan.h"

namespace lmcache_npu {
namespace host {

// What one call did, summed over its threads (the fields of CoreStatus that mean something on a host).
struct HostReport {
  uint64_t items_done = 0;      // work items fully moved (a load's zero run counts, moving nothing)
  uint64_t items_rejected = 0;  // work items refused by the bounds checks, nothing moved
  uint64_t bytes_moved = 0;     // payload bytes written to the destination, zeros included
  uint64_t dma_ops = 0;         // memcpy and memset calls
};

// The tables one call reads; all pointers are host addresses owned by the caller.
struct HostTables {
  const PlaneDesc* planes = nullptr;
  const GroupDesc* groups = nullptr;
  const RunDesc* runs = nullptr;
  const uint64_t* objects = nullptr;  // chunk object base addresses, indexed by RunDesc::chunk
  uint32_t num_planes = 0;
  uint32_t num_groups = 0;
  uint32_t num_runs = 0;
  uint32_t num_chunks = 0;
  uint64_t object_bytes = 0;  // bytes of every chunk object that the plan may touch
  uint64_t total_items = 0;
};

// Moves work items [begin, end) in one direction on the calling thread.
HostReport TransferItems(const HostTables& tables, Direction direction, uint64_t begin, uint64_t end);

// Moves every item, split into `threads` contiguous slices (threads >= 1; 1 runs on the calling thread).
HostReport Transfer(const HostTables& tables, Direction direction, uint32_t threads);

}  // namespace host
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_KV_TRANSFER_HOST_H_
