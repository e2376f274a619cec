// A sliced load's work order (issue 41), planned natively: the numpy version cost the load lane ~0.4 ms of host time
// before slice 0 could be enqueued, most of it fixed per-call numpy overhead.
//
// Given a batch's runs and group table (csrc/common/transfer_plan.h) and, per moved plane, the slice it belongs to:
//   * each run is cut into pieces of at most max(1, piece_bytes / widest row of its group) rows (piece_bytes 0: not
//     cut), pieces are runs too (first_row and a live first_slot advance by the rows before them);
//   * an item is one (piece, plane) pair of the piece's group; its staging bytes are
//       [chunk * object_bytes + object_offset(plane) + first_row * row_bytes, + num_rows * row_bytes);
//   * items are ordered by (slice of their plane, staging start), and counted per slice (num_slices counts, empty
//     slices 0);
//   * pieces of the copy: consecutive items of one slice and one chunk merged where the gap between them is below
//     kObjectAlignBytes (planes are aligned, so a plane outside the order is never inside a merged piece), as rows
//     (chunk, offset in object, length, slice).
// The result is exactly what lmcache_npu/ops/cuda/work_order.py documents for `sliced_load_order`.
#ifndef LMCACHE_NPU_SLICED_ORDER_H_
#define LMCACHE_NPU_SLICED_ORDER_H_

#include <stdint.h>

#include <array>
#include <vector>

#include "../common/transfer_plan.h"

namespace lmcache_npu {
namespace host {

struct SlicedOrderInput {
  const PlaneDesc* planes = nullptr;  // the plan's moved planes (object offsets, row bytes, groups)
  const GroupDesc* groups = nullptr;
  const RunDesc* runs = nullptr;
  const int64_t* plane_slice = nullptr;  // per plane: its slice, in [0, num_slices)
  uint32_t num_planes = 0;
  uint32_t num_groups = 0;
  uint32_t num_runs = 0;
  uint32_t num_chunks = 0;
  uint32_t num_slices = 0;
  uint64_t piece_bytes = 0;
  uint64_t object_bytes = 0;
  const uint64_t* object_addresses = nullptr;  // per chunk; null: no copies are planned
  const uint64_t* object_storages = nullptr;   // per chunk: the allocation holding it (a copy never spans two)
};

struct SlicedOrder {
  std::vector<RunDesc> runs;                      // the pieces, group by group
  std::vector<GroupDesc> groups;                  // the group table over `runs`
  std::vector<std::array<uint32_t, 4>> items;     // piece, plane, slice, 0
  std::vector<uint32_t> slice_items;              // items per slice
  std::vector<std::array<int64_t, 4>> pieces;     // chunk, offset in object, length, slice
  std::vector<std::array<uint64_t, 4>> copies;    // staging offset, host address, length, slice
};

// Plans into `order`, reusing its vectors' memory (a caller keeps one per thread: freshly allocated vectors cost
// page faults on every load). Throws std::invalid_argument naming the table entry that breaks a rule (a plane
// outside the slices, a run or a plane range outside its table, a chunk outside the batch); `order` is then unusable.
void PlanSlicedLoad(const SlicedOrderInput& input, SlicedOrder* order);

// The order packed for the CUDA backend's one native call (lmcache_npu/ops/cuda/backend.py), so no Python step sits
// between planning and enqueueing: parts at 64 B aligned offsets, in this order.
enum PackedPart {
  kPackedGroups,       // the order's group table
  kPackedRuns,         // its pieces
  kPackedObjects,      // per chunk the address the kernel reads: staging + chunk * object_bytes, or the object's own
  kPackedItems,        // the order's items
  kPackedSliceItems,   // items per slice
  kPackedCounters,     // per slice, zero: the kernel counts finished items there
  kPackedStatus,       // status_bytes of zeros: the kernel's report
  kPackedHostObjects,  // empty: a sliced load has no mapped prefix
  kPackedParts
};

struct PackedLayout {
  std::array<uint64_t, kPackedParts> offsets{};
  uint64_t bytes = 0;  // the buffer's size (at least 64)
};

PackedLayout PackedSlicedLayout(const SlicedOrder& order, uint32_t num_chunks, uint64_t status_bytes);

// Writes every part at `layout`'s offsets into `out` (layout.bytes long, zeroed where the kernel counts). The object
// table holds staging_address + chunk * object_bytes where staging_address is not 0, else object_addresses.
void PackSlicedLoad(const SlicedOrder& order, const PackedLayout& layout, uint32_t num_chunks, uint64_t object_bytes,
                    uint64_t staging_address, const uint64_t* object_addresses, uint8_t* out);

}  // namespace host
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_SLICED_ORDER_H_
