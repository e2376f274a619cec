// Chunk rows to page slots: the contract is in block_slots.h.
#include "block_slots.h"

#include <stdexcept>
#include <string>

#include "../common/transfer_plan.h"

namespace lmcache_npu {
namespace host {

void BlockSlots(const SlotGroup& g, const std::vector<int64_t>& block_ids, int64_t first_block, int64_t null_block,
                const ChunkMoves& moves, int64_t* slots, uint8_t* refused) {
  if (g.chunk_tokens <= 0 || g.tokens_per_block <= 0 || g.compress_ratio <= 0 || g.rows_per_block <= 0 ||
      g.rows_per_chunk < 0 || g.stored_tokens > g.chunk_tokens) {
    throw std::invalid_argument("block slots: a group needs positive chunk_tokens (" + std::to_string(g.chunk_tokens) +
                                "), tokens_per_block, compress_ratio and rows_per_block, and stored_tokens <= "
                                "chunk_tokens");
  }
  const int64_t blocks = static_cast<int64_t>(block_ids.size());
  for (uint64_t m = 0; m < moves.count; ++m) {
    const int64_t index = moves.index[m];
    if (index < 0) throw std::invalid_argument("block slots: chunk index " + std::to_string(index) + " is negative");
    int64_t* row_slots = slots + m * static_cast<uint64_t>(g.rows_per_chunk);
    const bool load = moves.transfer && !moves.store[m];
    const bool store = moves.transfer && moves.store[m];
    const int64_t first = moves.transfer ? moves.first_token[m] : 0;
    const int64_t end = moves.transfer ? moves.end_token[m] : 0;
    const bool bare = moves.transfer && moves.bare[m];
    const bool last_chunk = (index + 1) * g.chunk_tokens == end;
    // a recurrent group: a load reads only the hit's last state, a bare store writes none
    const bool no_state = g.recurrent && ((load && !last_chunk) || (store && bare));
    const bool written = store && !(g.recurrent && bare);
    bool refuse = false;
    // the token's block and place in it, stepped row by row (no division per row where compress_ratio is 1)
    int64_t token = index * g.chunk_tokens + (g.chunk_tokens - g.stored_tokens);
    int64_t block = token / g.tokens_per_block, within = token % g.tokens_per_block;
    for (int64_t r = 0; r < g.rows_per_chunk; ++r, token += g.compress_ratio) {
      if (r > 0) {
        within += g.compress_ratio;
        while (within >= g.tokens_per_block) {
          within -= g.tokens_per_block;
          ++block;
        }
      }
      const int64_t logical = block - first_block;
      int64_t slot = kSkipSlot;
      if (logical >= 0 && logical < blocks) {
        const int64_t physical = block_ids[static_cast<size_t>(logical)];
        if (physical >= 0 && !(null_block >= 0 && physical == null_block)) {
          slot = physical * g.rows_per_block + (g.compress_ratio == 1 ? within : within / g.compress_ratio);
        }
      }
      if (moves.transfer) {
        if (load && (token < first || (!g.recurrent && token >= end))) slot = kSkipSlot;  // vLLM's rows, past the hit
        if (no_state) slot = kSkipSlot;
        const bool past = written && end > 0 && token >= end;  // a prompt's partial last chunk: not its rows yet
        if (written && !past && slot < 0) refuse = true;
        if (past) slot = kSkipSlot;
      }
      row_slots[r] = slot;
    }
    if (refused != nullptr) refused[m] = refuse ? 1 : 0;
  }
}

}  // namespace host
}  // namespace lmcache_npu
