// A group's slot matrix cut into runs and checked: the contract is in slot_runs.h.
#include "slot_runs.h"

#include <algorithm>

namespace lmcache_npu {
namespace host {

SlotRuns CutSlotRuns(const int64_t* slots, uint64_t num_chunks, uint64_t rows, uint64_t rows_per_block, int64_t limit,
                     bool zero_runs, bool unique) {
  SlotRuns out;
  const uint64_t total = num_chunks * rows;
  for (uint64_t i = 0; i < total; ++i) {
    if (slots[i] < kSkipSlot || slots[i] >= limit) {
      out.problem = SlotProblem::kOutOfRange;
      out.at = i;
      return out;
    }
  }
  std::vector<RunDesc> all;  // zero runs included: the check below needs only live ones, a store keeps both
  for (uint64_t i = 0; i < total; ++i) {
    const int64_t slot = slots[i];
    const uint64_t row = rows == 0 ? 0 : i % rows;
    if (row != 0 && !all.empty()) {
      const int64_t previous = slots[i - 1];
      const bool consecutive = previous >= 0 && slot == previous + 1 && slot % static_cast<int64_t>(rows_per_block) != 0;
      if (consecutive || (slot < 0 && previous < 0)) {
        ++all.back().num_rows;
        continue;
      }
    }
    all.push_back(RunDesc{static_cast<int32_t>(slot), static_cast<uint32_t>(i / rows), static_cast<uint32_t>(row), 1});
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
