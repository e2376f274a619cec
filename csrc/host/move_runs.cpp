// A transfer's slots and checked runs from its moves: the contract is in move_runs.h.
#include "move_runs.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace lmcache_npu {
namespace host {

MoveRuns PlanMoveRuns(const std::vector<const RunGroup*>& groups, const std::vector<MoveWindow>& windows,
                      const ChunkMoves& moves, bool zero_runs, bool unique) {
  uint64_t begin = 0;
  for (const MoveWindow& window : windows) {
    if (window.end < begin || window.end > moves.count || window.block_ids.size() != window.first_block.size()) {
      throw std::invalid_argument("move runs: a window must end after the previous one, inside the " +
                                  std::to_string(moves.count) + " moves, with a first block per block table");
    }
    begin = window.end;
  }
  if (begin != moves.count) {
    throw std::invalid_argument("move runs: the windows cover " + std::to_string(begin) + " of " +
                                std::to_string(moves.count) + " moves");
  }
  MoveRuns out;
  out.refused.assign(moves.count, 0);
  out.groups.resize(groups.size());
  std::vector<uint8_t> refused_here(moves.count, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    const RunGroup* group = groups[g];
    if (group == nullptr) continue;
    const uint64_t rows = static_cast<uint64_t>(std::max<int64_t>(group->slots.rows_per_chunk, 0));
    std::vector<int64_t>& slots = out.groups[g].slots;
    slots.resize(moves.count * rows);
    uint64_t first = 0;
    for (const MoveWindow& window : windows) {
      if (group->scheduler_group >= window.block_ids.size()) {
        throw std::invalid_argument("move runs: group " + std::to_string(g) + " reads block table " +
                                    std::to_string(group->scheduler_group) + ", the window has " +
                                    std::to_string(window.block_ids.size()));
      }
      ChunkMoves part = moves;
      part.index += first;
      part.count = window.end - first;
      if (moves.transfer) {
        part.first_token += first;
        part.end_token += first;
        part.store += first;
        part.bare += first;
      }
      BlockSlots(group->slots, window.block_ids[group->scheduler_group],
                 window.first_block[group->scheduler_group], window.null_block, part, slots.data() + first * rows,
                 refused_here.data() + first);
      first = window.end;
    }
    for (uint64_t m = 0; m < moves.count; ++m) out.refused[m] |= refused_here[m];
  }
  // refused moves leave every group's matrix: the batch holds the kept moves, in order
  out.kept = moves.count - static_cast<uint64_t>(std::count(out.refused.begin(), out.refused.end(), 1));
  for (size_t g = 0; g < groups.size(); ++g) {
    const RunGroup* group = groups[g];
    if (group == nullptr) continue;
    const uint64_t rows = static_cast<uint64_t>(std::max<int64_t>(group->slots.rows_per_chunk, 0));
    std::vector<int64_t>& slots = out.groups[g].slots;
    if (out.kept != moves.count) {
      uint64_t to = 0;
      for (uint64_t m = 0; m < moves.count; ++m) {
        if (out.refused[m]) continue;
        std::copy(slots.begin() + m * rows, slots.begin() + (m + 1) * rows, slots.begin() + to * rows);
        ++to;
      }
      slots.resize(out.kept * rows);
    }
    if (group->moved && out.kept > 0) {
      out.groups[g].runs =
          CutSlotRuns(slots.data(), out.kept, rows, group->rows_per_block, group->limit, zero_runs, unique);
    }
  }
  return out;
}

}  // namespace host
}  // namespace lmcache_npu
