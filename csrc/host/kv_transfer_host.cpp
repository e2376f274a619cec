// Host-memory implementation of the transfer contract; see kv_transfer_host.h for the math.
#include "kv_transfer_host.h"

#include <string.h>

#include <exception>
#include <thread>
#include <vector>

namespace lmcache_npu {
namespace host {
namespace {

uint8_t* Ptr(uint64_t addr) { return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(addr)); }

// The contract's rules plus the object bound, which only the host can check because it knows the object size: an
// item passes only if every byte it would touch lies inside its plane's blocks and its object.
bool Admissible(const HostTables& t, uint32_t g, const GroupDesc& group, uint64_t plane_index, const PlaneDesc& plane,
                uint64_t run_index, const RunDesc& run) {
  if (!ContractAdmissible(g, group, plane_index, plane, run_index, run, t.num_chunks)) return false;
  const uint64_t segment_bytes = static_cast<uint64_t>(group.rows_per_chunk) * plane.row_bytes;
  return plane.object_offset_bytes <= t.object_bytes && segment_bytes <= t.object_bytes - plane.object_offset_bytes;
}

void Copy(uint8_t* dst, const uint8_t* src, uint64_t bytes, HostReport& report) {
  memcpy(dst, src, bytes);
  ++report.dma_ops;
  report.bytes_moved += bytes;
}

// One row of an NZ block at a time: its `cols` units are rows_per_block units apart on the page side and
// contiguous on the object side.
void MoveNzRows(const PlaneDesc& plane, uint8_t* block, uint32_t row_in_block, uint8_t* obj, uint32_t num_rows,
                bool store, HostReport& report) {
  const uint64_t unit = plane.nz_unit_bytes;
  const uint32_t cols = plane.row_bytes / plane.nz_unit_bytes;
  const uint64_t column_pitch = static_cast<uint64_t>(plane.rows_per_block) * unit;
  for (uint32_t r = 0; r < num_rows; ++r) {
    uint8_t* page_row = block + static_cast<uint64_t>(row_in_block + r) * unit;
    uint8_t* obj_row = obj + static_cast<uint64_t>(r) * plane.row_bytes;
    for (uint32_t j = 0; j < cols; ++j) {
      uint8_t* page_unit = page_row + j * column_pitch;
      uint8_t* obj_unit = obj_row + j * unit;
      if (store) {
        Copy(obj_unit, page_unit, unit, report);
      } else {
        Copy(page_unit, obj_unit, unit, report);
      }
    }
  }
}

void MoveItem(const HostTables& t, uint32_t g, const GroupDesc& group, uint64_t plane_index, uint64_t run_index,
              bool store, HostReport& report) {
  if (!ContractItemInTables(plane_index, t.num_planes, run_index, t.num_runs)) {
    ++report.items_rejected;
    return;
  }
  const PlaneDesc& plane = t.planes[plane_index];
  const RunDesc& run = t.runs[run_index];
  if (!Admissible(t, g, group, plane_index, plane, run_index, run)) {
    ++report.items_rejected;
    return;
  }
  uint8_t* obj = Ptr(t.objects[run.chunk] + plane.object_offset_bytes) +
                 static_cast<uint64_t>(run.first_row) * plane.row_bytes;
  const uint64_t bytes = static_cast<uint64_t>(run.num_rows) * plane.row_bytes;
  if (run.first_slot < 0) {
    if (store) {  // skipped rows read as zeros; a load leaves their pages untouched
      memset(obj, 0, bytes);
      ++report.dma_ops;
      report.bytes_moved += bytes;
    }
    ++report.items_done;
    return;
  }
  const uint32_t slot = static_cast<uint32_t>(run.first_slot);
  uint8_t* block = Ptr(plane.base_addr) + static_cast<uint64_t>(slot / plane.rows_per_block) * plane.block_stride_bytes;
  const uint32_t row_in_block = slot % plane.rows_per_block;
  if (plane.layout == kPageND) {
    uint8_t* page = block + static_cast<uint64_t>(row_in_block) * plane.row_bytes;
    if (store) {
      Copy(obj, page, bytes, report);
    } else {
      Copy(page, obj, bytes, report);
    }
  } else {
    MoveNzRows(plane, block, row_in_block, obj, run.num_rows, store, report);
  }
  ++report.items_done;
}

}  // namespace

HostReport TransferItems(const HostTables& t, Direction direction, uint64_t begin, uint64_t end) {
  HostReport report;
  const bool store = direction == kStore;
  uint32_t g = 0;
  for (uint64_t item = begin; item < end; ++item) {
    // Items are grouped in table order; the cursor only moves forward, as on a device core.
    while (g < t.num_groups && item >= t.groups[g].item_begin + GroupItemCount(t.groups[g])) ++g;
    if (g >= t.num_groups || item < t.groups[g].item_begin) {
      ++report.items_rejected;
      continue;
    }
    const GroupDesc& group = t.groups[g];
    const uint64_t local = item - group.item_begin;
    MoveItem(t, g, group, group.plane_begin + local / group.run_count, group.run_begin + local % group.run_count,
             store, report);
  }
  return report;
}

HostReport Transfer(const HostTables& t, Direction direction, uint32_t threads) {
  uint64_t workers = threads < 1 ? 1 : threads;
  if (workers > t.total_items) workers = t.total_items > 0 ? t.total_items : 1;  // no thread without an item
  if (workers == 1) return TransferItems(t, direction, 0, t.total_items);
  std::vector<HostReport> reports(workers);
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  const auto slice = [&](uint64_t w) { return t.total_items * w / workers; };
  try {
    for (uint64_t w = 1; w < workers; ++w) {
      pool.emplace_back([&, w]() { reports[w] = TransferItems(t, direction, slice(w), slice(w + 1)); });
    }
  } catch (...) {  // a thread that could not start: join the started ones before the error leaves this frame
    for (std::thread& th : pool) th.join();
    throw;
  }
  reports[0] = TransferItems(t, direction, slice(0), slice(1));
  for (std::thread& th : pool) th.join();
  HostReport total;
  for (const HostReport& r : reports) {
    total.items_done += r.items_done;
    total.items_rejected += r.items_rejected;
    total.bytes_moved += r.bytes_moved;
    total.dma_ops += r.dma_ops;
  }
  return total;
}

}  // namespace host
}  // namespace lmcache_npu
