// The transfer contract every backend implements (DESIGN §3-§4).
//
// For every chunk c, plane p, row r < rows_per_chunk(group(p)):
//   slot = slots[group(p)][c][r]                      (-1: skip the row)
//   page = base[p] + (slot / rows_per_block) * block_stride[p] + (slot % rows_per_block) * row_bytes[p]
//   obj  = object[c] + object_offset[p] + r * row_bytes[p]
//   store: page -> obj (a skipped row writes zeros)   load: obj -> page (a skipped row is untouched)
//
// The host turns the slot arrays into RunDesc records (maximal stretches of consecutive
// slots inside one block); a kernel work item is one (run, plane) pair. All structs are
// POD with fixed widths so Python (numpy structured dtypes), AscendC, CUDA and the
// emulator read the same bytes. Changing any of them bumps kLayoutVersion.
//
// Admissibility: a kernel moves a work item only if ContractItemInTables and ContractAdmissible (below) hold:
//   * its plane and run indices lie inside the tables it was given;
//   * the plane names the item's group (group_index) and both indices lie in that group's plane and run ranges;
//   * the run's chunk is < num_chunks, num_rows > 0, first_row + num_rows <= rows_per_chunk;
//   * the plane has rows_per_block > 0 equal to the group's and row_bytes > 0;
//   * a live run's slot lies in the plane (slot / rows_per_block < num_blocks) and the run in one block;
//   * the layout is ND, or FRACTAL_NZ with a unit > 0 that divides row_bytes.
// A backend may only add rules on top (host: the object-size bound; AscendC: SoC row alignment, DMA and UB limits).
// An item that fails is counted in items_rejected and moves no byte; a backend never loosens these rules.
#ifndef LMCACHE_NPU_TRANSFER_PLAN_H_
#define LMCACHE_NPU_TRANSFER_PLAN_H_

#include <stdint.h>

// Function qualifier for code every backend runs: device-callable under nvcc, an AI-core function under the AscendC
// headers (real or emulated; both define __aicore__ and are included before this header), plain inline elsewhere.
#if defined(__CUDACC__)
#define LMCACHE_FN __host__ __device__ __forceinline__
#elif defined(__aicore__) || defined(__CCE_AICORE__)
#define LMCACHE_FN __aicore__ inline
#else
#define LMCACHE_FN inline
#endif

