// AscendC paged <-> chunk-object copy kernel (DESIGN §5), one source for A2/A3 and 310P.
//
// Work items are (run, plane) pairs, grid-strided over the launched AIV cores. An item is cut
// into UB-tile pieces that flow through a depth-2 TQueBind<VECIN, VECOUT>: the MTE2 copy-in of
// piece i+1 is issued before the MTE3 copy-out of piece i, so the two DMA queues overlap.
//   A2/A3: ND rows move with byte-granular DataCopyPad (any row width).
//   310P:  no DataCopyPad on that SoC; ND rows must be 32 B multiples and move with DataCopy.
//   FRACTAL_NZ pages (310P KV cache) move with strided DataCopy on either SoC.
// The host validates every input before launch; the kernel re-checks each item against the
// plane geometry and skips (and counts) anything that would leave the plane, so no input can
// make it write out of bounds.
#ifndef LMCACHE_NPU_KV_TRANSFER_H_
#define LMCACHE_NPU_KV_TRANSFER_H_

#if defined(LMCACHE_NPU_EMU)
#include "emu/ascendc_emu.h"
#else
#include "kernel_operator.h"
#endif

#include "../common/transfer_plan.h"

#if (defined(__CCE_AICORE__) && __CCE_AICORE__ == 200) || defined(LMCACHE_NPU_SOC_310P)
#define LMCACHE_NPU_SOC_HAS_DATACOPY_PAD 0
#else
#define LMCACHE_NPU_SOC_HAS_DATACOPY_PAD 1
#endif

namespace lmcache_npu {

// How one UB tile's worth of an item is laid out on the page side.
enum class PieceKind : uint32_t {
  kSpan,        // ND: one contiguous byte range on both sides
  kNzByRow,     // NZ, rows <= columns: one strided DMA per row on the page side
  kNzByColumn,  // NZ, rows > columns: one strided DMA per column on the object side
};

// A GM region a piece may touch: the plane's blocks, or this plane's segment of one chunk object. Every DMA goes
// through a GlobalTensor bound to its region, so an address computed wrong cannot reach another plane or object.
struct GmRange {
  uint64_t base;
  uint64_t bytes;
};

struct Piece {
  PieceKind kind;
  GmRange pages;                 // the plane's blocks
  GmRange segment;               // the plane's segment of the chunk object
  uint64_t page;                 // ND: first byte; NZ: unit (first row, first column)
  uint64_t obj;                  // first object byte
  uint32_t bytes;                // kSpan payload
  uint32_t rows;                 // NZ rows in the piece
  uint32_t cols;                 // NZ columns (16-element units) in the piece
  uint32_t unit_blocks;          // NZ unit in 32 B blocks
  uint32_t column_pitch_blocks;  // page distance between NZ columns = rows_per_block * unit
  uint32_t row_pitch_blocks;     // object distance between rows = row_bytes
};

template <typename Desc>
__aicore__ inline Desc ReadDesc(const AscendC::GlobalTensor<uint64_t>& table, uint64_t index) {
  constexpr uint32_t kWords = sizeof(Desc) / sizeof(uint64_t);
  union {
    Desc desc;
    uint64_t words[kWords];
  } u;
  for (uint32_t w = 0; w < kWords; ++w) u.words[w] = table.GetValue(index * kWords + w);
  return u.desc;
}

template <typename T>
__aicore__ inline AscendC::GlobalTensor<T> Gm(uint64_t addr, uint64_t count) {
  AscendC::GlobalTensor<T> t;
  t.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(addr), count);
  return t;
}

// The bytes of `range` from `addr` on.
__aicore__ inline AscendC::GlobalTensor<uint8_t> In(const GmRange& range, uint64_t addr) {
  return Gm<uint8_t>(range.base, range.bytes)[addr - range.base];
}

__aicore__ inline uint32_t MinU32(uint32_t a, uint32_t b) { return a < b ? a : b; }

