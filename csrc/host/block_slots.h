// Chunk rows to page slots (lmcache_npu/layout/slots.py states the formula), natively: every transfer plans them,
// and the numpy version was the largest step on a sliced load's path to slice 0.
//
// For chunk `index` of a plan group, stored row r covers token
//   t = index * chunk_tokens + (chunk_tokens - stored_tokens) + r * compress_ratio,
// which lives in logical block t / tokens_per_block at row (t % tokens_per_block) / compress_ratio. With the
// block table window `block_ids` starting at logical block `first_block`, the row's slot is
//   block_ids[logical - first_block] * rows_per_block + row,
// or kSkipSlot where the block is outside the window or is the null block (when `null_block` >= 0).
//
// With `transfer` set, each chunk is one move of a transfer and its rows are masked as KVMover documents: a load
// leaves rows before `first_token` and from `end_token` on alone, and reads a recurrent state only into the chunk
// ending at `end_token`; a store without its end state (`bare`) writes none of a recurrent group, and a store with
// an `end_token` writes zeros from it on. A store that would write zeros for a row the model needs (its slot is
// missing) is refused.
#ifndef LMCACHE_NPU_BLOCK_SLOTS_H_
#define LMCACHE_NPU_BLOCK_SLOTS_H_

#include <stdint.h>

#include <vector>

namespace lmcache_npu {
namespace host {

struct SlotGroup {
  int64_t chunk_tokens = 0;
  int64_t stored_tokens = 0;
  int64_t tokens_per_block = 0;
  int64_t compress_ratio = 0;
  int64_t rows_per_block = 0;
  int64_t rows_per_chunk = 0;
  bool recurrent = false;
};

struct ChunkMoves {
  const int64_t* index = nullptr;        // the request's chunk number, per chunk
  const int64_t* first_token = nullptr;  // transfer only
  const int64_t* end_token = nullptr;
  const uint8_t* store = nullptr;
  const uint8_t* bare = nullptr;
  uint64_t count = 0;
  bool transfer = false;
};

// Fills `slots` (count x rows_per_chunk, row-major) and, for a transfer, `refused` (count); throws
// std::invalid_argument for a group geometry that has no slots (a non-positive size).
void BlockSlots(const SlotGroup& group, const std::vector<int64_t>& block_ids, int64_t first_block,
                int64_t null_block, const ChunkMoves& moves, int64_t* slots, uint8_t* refused);

}  // namespace host
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_BLOCK_SLOTS_H_