namespace lmcache_npu {

// Version of the chunk-object byte layout and of the descriptor structs below.
constexpr uint32_t kLayoutVersion = 1;
// Every plane segment inside a chunk object starts at a multiple of this. The alignment gaps
// between segments carry no data: a store may leave them as they were or write zeros there, and a
// load never reads them.
constexpr uint32_t kObjectAlignBytes = 64;
// Slot value that means "no page for this row".
constexpr int32_t kSkipSlot = -1;
// Hardware DMA limits shared by the kernels and the host-side validation.
constexpr uint32_t kMaxBlockCount = 4095;        // DataCopy(Pad) blockCount (12 bits)
constexpr uint32_t kMaxPadBlockLen = 2097151;    // DataCopyPad blockLen in bytes (21 bits)
constexpr uint32_t kMaxStrideUnits = 65535;      // DataCopyParams strides/blockLen in 32 B units
constexpr uint32_t kUbBlockBytes = 32;           // UB address and DataCopy granularity

enum PageLayout : uint32_t {
  kPageND = 0,          // row r of a block at r * row_bytes
  kPageFractalNZ = 1,   // 310P: [cols][rows_per_block][nz_unit_bytes]; a row is `cols` units
};

enum Direction : uint32_t {
  kStore = 0,  // pages -> chunk objects
  kLoad = 1,   // chunk objects -> pages
};

// One paged tensor component of one layer. Static for the life of a plan.
struct PlaneDesc {
  uint64_t base_addr;            // byte address of block 0, row 0
  uint64_t block_stride_bytes;   // distance between blocks (pages may be padded)
  uint64_t object_offset_bytes;  // segment start inside a chunk object (64 B aligned)
  uint32_t num_blocks;
  uint32_t rows_per_block;
  uint32_t row_bytes;
  uint32_t group_index;          // index into the GroupDesc table
  uint32_t layout;               // PageLayout
  uint32_t nz_unit_bytes;        // FRACTAL_NZ: bytes of one 16-element unit; 0 for ND
  uint32_t reserved[4];
};
static_assert(sizeof(PlaneDesc) == 64, "PlaneDesc is part of the wire contract");

// One scheduler KV-cache group as the kernel sees it for one transfer call.
// Planes of a group are contiguous in the plane table: [plane_begin, plane_begin + plane_count).
// Runs of a group are contiguous in the run table: [run_begin, run_begin + run_count).
// Work items of a group are plane-major: item_begin + plane_local * run_count + run_local.
struct GroupDesc {
  uint32_t rows_per_chunk;
  uint32_t rows_per_block;
  uint32_t plane_begin;
  uint32_t plane_count;
  uint32_t run_begin;
  uint32_t run_count;
  uint64_t item_begin;
};
static_assert(sizeof(GroupDesc) == 32, "GroupDesc is part of the wire contract");

// A maximal stretch of rows of one chunk whose slots are consecutive inside one block,
// or (store only) a stretch of skipped rows that become zeros.
struct RunDesc {
  int32_t first_slot;   // kSkipSlot for a zero run
  uint32_t chunk;       // index into the object address table
  uint32_t first_row;   // row inside the chunk, < rows_per_chunk
  uint32_t num_rows;
};
static_assert(sizeof(RunDesc) == 16, "RunDesc is part of the wire contract");

// Per-core report written once at the end of a launch (32 bytes, one UB block).
struct CoreStatus {
  uint32_t items_done;       // work items fully moved
  uint32_t items_rejected;   // work items refused by the kernel's own bounds checks
  uint32_t dma_ops;          // DataCopy/DataCopyPad calls issued (both MTE queues)
  uint32_t pieces;           // UB tiles that went through the queue
  uint64_t bytes_moved;      // payload bytes written to the destination
  uint64_t reserved;
};
static_assert(sizeof(CoreStatus) == 32, "CoreStatus is part of the wire contract");

// UB split chosen by the host from the UB capacity: two data tiles (the depth-2 queue),
// one read-only zero tile (store of skipped rows), one status block.
struct UbTiling {
  uint32_t tile_bytes;
  uint32_t zero_tile_bytes;
  uint32_t status_bytes;
  uint32_t reserve_bytes;
};

constexpr uint32_t kMinUbBytes = 256;

inline constexpr uint32_t AlignDown(uint32_t value, uint32_t align) { return value / align * align; }
inline constexpr uint32_t AlignUp(uint32_t value, uint32_t align) { return (value + align - 1) / align * align; }

// Leaves 1/16 of UB to the runtime (scalar spill, debug dump), then a zero tile of at most
// 16 KiB, then two equal data tiles. Tiles of 4 KiB and more are 512 B multiples because GM
// bursts at 512 B alignment run faster on A2; smaller ones keep the 32 B UB granularity.
inline constexpr UbTiling ComputeUbTiling(uint32_t ub_bytes) {
  UbTiling t{0, 0, kUbBlockBytes, 0};
  t.reserve_bytes = AlignUp(ub_bytes / 16, kUbBlockBytes);
  const uint32_t usable = ub_bytes - t.reserve_bytes - t.status_bytes;
  uint32_t zero = AlignDown(usable / 8, kUbBlockBytes);
  zero = zero > 16384u ? 16384u : (zero < kUbBlockBytes ? kUbBlockBytes : zero);
  t.zero_tile_bytes = zero;
  const uint32_t half = (usable - zero) / 2;
  t.tile_bytes = half >= 4096u ? AlignDown(half, 512u) : AlignDown(half, kUbBlockBytes);
  return t;
}

// Work items of a group (plane-major, see GroupDesc).
LMCACHE_FN uint64_t GroupItemCount(const GroupDesc& group) {
  return static_cast<uint64_t>(group.plane_count) * group.run_count;
}

// Whether a work item's plane and run indices lie inside the tables; checked before either descriptor is read.
LMCACHE_FN bool ContractItemInTables(uint64_t plane_index, uint32_t num_planes, uint64_t run_index, uint32_t num_runs) {
  return plane_index < num_planes && run_index < num_runs;
}

// The rules of the contract every backend applies to work item (run_index, plane_index) of group g, in 64-bit
// arithmetic so no forged field can wrap a bound (see the header comment); backends add theirs after this one.
LMCACHE_FN bool ContractAdmissible(uint32_t g, const GroupDesc& group, uint64_t plane_index, const PlaneDesc& plane,
                                   uint64_t run_index, const RunDesc& run, uint32_t num_chunks) {
  // Pairing: a plane and a run of different groups would move one group's rows with another's geometry.
  if (plane.group_index != g) return false;
  if (plane_index < group.plane_begin || plane_index - group.plane_begin >= group.plane_count) return false;
  if (run_index < group.run_begin || run_index - group.run_begin >= group.run_count) return false;
  if (run.chunk >= num_chunks || run.num_rows == 0) return false;
  if (static_cast<uint64_t>(run.first_row) + run.num_rows > group.rows_per_chunk) return false;
  if (plane.rows_per_block == 0 || plane.rows_per_block != group.rows_per_block || plane.row_bytes == 0) return false;
  if (run.first_slot >= 0) {  // a zero run (kSkipSlot) touches no page
    const uint32_t slot = static_cast<uint32_t>(run.first_slot);
    if (slot / plane.rows_per_block >= plane.num_blocks) return false;
    if (static_cast<uint64_t>(slot % plane.rows_per_block) + run.num_rows > plane.rows_per_block) return false;
  }
  if (plane.layout == kPageND) return true;
  return plane.layout == kPageFractalNZ && plane.nz_unit_bytes > 0 && plane.row_bytes % plane.nz_unit_bytes == 0;
}

}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_TRANSFER_PLAN_H_
