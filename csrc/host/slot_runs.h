// A group's slot matrix cut into runs (csrc/common/transfer_plan.h, RunDesc) and checked, natively: ChunkBatch.build
// runs on every transfer, and its numpy passes cost the load lane tens of microseconds before any launch.
//
// For a (num_chunks, rows) matrix of slots, row-major:
//   * every slot must be kSkipSlot or in [0, limit); the first one that is not (row-major) is the problem;
//   * a load (unique) may name a live slot only once; the problem is the smallest slot named twice, at its first
//     and second position in row-major order;
//   * a run is a maximal stretch of one chunk's rows whose slots are consecutive inside one block of
//     `rows_per_block` rows, or a stretch of skipped rows (kept only with `zero_runs`: a store writes them as zeros).
#ifndef LMCACHE_NPU_SLOT_RUNS_H_
#define LMCACHE_NPU_SLOT_RUNS_H_

#include <stdint.h>

#include <vector>

#include "../common/transfer_plan.h"

namespace lmcache_npu {
namespace host {

enum class SlotProblem : uint32_t {
  kNone = 0,
  kOutOfRange = 1,  // at: the slot outside [-1, limit)
  kTwice = 2,       // at and again: the two rows a load would write one slot from
};

struct SlotRuns {
  std::vector<RunDesc> runs;
  SlotProblem problem = SlotProblem::kNone;
  uint64_t at = 0;     // row-major index of the problem's row
  uint64_t again = 0;  // kTwice: the second row naming the slot
};

// `slots` holds num_chunks * rows values; nothing is returned in `runs` when a problem is found.
SlotRuns CutSlotRuns(const int64_t* slots, uint64_t num_chunks, uint64_t rows, uint64_t rows_per_block, int64_t limit,
                     bool zero_runs, bool unique);

}  // namespace host
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_SLOT_RUNS_H_
