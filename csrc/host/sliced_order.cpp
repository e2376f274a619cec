// A sliced load's work order: the contract is in sliced_order.h.
#include "sliced_order.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace lmcache_npu {
namespace host {
namespace {

[[noreturn]] void Fail(const std::string& what) { throw std::invalid_argument("sliced load order: " + what); }

// The message is built only when the rule fails: the checks run on every load.
#define LMCACHE_CHECK(ok, what) \
  do {                          \
    if (!(ok)) Fail(what);      \
  } while (0)

void CheckTables(const SlicedOrderInput& in) {
  LMCACHE_CHECK(in.num_slices >= 1, "a load needs at least one slice");
  for (uint32_t p = 0; p < in.num_planes; ++p) {
    const int64_t slice = in.plane_slice[p];
    LMCACHE_CHECK(slice >= 0 && slice < static_cast<int64_t>(in.num_slices),
          "plane " + std::to_string(p) + " is in slice " + std::to_string(slice) + ", outside the load's " +
              std::to_string(in.num_slices) + " slices");
    LMCACHE_CHECK(in.planes[p].row_bytes > 0, "plane " + std::to_string(p) + " has row_bytes 0");
    LMCACHE_CHECK(in.planes[p].group_index < in.num_groups, "plane " + std::to_string(p) + " names group " +
                                                                std::to_string(in.planes[p].group_index) +
                                                                ", outside the " + std::to_string(in.num_groups) +
                                                                " groups");
  }
  for (uint32_t g = 0; g < in.num_groups; ++g) {
    const GroupDesc& group = in.groups[g];
    const std::string name = "group " + std::to_string(g);
    LMCACHE_CHECK(uint64_t{group.plane_begin} + group.plane_count <= in.num_planes,
          name + ": planes [" + std::to_string(group.plane_begin) + ", +" + std::to_string(group.plane_count) +
              ") outside the " + std::to_string(in.num_planes) + " planes");
    LMCACHE_CHECK(uint64_t{group.run_begin} + group.run_count <= in.num_runs,
          name + ": runs [" + std::to_string(group.run_begin) + ", +" + std::to_string(group.run_count) +
              ") outside the " + std::to_string(in.num_runs) + " runs");
    for (uint32_t p = group.plane_begin; p < group.plane_begin + group.plane_count; ++p) {
      LMCACHE_CHECK(in.planes[p].group_index == g, "plane " + std::to_string(p) + " names group " +
                                               std::to_string(in.planes[p].group_index) + ", not " + name);
    }
    for (uint32_t r = group.run_begin; r < group.run_begin + group.run_count; ++r) {
      const RunDesc& run = in.runs[r];
      LMCACHE_CHECK(run.chunk < in.num_chunks, "run " + std::to_string(r) + ": chunk " + std::to_string(run.chunk) +
                                           " outside the batch's " + std::to_string(in.num_chunks) + " chunks");
      LMCACHE_CHECK(run.num_rows > 0 && uint64_t{run.first_row} + run.num_rows <= group.rows_per_chunk,
            "run " + std::to_string(r) + ": rows [" + std::to_string(run.first_row) + ", +" +
                std::to_string(run.num_rows) + ") outside the " + std::to_string(group.rows_per_chunk) +
                " rows of a chunk of " + name);
    }
  }
}

// The group's runs cut into pieces of at most `rows` rows each (0: uncut), appended to `out`.
void SplitRuns(const RunDesc* runs, uint32_t count, uint32_t rows, std::vector<RunDesc>* out) {
  for (uint32_t r = 0; r < count; ++r) {
    const RunDesc& run = runs[r];
    if (rows == 0) {
      out->push_back(run);
      continue;
    }
    for (uint32_t done = 0; done < run.num_rows; done += rows) {
      RunDesc piece = run;
      piece.first_row = run.first_row + done;
      piece.num_rows = std::min(rows, run.num_rows - done);
      if (run.first_slot >= 0) piece.first_slot = run.first_slot + static_cast<int32_t>(done);
      out->push_back(piece);
    }
  }
}

struct Span {
  uint64_t start;   // in staging
  uint64_t length;
  uint32_t chunk;   // start / object_bytes, kept so the copy pieces need no division
};

}  // namespace

void PlanSlicedLoad(const SlicedOrderInput& in, SlicedOrder* out) {
  CheckTables(in);
  SlicedOrder& order = *out;
  order.runs.clear();  // the vectors keep their memory: a load's order is planned without faulting in fresh pages
  order.items.clear();
  order.pieces.clear();
  order.copies.clear();
  // Pieces, group by group, and the group table over them.
  std::vector<uint32_t> widest(in.num_groups, 0);
  for (uint32_t g = 0; g < in.num_groups; ++g) {
    const GroupDesc& group = in.groups[g];
    for (uint32_t p = group.plane_begin; p < group.plane_begin + group.plane_count; ++p) {
      widest[g] = std::max(widest[g], in.planes[p].row_bytes);
    }
  }
  order.groups.assign(in.groups, in.groups + in.num_groups);
  uint64_t item_cursor = 0;
  for (uint32_t g = 0; g < in.num_groups; ++g) {
    GroupDesc& group = order.groups[g];
    const uint64_t rows_wide = widest[g] == 0 || in.piece_bytes == 0 ? 0 : in.piece_bytes / widest[g];
    const uint32_t rows = widest[g] == 0 || in.piece_bytes == 0
                              ? 0
                              : static_cast<uint32_t>(std::min<uint64_t>(std::max<uint64_t>(rows_wide, 1),
                                                                        std::numeric_limits<uint32_t>::max()));
    const size_t begin = order.runs.size();
    SplitRuns(in.runs + group.run_begin, group.run_count, rows, &order.runs);
    LMCACHE_CHECK(order.runs.size() <= std::numeric_limits<uint32_t>::max(), "more pieces than a uint32 run index holds");
    group.run_begin = static_cast<uint32_t>(begin);
    group.run_count = static_cast<uint32_t>(order.runs.size() - begin);
    group.item_begin = item_cursor;
    item_cursor += uint64_t{group.run_count} * group.plane_count;
  }
  LMCACHE_CHECK(item_cursor <= std::numeric_limits<uint32_t>::max(), "more items than the kernel's uint32 index holds");
  LMCACHE_CHECK(item_cursor == 0 || in.object_bytes > 0, "a load with items needs object_bytes > 0");

  // Each group's pieces per chunk, in row order: [chunk_first[c], chunk_first[c + 1]) of `by_chunk`.
  const uint32_t chunks = in.num_chunks;
  std::vector<std::vector<uint32_t>> chunk_first(in.num_groups);
  std::vector<std::vector<uint32_t>> by_chunk(in.num_groups);
  for (uint32_t g = 0; g < in.num_groups; ++g) {
    const GroupDesc& group = order.groups[g];
    if (group.plane_count == 0 || group.run_count == 0) continue;
    std::vector<uint32_t>& first = chunk_first[g];
    first.assign(chunks + 1, 0);
    for (uint32_t r = group.run_begin; r < group.run_begin + group.run_count; ++r) ++first[order.runs[r].chunk + 1];
    std::partial_sum(first.begin(), first.end(), first.begin());
    std::vector<uint32_t> fill(first.begin(), first.end() - 1);
    by_chunk[g].resize(group.run_count);
    for (uint32_t r = group.run_begin; r < group.run_begin + group.run_count; ++r) {
      by_chunk[g][fill[order.runs[r].chunk]++] = r;
    }
    for (uint32_t c = 0; c < chunks; ++c) {  // rows ascending inside a chunk: the staging order of one plane
      auto lo = by_chunk[g].begin() + first[c], hi = by_chunk[g].begin() + first[c + 1];
      std::stable_sort(lo, hi, [&](uint32_t a, uint32_t b) { return order.runs[a].first_row < order.runs[b].first_row; });
    }
  }

  // Planes per slice in object order: inside a chunk, a plane's bytes all come before the next plane's.
  std::vector<uint32_t> planes(in.num_planes);
  std::iota(planes.begin(), planes.end(), 0);
  std::stable_sort(planes.begin(), planes.end(), [&](uint32_t a, uint32_t b) {
    if (in.plane_slice[a] != in.plane_slice[b]) return in.plane_slice[a] < in.plane_slice[b];
    return in.planes[a].object_offset_bytes < in.planes[b].object_offset_bytes;
  });

  // An item's staging bytes, from its piece and plane (no per-item table: the plan's tables stay in cache).
  const auto span_of = [&](const std::array<uint32_t, 4>& item) {
    const RunDesc& piece = order.runs[item[0]];
    const PlaneDesc& plane = in.planes[item[1]];
    return Span{piece.chunk * in.object_bytes + plane.object_offset_bytes + uint64_t{piece.first_row} * plane.row_bytes,
                uint64_t{piece.num_rows} * plane.row_bytes, piece.chunk};
  };
  order.items.reserve(item_cursor);
  order.slice_items.assign(in.num_slices, 0);
  bool ordered = true;  // starts ascend inside every slice (they do for any plan whose plane segments are disjoint)
  size_t plane_at = 0;
  for (uint32_t k = 0; k < in.num_slices; ++k) {
    size_t plane_end = plane_at;
    while (plane_end < planes.size() && in.plane_slice[planes[plane_end]] == k) ++plane_end;
    const size_t slice_begin = order.items.size();
    uint64_t last_start = 0;
    for (uint32_t c = 0; c < chunks; ++c) {
      for (size_t i = plane_at; i < plane_end; ++i) {
        const uint32_t p = planes[i];
        const PlaneDesc& plane = in.planes[p];
        const uint32_t g = plane.group_index;
        if (chunk_first[g].empty()) continue;
        for (uint32_t j = chunk_first[g][c]; j < chunk_first[g][c + 1]; ++j) {
          const RunDesc& piece = order.runs[by_chunk[g][j]];
          const uint64_t start = c * in.object_bytes + plane.object_offset_bytes + uint64_t{piece.first_row} * plane.row_bytes;
          if (order.items.size() > slice_begin && start <= last_start) ordered = false;
          last_start = start;
          std::array<uint32_t, 4>& item = order.items.emplace_back();  // fields stored in place: a 16 B item
          item[0] = by_chunk[g][j];  // built on the stack and copied stalled the loop on store forwarding
          item[1] = p;
          item[2] = k;
        }
      }
    }
    order.slice_items[k] = static_cast<uint32_t>(order.items.size() - slice_begin);
    plane_at = plane_end;
  }
  if (!ordered) {  // overlapping plane segments: sort each slice's items by their staging start
    std::vector<uint64_t> starts(order.items.size());
    for (size_t i = 0; i < starts.size(); ++i) starts[i] = span_of(order.items[i]).start;
    std::vector<uint32_t> index(order.items.size());
    std::iota(index.begin(), index.end(), 0);
    std::stable_sort(index.begin(), index.end(), [&](uint32_t a, uint32_t b) {
      if (order.items[a][2] != order.items[b][2]) return order.items[a][2] < order.items[b][2];
      return starts[a] < starts[b];
    });
    const std::vector<std::array<uint32_t, 4>> items(order.items);
    for (size_t i = 0; i < index.size(); ++i) order.items[i] = items[index[i]];
  }

  // Copy pieces: neighbours of one slice and chunk merged across gaps under the object alignment.
  uint64_t piece_start = 0, piece_end = 0;  // the open piece's staging bytes
  for (const std::array<uint32_t, 4>& item : order.items) {
    const Span span = span_of(item);
    const uint64_t start = span.start, end = start + span.length;
    const int64_t chunk = span.chunk;
    const int64_t slice = item[2];
    if (!order.pieces.empty()) {
      std::array<int64_t, 4>& last = order.pieces.back();
      if (last[0] == chunk && last[3] == slice && (start < piece_end || start - piece_end < kObjectAlignBytes)) {
        piece_end = end;
        last[2] = static_cast<int64_t>(end - piece_start);
        continue;
      }
    }
    piece_start = start;
    piece_end = end;
    order.pieces.push_back({chunk, static_cast<int64_t>(start - chunk * in.object_bytes),
                            static_cast<int64_t>(span.length), slice});
  }
  if (in.object_addresses == nullptr) return;
  // Copies: pieces contiguous on both sides, in one allocation and one slice, merged.
  uint64_t staged_end = 0, hosted_end = 0;
  for (const std::array<int64_t, 4>& piece : order.pieces) {
    const uint64_t chunk = static_cast<uint64_t>(piece[0]), offset = static_cast<uint64_t>(piece[1]);
    const uint64_t length = static_cast<uint64_t>(piece[2]), slice = static_cast<uint64_t>(piece[3]);
    const uint64_t staged = chunk * in.object_bytes + offset, hosted = in.object_addresses[chunk] + offset;
    if (!order.copies.empty()) {
      std::array<uint64_t, 4>& last = order.copies.back();
      const uint64_t last_chunk = last[0] / in.object_bytes;
      if (staged == staged_end && hosted == hosted_end && last[3] == slice &&
          in.object_storages[chunk] == in.object_storages[last_chunk]) {
        last[2] += length;
        staged_end += length;
        hosted_end += length;
        continue;
      }
    }
    order.copies.push_back({staged, hosted, length, slice});
    staged_end = staged + length;
    hosted_end = hosted + length;
  }
}

#undef LMCACHE_CHECK

namespace {

uint64_t Aligned(uint64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

PackedLayout PackedSlicedLayout(const SlicedOrder& order, uint32_t num_chunks, uint64_t status_bytes) {
  const std::array<uint64_t, kPackedParts> sizes = {
      order.groups.size() * sizeof(GroupDesc), order.runs.size() * sizeof(RunDesc), uint64_t{num_chunks} * 8,
      order.items.size() * sizeof(order.items[0]), order.slice_items.size() * 4, order.slice_items.size() * 4,
      status_bytes, 0};
  PackedLayout layout;
  uint64_t end = 0;
  for (int part = 0; part < kPackedParts; ++part) {
    layout.offsets[part] = end;
    end += Aligned(sizes[part]);
  }
  layout.bytes = std::max<uint64_t>(end, 64);
  return layout;
}

void PackSlicedLoad(const SlicedOrder& order, const PackedLayout& layout, uint32_t num_chunks, uint64_t object_bytes,
                    uint64_t staging_address, const uint64_t* object_addresses, uint8_t* out) {
  const auto put = [&](PackedPart part, const void* data, size_t bytes) {
    if (bytes != 0) std::memcpy(out + layout.offsets[part], data, bytes);
  };
  put(kPackedGroups, order.groups.data(), order.groups.size() * sizeof(GroupDesc));
  put(kPackedRuns, order.runs.data(), order.runs.size() * sizeof(RunDesc));
  uint64_t* objects = reinterpret_cast<uint64_t*>(out + layout.offsets[kPackedObjects]);
  for (uint32_t c = 0; c < num_chunks; ++c) {
    objects[c] = staging_address != 0 ? staging_address + c * object_bytes : object_addresses[c];
  }
  put(kPackedItems, order.items.data(), order.items.size() * sizeof(order.items[0]));
  put(kPackedSliceItems, order.slice_items.data(), order.slice_items.size() * 4);
  std::memset(out + layout.offsets[kPackedCounters], 0, layout.offsets[kPackedStatus] - layout.offsets[kPackedCounters]);
  std::memset(out + layout.offsets[kPackedStatus], 0, layout.offsets[kPackedHostObjects] - layout.offsets[kPackedStatus]);
}

}  // namespace host
}  // namespace lmcache_npu
