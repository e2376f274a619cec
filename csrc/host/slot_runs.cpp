// A group's slot matrix cut into runs and checked: the contract is in slot_runs.h.
#include "slot_runs.h"

#include <algorithm>

namespace lmcache_npu {
namespace host {

SlotRuns CutSlotRuns(const int64_t* slots, uint64_t num_chunks, uint64_t rows, uint64_t rows_per_block, int64_t limit,
                     bool zero_runs, bool unique) {
  SlotRuns out;
  const uint64_t total = num_chunks * rows;
  const int64_t block_rows = static_cast<int64_t>(rows_per_block);
  std::vector<RunDesc> all;  // zero runs included: the check below needs only live ones, a store keeps both
  all.reserve(num_chunks * 4);
  for (uint64_t c = 0, i = 0; c < num_chunks; ++c) {
    int64_t previous = 0, previous_row = 0;  // the row before's slot, and its row inside its block
    for (uint64_t row = 0; row < rows; ++row, ++i) {
      const int64_t slot = slots[i];
      if (slot < kSkipSlot || slot >= limit) {  // the first in row-major order: the runs so far are dropped
        out.problem = SlotProblem::kOutOfRange;
        out.at = i;
        return out;
      }
      if (row != 0) {
        if (previous >= 0 && slot == previous + 1 && previous_row + 1 < block_rows) {  // same block, next row
          ++all.back().num_rows;
          previous = slot;
          ++previous_row;
          continue;
        }
        if (slot < 0 && previous < 0) {
          ++all.back().num_rows;
          continue;
        }
      }
      all.push_back(RunDesc{static_cast<int32_t>(slot), static_cast<uint32_t>(c), static_cast<uint32_t>(row), 1});
      previous = slot;
      previous_row = slot >= 0 ? slot % block_rows : 0;  // one division per run, not per row
    }
  }
  if (unique) {  // live runs sorted by slot: the first overlap starts at the smallest slot named twice
    std::vector<const RunDesc*> live;
    for (const RunDesc& run : all) {
      if (run.first_slot >= 0) live.push_back(&run);
    }
    std::sort(live.begin(), live.end(), [](const RunDesc* a, const RunDesc* b) { return a->first_slot < b->first_slot; });
    int64_t covered = -1;  // one past the highest slot of the runs so far
    for (const RunDesc* run : live) {
      if (run->first_slot < covered) {
        const int64_t twice = run->first_slot;
        bool seen = false;
        for (uint64_t i = 0; i < total; ++i) {
          if (slots[i] != twice) continue;
          if (seen) {
            out.problem = SlotProblem::kTwice;
            out.again = i;
            return out;
          }
          out.at = i;
          seen = true;
        }
      }
      covered = std::max<int64_t>(covered, int64_t{run->first_slot} + run->num_rows);
    }
  }
  if (zero_runs) {
    out.runs.swap(all);
  } else {
    for (const RunDesc& run : all) {
      if (run.first_slot >= 0) out.runs.push_back(run);
    }
  }
  return out;
}

}  // namespace host
}  // namespace lmcache_npu
