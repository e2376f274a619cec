// A transfer's slots and checked runs straight from its moves and their block windows, in one native call: the
// mover's path to a batch (a sliced load's path to slice 0) crossed Python once per window and group before.
//
// For every plan group that has slots (not skipped), block_slots.h fills each move's row slots from the window its
// move reads, and a store is refused where any group refuses it. Refused moves are dropped; for every moved group,
// slot_runs.h then cuts the kept moves' slot matrix (kept moves in order) into checked runs. The result is exactly
// KVMover's per-window block_slots calls followed by ChunkBatch.build's per-group slot_runs calls.
#ifndef LMCACHE_NPU_MOVE_RUNS_H_
#define LMCACHE_NPU_MOVE_RUNS_H_

#include <stdint.h>

#include <vector>

#include "block_slots.h"
#include "slot_runs.h"

namespace lmcache_npu {
namespace host {

struct RunGroup {
  SlotGroup slots;
  uint32_t scheduler_group = 0;  // the window table its rows live in
  bool moved = false;            // the plan moves planes of it: its runs are cut
  uint64_t rows_per_block = 0;   // of its pages, for the runs
  int64_t limit = 0;             // its pages' rows (blocks x rows_per_block): a slot must lie below
};

struct MoveWindow {
  uint64_t end = 0;  // moves [previous window's end, end) read this window
  int64_t null_block = 0;
  std::vector<std::vector<int64_t>> block_ids;  // per scheduler group
  std::vector<int64_t> first_block;             // per scheduler group
};

struct GroupRuns {
  std::vector<int64_t> slots;  // kept moves x rows_per_chunk, row-major
  SlotRuns runs;               // empty for a group that is not moved
};

struct MoveRuns {
  std::vector<uint8_t> refused;  // per move
  uint64_t kept = 0;
  std::vector<GroupRuns> groups;  // per group (empty for a group without slots)
};

// `groups[g]` is null for a group without slots (skipped). Throws std::invalid_argument for windows that do not
// cover the moves in order, a scheduler group outside a window, or a group geometry without slots.
MoveRuns PlanMoveRuns(const std::vector<const RunGroup*>& groups, const std::vector<MoveWindow>& windows,
                      const ChunkMoves& moves, bool zero_runs, bool unique);

}  // namespace host
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_MOVE_RUNS_H_