template <bool kHasDataCopyPad>
class KvTransfer {
 public:
  __aicore__ inline void Init(AscendC::TPipe* pipe, GM_ADDR planes, GM_ADDR groups, GM_ADDR runs, GM_ADDR objects,
                              GM_ADDR status, uint64_t total_items, uint32_t num_planes, uint32_t num_groups,
                              uint32_t num_runs, uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes,
                              uint32_t zero_tile_bytes) {
    AscendC::SetAtomicNone();  // a previous kernel on the stream may have left atomic add on: writes must overwrite
    pipe_ = pipe;
    planes_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(planes), num_planes * (sizeof(PlaneDesc) / 8));
    groups_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(groups), num_groups * (sizeof(GroupDesc) / 8));
    runs_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(runs), num_runs * (sizeof(RunDesc) / 8));
    objects_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(objects), num_chunks);
    status_addr_ = reinterpret_cast<uint64_t>(status);
    total_items_ = total_items;
    num_planes_ = num_planes;
    num_groups_ = num_groups;
    num_runs_ = num_runs;
    num_chunks_ = num_chunks;
    store_ = direction == kStore;
    // DataCopy moves whole 32 B UB blocks: a tile of 0 (no loop would advance), under 32 B or not a multiple of 32 B
    // refuses the whole launch; the buffers still get one block each so the status can be written
    tiles_ok_ = TileOk(tile_bytes) && TileOk(zero_tile_bytes);
    tile_bytes_ = tiles_ok_ ? tile_bytes : kUbBlockBytes;
    zero_tile_bytes_ = tiles_ok_ ? zero_tile_bytes : kUbBlockBytes;
    pipe_->InitBuffer(queue_, 2, tile_bytes_);
    pipe_->InitBuffer(zero_buf_, zero_tile_bytes_);
    pipe_->InitBuffer(status_buf_, sizeof(CoreStatus));
  }

  __aicore__ inline void Process() {
    const uint64_t core = static_cast<uint64_t>(AscendC::GetBlockIdx());
    const uint64_t cores = static_cast<uint64_t>(AscendC::GetBlockNum());
    if (!tiles_ok_) {  // every item of this core is refused; nothing is read or written but the status
      items_rejected_ = core < total_items_ ? static_cast<uint32_t>((total_items_ - core + cores - 1) / cores) : 0;
      WriteStatus(core);
      return;
    }
    uint32_t g = 0;
    GroupDesc group{};
    if (num_groups_ > 0) group = ReadDesc<GroupDesc>(groups_, 0);
    for (uint64_t item = core; item < total_items_; item += cores) {
      // Items are grouped in table order; a core only ever moves the cursor forward.
      while (g < num_groups_ && item >= group.item_begin + GroupItemCount(group)) {
        if (++g < num_groups_) group = ReadDesc<GroupDesc>(groups_, g);
      }
      if (g >= num_groups_ || item < group.item_begin) {
        ++items_rejected_;
        continue;
      }
      const uint64_t local = item - group.item_begin;
      MoveItem(g, group, group.plane_begin + static_cast<uint32_t>(local / group.run_count),
               group.run_begin + static_cast<uint32_t>(local % group.run_count));
    }
    DrainPending();
    WriteStatus(core);
  }

 private:
  __aicore__ inline void MoveItem(uint32_t g, const GroupDesc& group, uint32_t plane_index, uint32_t run_index) {
    if (!ContractItemInTables(plane_index, num_planes_, run_index, num_runs_)) {
      ++items_rejected_;
      return;
    }
    if (plane_index != cached_plane_index_) {
      plane_ = ReadDesc<PlaneDesc>(planes_, plane_index);
      pages_ = GmRange{plane_.base_addr, static_cast<uint64_t>(plane_.num_blocks - 1) * plane_.block_stride_bytes +
                                             static_cast<uint64_t>(plane_.rows_per_block) * plane_.row_bytes};
      cached_plane_index_ = plane_index;
    }
    const RunDesc run = ReadDesc<RunDesc>(runs_, run_index);
    if (!Admissible(g, group, plane_index, plane_, run_index, run)) {
      ++items_rejected_;
      return;
    }
    const GmRange segment{objects_.GetValue(run.chunk) + plane_.object_offset_bytes,
                          static_cast<uint64_t>(group.rows_per_chunk) * plane_.row_bytes};
    const uint64_t obj = segment.base + static_cast<uint64_t>(run.first_row) * plane_.row_bytes;
    if (run.first_slot < 0) {
      // Skipped rows: a store writes zeros, a load leaves the page untouched.
      if (store_) ZeroFill(segment, obj, static_cast<uint64_t>(run.num_rows) * plane_.row_bytes);
      ++items_done_;
      return;
    }
    const uint32_t slot = static_cast<uint32_t>(run.first_slot);
    const uint64_t block = plane_.base_addr + static_cast<uint64_t>(slot / plane_.rows_per_block) *
                                                  plane_.block_stride_bytes;
    const uint32_t row_in_block = slot % plane_.rows_per_block;
    if (plane_.layout == kPageND) {
      MoveSpan(pages_, segment, block + static_cast<uint64_t>(row_in_block) * plane_.row_bytes, obj,
               static_cast<uint64_t>(run.num_rows) * plane_.row_bytes);
    } else {
      MoveNz(pages_, segment, block, row_in_block, obj, run.num_rows);
    }
    ++items_done_;
  }

  // The contract's rules, then this SoC's: row widths DataCopy can move, NZ units that fit a tile and DMA strides.
  __aicore__ inline bool Admissible(uint32_t g, const GroupDesc& group, uint32_t plane_index, const PlaneDesc& plane,
                                    uint32_t run_index, const RunDesc& run) const {
    if (!ContractAdmissible(g, group, plane_index, plane, run_index, run, num_chunks_)) return false;
    if (plane.layout == kPageND) return kHasDataCopyPad || plane.row_bytes % kUbBlockBytes == 0;
    const uint32_t unit = plane.nz_unit_bytes;
    return unit >= kUbBlockBytes && unit % kUbBlockBytes == 0 && unit <= tile_bytes_ &&
           static_cast<uint64_t>(plane.rows_per_block) * unit / kUbBlockBytes <= kMaxStrideUnits &&
           plane.row_bytes / kUbBlockBytes <= kMaxStrideUnits;
  }

  __aicore__ inline void MoveSpan(const GmRange& pages, const GmRange& segment, uint64_t page, uint64_t obj,
                                  uint64_t bytes) {
    for (uint64_t off = 0; off < bytes; off += tile_bytes_) {
      Piece p{};
      p.kind = PieceKind::kSpan;
      p.pages = pages;
      p.segment = segment;
      p.page = page + off;
      p.obj = obj + off;
      p.bytes = static_cast<uint32_t>(bytes - off < tile_bytes_ ? bytes - off : tile_bytes_);
      Stage(p);
    }
  }

  // DMAs to move a num_rows x cols NZ run in pieces of rows_per_piece x cols_per_piece units.
  __aicore__ static inline bool TileOk(uint32_t bytes) { return bytes >= kUbBlockBytes && bytes % kUbBlockBytes == 0; }

  __aicore__ static inline uint64_t NzDmaCount(uint32_t num_rows, uint32_t cols, uint32_t rows_per_piece,
                                               uint32_t cols_per_piece) {
    const uint64_t pieces = static_cast<uint64_t>((num_rows + rows_per_piece - 1) / rows_per_piece) *
                            ((cols + cols_per_piece - 1) / cols_per_piece);
    return pieces * (1 + MinU32(rows_per_piece, cols_per_piece));
  }

  // NZ page: unit (row t, column j) of a block sits at j * rows_per_block * unit + t * unit.
  // A piece costs 1 + min(rows, cols) DMAs, so it spans the run's longer side in full: either
  // whole rows (all columns) or whole columns (all rows of the run), whichever needs fewer DMAs.
  __aicore__ inline void MoveNz(const GmRange& pages, const GmRange& segment, uint64_t block,
                                uint32_t first_row_in_block, uint64_t obj, uint32_t num_rows) {
    const uint32_t unit = plane_.nz_unit_bytes;
    const uint32_t cols = plane_.row_bytes / unit;
    const uint32_t tile_units = tile_bytes_ / unit;
    uint32_t rows_per_piece = 1, cols_per_piece = MinU32(tile_units, kMaxBlockCount);
    if (cols <= MinU32(tile_units, kMaxBlockCount)) {  // whole rows fit (a row is one DMA of `cols` units)
      rows_per_piece = MinU32(tile_units / cols, kMaxBlockCount);
      cols_per_piece = cols;
    }
    const uint32_t run_rows = MinU32(num_rows, kMaxBlockCount);
    if (run_rows <= tile_units) {  // whole columns of the run fit
      const uint32_t column_cols = MinU32(tile_units / run_rows, kMaxBlockCount);
      if (NzDmaCount(num_rows, cols, run_rows, column_cols) < NzDmaCount(num_rows, cols, rows_per_piece, cols_per_piece)) {
        rows_per_piece = run_rows;
        cols_per_piece = column_cols;
      }
    }
    for (uint32_t r0 = 0; r0 < num_rows; r0 += rows_per_piece) {
      for (uint32_t j0 = 0; j0 < cols; j0 += cols_per_piece) {
        Piece p{};
        p.rows = MinU32(rows_per_piece, num_rows - r0);
        p.cols = MinU32(cols_per_piece, cols - j0);
        p.kind = p.rows <= p.cols ? PieceKind::kNzByRow : PieceKind::kNzByColumn;
        p.pages = pages;
        p.segment = segment;
        p.page = block + static_cast<uint64_t>(j0) * plane_.rows_per_block * unit +
                 static_cast<uint64_t>(first_row_in_block + r0) * unit;
        p.obj = obj + static_cast<uint64_t>(r0) * plane_.row_bytes + static_cast<uint64_t>(j0) * unit;
        p.unit_blocks = unit / kUbBlockBytes;
        p.column_pitch_blocks = plane_.rows_per_block * p.unit_blocks;
        p.row_pitch_blocks = plane_.row_bytes / kUbBlockBytes;
        Stage(p);
      }
    }
  }

  // Depth-2 pipeline: fill a tile, queue it, then drain the previously queued tile.
  __aicore__ inline void Stage(const Piece& piece) {
    AscendC::LocalTensor<uint8_t> tile = queue_.template AllocTensor<uint8_t>();
    CopyIn(tile, piece);
    queue_.EnQue(tile);
    DrainPending();
    pending_ = piece;
    has_pending_ = true;
  }

  __aicore__ inline void DrainPending() {
    if (!has_pending_) return;
    AscendC::LocalTensor<uint8_t> tile = queue_.template DeQue<uint8_t>();
    CopyOut(tile, pending_);
    queue_.FreeTensor(tile);
    has_pending_ = false;
    ++pieces_;
  }

  __aicore__ inline void CopyIn(const AscendC::LocalTensor<uint8_t>& tile, const Piece& p) {
    using AscendC::DataCopyParams;
    if (p.kind == PieceKind::kSpan) {
      ReadSpan(tile, store_ ? In(p.pages, p.page) : In(p.segment, p.obj), p.bytes);
    } else if (p.kind == PieceKind::kNzByRow) {
      const uint32_t row_units = p.cols * p.unit_blocks * kUbBlockBytes;
      if (store_) {  // gather each row's units from the NZ columns
        for (uint32_t i = 0; i < p.rows; ++i) {
          DataCopy(tile[i * row_units], In(p.pages, p.page + static_cast<uint64_t>(i) * p.unit_blocks * kUbBlockBytes),
                   DataCopyParams(static_cast<uint16_t>(p.cols), static_cast<uint16_t>(p.unit_blocks),
                                  static_cast<uint16_t>(p.column_pitch_blocks - p.unit_blocks), 0));
          ++dma_ops_;
        }
      } else {  // object rows, row_pitch apart, land as compact rows
        DataCopy(tile, In(p.segment, p.obj),
                 DataCopyParams(static_cast<uint16_t>(p.rows), static_cast<uint16_t>(p.cols * p.unit_blocks),
                                static_cast<uint16_t>(p.row_pitch_blocks - p.cols * p.unit_blocks), 0));
        ++dma_ops_;
      }
    } else {
      const uint32_t column_units = p.rows * p.unit_blocks * kUbBlockBytes;
      if (store_) {  // each NZ column holds the piece's rows contiguously
        DataCopy(tile, In(p.pages, p.page),
                 DataCopyParams(static_cast<uint16_t>(p.cols), static_cast<uint16_t>(p.rows * p.unit_blocks),
                                static_cast<uint16_t>(p.column_pitch_blocks - p.rows * p.unit_blocks), 0));
        ++dma_ops_;
      } else {  // gather one column of units from the object rows
        for (uint32_t k = 0; k < p.cols; ++k) {
          DataCopy(tile[k * column_units], In(p.segment, p.obj + static_cast<uint64_t>(k) * p.unit_blocks * kUbBlockBytes),
                   DataCopyParams(static_cast<uint16_t>(p.rows), static_cast<uint16_t>(p.unit_blocks),
                                  static_cast<uint16_t>(p.row_pitch_blocks - p.unit_blocks), 0));
          ++dma_ops_;
        }
      }
    }
  }

  __aicore__ inline void CopyOut(const AscendC::LocalTensor<uint8_t>& tile, const Piece& p) {
    using AscendC::DataCopyParams;
    if (p.kind == PieceKind::kSpan) {
      WriteSpan(store_ ? In(p.segment, p.obj) : In(p.pages, p.page), tile, p.bytes);
    } else if (p.kind == PieceKind::kNzByRow) {
      const uint32_t row_units = p.cols * p.unit_blocks * kUbBlockBytes;
      if (store_) {
        DataCopy(In(p.segment, p.obj), tile,
                 DataCopyParams(static_cast<uint16_t>(p.rows), static_cast<uint16_t>(p.cols * p.unit_blocks), 0,
                                static_cast<uint16_t>(p.row_pitch_blocks - p.cols * p.unit_blocks)));
        ++dma_ops_;
      } else {
        for (uint32_t i = 0; i < p.rows; ++i) {
          DataCopy(In(p.pages, p.page + static_cast<uint64_t>(i) * p.unit_blocks * kUbBlockBytes), tile[i * row_units],
                   DataCopyParams(static_cast<uint16_t>(p.cols), static_cast<uint16_t>(p.unit_blocks), 0,
                                  static_cast<uint16_t>(p.column_pitch_blocks - p.unit_blocks)));
          ++dma_ops_;
        }
      }
      bytes_moved_ += static_cast<uint64_t>(p.rows) * row_units;
    } else {
      const uint32_t column_units = p.rows * p.unit_blocks * kUbBlockBytes;
      if (store_) {
        for (uint32_t k = 0; k < p.cols; ++k) {
          DataCopy(In(p.segment, p.obj + static_cast<uint64_t>(k) * p.unit_blocks * kUbBlockBytes), tile[k * column_units],
                   DataCopyParams(static_cast<uint16_t>(p.rows), static_cast<uint16_t>(p.unit_blocks), 0,
                                  static_cast<uint16_t>(p.row_pitch_blocks - p.unit_blocks)));
          ++dma_ops_;
        }
      } else {
        DataCopy(In(p.pages, p.page), tile,
                 DataCopyParams(static_cast<uint16_t>(p.cols), static_cast<uint16_t>(p.rows * p.unit_blocks), 0,
                                static_cast<uint16_t>(p.column_pitch_blocks - p.rows * p.unit_blocks)));
        ++dma_ops_;
      }
      bytes_moved_ += static_cast<uint64_t>(p.cols) * column_units;
    }
  }

  __aicore__ inline void ReadSpan(const AscendC::LocalTensor<uint8_t>& tile, const AscendC::GlobalTensor<uint8_t>& src,
                                  uint32_t bytes) {
    if constexpr (kHasDataCopyPad) {
      DataCopyPad(tile, src, AscendC::DataCopyExtParams(1, bytes, 0, 0, 0),
                  AscendC::DataCopyPadExtParams<uint8_t>(false, 0, 0, 0));
    } else {
      DataCopy(tile, src, bytes);  // 32 B multiple: checked by Admissible
    }
    ++dma_ops_;
  }

  __aicore__ inline void WriteSpan(const AscendC::GlobalTensor<uint8_t>& dst, const AscendC::LocalTensor<uint8_t>& tile,
                                   uint32_t bytes) {
    if constexpr (kHasDataCopyPad) {
      DataCopyPad(dst, tile, AscendC::DataCopyExtParams(1, bytes, 0, 0, 0));
    } else {
      DataCopy(dst, tile, bytes);
    }
    ++dma_ops_;
    bytes_moved_ += bytes;
  }

  __aicore__ inline void ZeroFill(const GmRange& segment, uint64_t obj, uint64_t bytes) {
    if (!zero_ready_) {
      // Filled once by the vector unit; MTE3 reads it only after V_MTE3.
      zero_ = zero_buf_.template Get<uint8_t>();
      AscendC::LocalTensor<uint16_t> halves = zero_.template ReinterpretCast<uint16_t>();
      AscendC::Duplicate<uint16_t>(halves, static_cast<uint16_t>(0), static_cast<int32_t>(zero_tile_bytes_ / 2));
      const int32_t event = static_cast<int32_t>(pipe_->template FetchEventID<AscendC::HardEvent::V_MTE3>());
      AscendC::SetFlag<AscendC::HardEvent::V_MTE3>(event);
      AscendC::WaitFlag<AscendC::HardEvent::V_MTE3>(event);
      zero_ready_ = true;
    }
    for (uint64_t off = 0; off < bytes; off += zero_tile_bytes_) {
      WriteSpan(In(segment, obj + off), zero_,
                static_cast<uint32_t>(bytes - off < zero_tile_bytes_ ? bytes - off : zero_tile_bytes_));
    }
  }

  __aicore__ inline void WriteStatus(uint64_t core) {
    AscendC::LocalTensor<uint32_t> words = status_buf_.template Get<uint32_t>();
    words.SetValue(0, items_done_);
    words.SetValue(1, items_rejected_);
    words.SetValue(2, dma_ops_ + 1);  // + this write
    words.SetValue(3, pieces_);
    words.SetValue(4, static_cast<uint32_t>(bytes_moved_ & 0xffffffffu));
    words.SetValue(5, static_cast<uint32_t>(bytes_moved_ >> 32));
    words.SetValue(6, 0u);
    words.SetValue(7, 0u);
    const int32_t event = static_cast<int32_t>(pipe_->template FetchEventID<AscendC::HardEvent::S_MTE3>());
    AscendC::SetFlag<AscendC::HardEvent::S_MTE3>(event);
    AscendC::WaitFlag<AscendC::HardEvent::S_MTE3>(event);
    DataCopy(Gm<uint32_t>(status_addr_ + core * sizeof(CoreStatus), sizeof(CoreStatus) / sizeof(uint32_t)), words,
             static_cast<uint32_t>(sizeof(CoreStatus) / sizeof(uint32_t)));
  }

  AscendC::TPipe* pipe_ = nullptr;
  AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, 2> queue_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> zero_buf_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> status_buf_;
  AscendC::LocalTensor<uint8_t> zero_;
  AscendC::GlobalTensor<uint64_t> planes_, groups_, runs_, objects_;
  uint64_t status_addr_ = 0;
  uint64_t total_items_ = 0;
  uint32_t num_planes_ = 0, num_groups_ = 0, num_runs_ = 0, num_chunks_ = 0;
  uint32_t tile_bytes_ = 0, zero_tile_bytes_ = 0;
  bool tiles_ok_ = false;
  bool store_ = true;
  bool zero_ready_ = false;
  bool has_pending_ = false;
  Piece pending_{};
  PlaneDesc plane_{};
  GmRange pages_{};  // plane_'s blocks, derived when plane_ is read
  uint32_t cached_plane_index_ = 0xffffffffu;
  uint32_t items_done_ = 0, items_rejected_ = 0, dma_ops_ = 0, pieces_ = 0;
  uint64_t bytes_moved_ = 0;
};

}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_KV_TRANSFER_H_
