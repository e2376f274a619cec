// lmcache_npu._host: the transfer contract with memcpy over host memory (vLLM's CPU platform).
// Takes raw host addresses (no torch C++ types), like _emu; the GIL is released while bytes move.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "../common/transfer_plan.h"
#include "../host/kv_transfer_host.h"
#include "../host/block_slots.h"
#include "../host/move_runs.h"
#include "../host/sliced_order.h"
#include "../host/slot_runs.h"

namespace py = pybind11;

namespace {

// Enough for the largest host's cores; more would only add thread start-up cost.
constexpr uint32_t kMaxThreads = 1024;

template <typename T>
const T* Table(uint64_t addr) { return reinterpret_cast<const T*>(static_cast<uintptr_t>(addr)); }

py::dict TransferBinding(uint64_t planes, uint64_t groups, uint64_t runs, uint64_t objects, uint64_t total_items,
                         uint32_t num_planes, uint32_t num_groups, uint32_t num_runs, uint32_t num_chunks,
                         uint64_t object_bytes, uint32_t direction, uint32_t threads) {
  if (direction != lmcache_npu::kStore && direction != lmcache_npu::kLoad) {
    throw py::value_error("direction " + std::to_string(direction) + " is neither 0 (store) nor 1 (load)");
  }
  if (threads < 1 || threads > kMaxThreads) {
    throw py::value_error("threads " + std::to_string(threads) + " must be in [1, " + std::to_string(kMaxThreads) +
                          "]");
  }
  if (total_items > 0 && (planes == 0 || groups == 0 || runs == 0 || objects == 0)) {
    throw py::value_error("a transfer with work items needs the plane, group, run and object tables");
  }
  lmcache_npu::host::HostTables tables;
  tables.planes = Table<lmcache_npu::PlaneDesc>(planes);
  tables.groups = Table<lmcache_npu::GroupDesc>(groups);
  tables.runs = Table<lmcache_npu::RunDesc>(runs);
  tables.objects = Table<uint64_t>(objects);
  tables.num_planes = num_planes;
  tables.num_groups = num_groups;
  tables.num_runs = num_runs;
  tables.num_chunks = num_chunks;
  tables.object_bytes = object_bytes;
  tables.total_items = total_items;
  lmcache_npu::host::HostReport report;
  {
    py::gil_scoped_release release;
    report = lmcache_npu::host::Transfer(tables, static_cast<lmcache_npu::Direction>(direction), threads);
  }
  py::dict d;
  d["items_done"] = report.items_done;
  d["items_rejected"] = report.items_rejected;
  d["bytes_moved"] = report.bytes_moved;
  d["dma_ops"] = report.dma_ops;
  return d;
}

// A C-contiguous array's bytes as `count` records of T (numpy structured dtypes arrive as plain bytes).
template <typename T>
const T* Records(const py::array& array, const char* name, size_t* count) {
  if (!(array.flags() & py::array::c_style) || array.itemsize() != static_cast<py::ssize_t>(sizeof(T))) {
    throw py::value_error(std::string(name) + ": needs C-contiguous records of " + std::to_string(sizeof(T)) +
                          " B, got items of " + std::to_string(array.itemsize()) + " B");
  }
  *count = static_cast<size_t>(array.size());
  return static_cast<const T*>(array.data());
}

template <typename T, size_t N>
py::array_t<T> Rows(const std::vector<std::array<T, N>>& rows) {
  py::array_t<T> out({static_cast<py::ssize_t>(rows.size()), static_cast<py::ssize_t>(N)});
  if (!rows.empty()) std::memcpy(out.mutable_data(), rows.data(), rows.size() * sizeof(rows[0]));
  return out;
}

template <typename T>
py::array_t<uint8_t> Bytes(const std::vector<T>& records) {
  py::array_t<uint8_t> out(static_cast<py::ssize_t>(records.size() * sizeof(T)));
  if (!records.empty()) std::memcpy(out.mutable_data(), records.data(), records.size() * sizeof(T));
  return out;
}

// The planner's input over Python's tables; `addresses` and `storages` keep converted object arrays alive.
lmcache_npu::host::SlicedOrderInput SlicedInput(
    const py::array& planes, const py::array& groups, const py::array& runs,
    const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& plane_slice, uint32_t num_slices,
    uint32_t num_chunks, uint64_t piece_bytes, uint64_t object_bytes, const py::object& object_addresses,
    const py::object& object_storages, py::array_t<uint64_t, py::array::c_style>* addresses,
    py::array_t<uint64_t, py::array::c_style>* storages) {
  size_t num_planes = 0, num_groups = 0, num_runs = 0;
  lmcache_npu::host::SlicedOrderInput input;
  input.planes = Records<lmcache_npu::PlaneDesc>(planes, "planes", &num_planes);
  input.groups = Records<lmcache_npu::GroupDesc>(groups, "groups", &num_groups);
  input.runs = Records<lmcache_npu::RunDesc>(runs, "runs", &num_runs);
  if (static_cast<size_t>(plane_slice.size()) != num_planes) {
    throw py::value_error("plane_slice has " + std::to_string(plane_slice.size()) + " entries for " +
                          std::to_string(num_planes) + " planes");
  }
  input.plane_slice = plane_slice.data();
  input.num_planes = static_cast<uint32_t>(num_planes);
  input.num_groups = static_cast<uint32_t>(num_groups);
  input.num_runs = static_cast<uint32_t>(num_runs);
  input.num_chunks = num_chunks;
  input.num_slices = num_slices;
  input.piece_bytes = piece_bytes;
  input.object_bytes = object_bytes;
  if (!object_addresses.is_none()) {
    *addresses = py::array_t<uint64_t, py::array::c_style>::ensure(object_addresses);
    *storages = py::array_t<uint64_t, py::array::c_style>::ensure(object_storages);
    if (!*addresses || !*storages || static_cast<uint64_t>(addresses->size()) != num_chunks ||
        static_cast<uint64_t>(storages->size()) != num_chunks) {
      throw py::value_error("object_addresses and object_storages need one uint64 per chunk (" +
                            std::to_string(num_chunks) + ")");
    }
    input.object_addresses = addresses->data();
    input.object_storages = storages->data();
  }
  return input;
}

// The order planned into this thread's scratch (its vectors' memory is reused from load to load); valid until the
// thread plans again.
const lmcache_npu::host::SlicedOrder& Planned(const lmcache_npu::host::SlicedOrderInput& input) {
  thread_local lmcache_npu::host::SlicedOrder scratch;
  try {
    lmcache_npu::host::PlanSlicedLoad(input, &scratch);
  } catch (const std::invalid_argument& error) {
    throw py::value_error(error.what());
  }
  return scratch;
}

py::array_t<uint32_t> SliceItems(const lmcache_npu::host::SlicedOrder& order) {
  py::array_t<uint32_t> slice_items(static_cast<py::ssize_t>(order.slice_items.size()));
  std::memcpy(slice_items.mutable_data(), order.slice_items.data(), order.slice_items.size() * sizeof(uint32_t));
  return slice_items;
}

py::tuple SlicedLoadOrderBinding(const py::array& planes, const py::array& groups, const py::array& runs,
                                 const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& plane_slice,
                                 uint32_t num_slices, uint32_t num_chunks, uint64_t piece_bytes,
                                 uint64_t object_bytes) {
  py::array_t<uint64_t, py::array::c_style> addresses, storages;  // none: the copies are sliced_load_tables' own
  const lmcache_npu::host::SlicedOrderInput input =
      SlicedInput(planes, groups, runs, plane_slice, num_slices, num_chunks, piece_bytes, object_bytes, py::none(),
                  py::none(), &addresses, &storages);
  const lmcache_npu::host::SlicedOrder& order = Planned(input);
  return py::make_tuple(Bytes(order.runs), Bytes(order.groups), Rows(order.items), SliceItems(order),
                        Rows(order.pieces));
}

// The order planned and packed into `out` in one call (sliced_order.h, PackSlicedLoad). Returns the part offsets
// (None when `out` is smaller than the tables: nothing is written, grow it to the returned size), the tables' size,
// the item, run and group counts, the per-slice item counts and the copies (staging address added; none without
// staging).
py::tuple SlicedLoadTablesBinding(const py::array& planes, const py::array& groups, const py::array& runs,
                                  const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& plane_slice,
                                  uint32_t num_slices, uint32_t num_chunks, uint64_t piece_bytes,
                                  uint64_t object_bytes, const py::object& object_addresses,
                                  const py::object& object_storages, uint64_t staging_address,
                                  uint64_t status_bytes, py::array_t<uint8_t, py::array::c_style>& out) {
  py::array_t<uint64_t, py::array::c_style> addresses, storages;
  lmcache_npu::host::SlicedOrderInput input =
      SlicedInput(planes, groups, runs, plane_slice, num_slices, num_chunks, piece_bytes, object_bytes,
                  object_addresses, object_storages, &addresses, &storages);
  const uint64_t* objects = input.object_addresses;
  if (objects == nullptr) throw py::value_error("sliced_load_tables: object_addresses are required");
  if (staging_address == 0) input.object_addresses = nullptr;  // the kernel reads the objects: nothing to copy
  const lmcache_npu::host::SlicedOrder& order = Planned(input);
  const lmcache_npu::host::PackedLayout layout = lmcache_npu::host::PackedSlicedLayout(order, num_chunks, status_bytes);
  py::object offsets = py::none();
  if (static_cast<uint64_t>(out.size()) >= layout.bytes) {
    lmcache_npu::host::PackSlicedLoad(order, layout, num_chunks, object_bytes, staging_address, objects,
                                      out.mutable_data());
    offsets = py::cast(std::vector<uint64_t>(layout.offsets.begin(), layout.offsets.end()));
  }
  py::array_t<uint64_t> copies({static_cast<py::ssize_t>(order.copies.size()), static_cast<py::ssize_t>(4)});
  uint64_t* row = copies.mutable_data();
  for (const std::array<uint64_t, 4>& copy : order.copies) {
    row[0] = copy[0] + staging_address;
    row[1] = copy[1];
    row[2] = copy[2];
    row[3] = copy[3];
    row += 4;
  }
  return py::make_tuple(offsets, layout.bytes, static_cast<uint64_t>(order.items.size()),
                        static_cast<uint64_t>(order.runs.size()), static_cast<uint64_t>(order.groups.size()),
                        SliceItems(order), copies);
}

py::tuple SlotRunsBinding(const py::array_t<int64_t, py::array::c_style>& slots, uint64_t rows_per_block,
                          int64_t limit, bool zero_runs, bool unique) {
  if (slots.ndim() != 2) throw py::value_error("slots must be a (chunks, rows) matrix");
  if (rows_per_block == 0) throw py::value_error("rows_per_block must be positive");
  const lmcache_npu::host::SlotRuns runs = lmcache_npu::host::CutSlotRuns(
      slots.data(), static_cast<uint64_t>(slots.shape(0)), static_cast<uint64_t>(slots.shape(1)), rows_per_block,
      limit, zero_runs, unique);
  return py::make_tuple(Bytes(runs.runs), static_cast<uint32_t>(runs.problem), runs.at, runs.again);
}

py::tuple BlockSlotsBinding(int64_t chunk_tokens, int64_t stored_tokens, int64_t tokens_per_block,
                            int64_t compress_ratio, int64_t rows_per_block, int64_t rows_per_chunk, bool recurrent,
                            const std::vector<int64_t>& block_ids, int64_t first_block, int64_t null_block,
                            const std::vector<int64_t>& index, const py::object& first_token,
                            const py::object& end_token, const py::object& store, const py::object& bare) {
  lmcache_npu::host::SlotGroup group{chunk_tokens, stored_tokens, tokens_per_block, compress_ratio, rows_per_block,
                                     rows_per_chunk, recurrent};
  lmcache_npu::host::ChunkMoves moves;
  moves.index = index.data();
  moves.count = index.size();
  moves.transfer = !first_token.is_none();
  std::vector<int64_t> first, end;
  std::vector<uint8_t> stores, bares;
  if (moves.transfer) {
    first = first_token.cast<std::vector<int64_t>>();
    end = end_token.cast<std::vector<int64_t>>();
    stores = store.cast<std::vector<uint8_t>>();
    bares = bare.cast<std::vector<uint8_t>>();
    if (first.size() != index.size() || end.size() != index.size() || stores.size() != index.size() ||
        bares.size() != index.size()) {
      throw py::value_error("block_slots: first_token, end_token, store and bare need one entry per chunk (" +
                            std::to_string(index.size()) + ")");
    }
    moves.first_token = first.data();
    moves.end_token = end.data();
    moves.store = stores.data();
    moves.bare = bares.data();
  }
  if (rows_per_chunk < 0) throw py::value_error("block_slots: rows_per_chunk must not be negative");
  py::array_t<int64_t> slots({static_cast<py::ssize_t>(index.size()), static_cast<py::ssize_t>(rows_per_chunk)});
  py::array_t<bool> refused(static_cast<py::ssize_t>(index.size()));
  try {
    lmcache_npu::host::BlockSlots(group, block_ids, first_block, null_block, moves, slots.mutable_data(),
                                  reinterpret_cast<uint8_t*>(refused.mutable_data()));
  } catch (const std::invalid_argument& error) {
    throw py::value_error(error.what());
  }
  return py::make_tuple(slots, refused);
}

// groups: per plan group None (no slots) or (the 7 block_slots geometry numbers, scheduler group, moved, the pages'
// rows per block, the pages' rows); windows: (end, null block, block ids per block table, first block per table).
py::tuple MoveRunsBinding(const py::list& groups, const py::list& windows, const std::vector<int64_t>& index,
                          const std::vector<int64_t>& first_token, const std::vector<int64_t>& end_token,
                          const std::vector<uint8_t>& store, const std::vector<uint8_t>& bare, bool zero_runs,
                          bool unique) {
  const size_t count = index.size();
  if (first_token.size() != count || end_token.size() != count || store.size() != count || bare.size() != count) {
    throw py::value_error("move_runs: first_token, end_token, store and bare need one entry per move (" +
                          std::to_string(count) + ")");
  }
  std::vector<lmcache_npu::host::RunGroup> group_list(groups.size());
  std::vector<const lmcache_npu::host::RunGroup*> group_ptrs(groups.size(), nullptr);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].is_none()) continue;
    const py::tuple t = groups[g].cast<py::tuple>();
    if (t.size() != 11) throw py::value_error("move_runs: group " + std::to_string(g) + " needs 11 numbers");
    lmcache_npu::host::RunGroup& group = group_list[g];
    group.slots = {t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
                   t[4].cast<int64_t>(), t[5].cast<int64_t>(), t[6].cast<bool>()};
    group.scheduler_group = t[7].cast<uint32_t>();
    group.moved = t[8].cast<bool>();
    group.rows_per_block = t[9].cast<uint64_t>();
    group.limit = t[10].cast<int64_t>();
    if (group.moved && group.rows_per_block == 0) {
      throw py::value_error("move_runs: group " + std::to_string(g) + " is moved but its pages have no rows per block");
    }
    group_ptrs[g] = &group;
  }
  std::vector<lmcache_npu::host::MoveWindow> window_list(windows.size());
  for (size_t w = 0; w < windows.size(); ++w) {
    const py::tuple t = windows[w].cast<py::tuple>();
    if (t.size() != 4) throw py::value_error("move_runs: window " + std::to_string(w) + " needs 4 entries");
    window_list[w].end = t[0].cast<uint64_t>();
    window_list[w].null_block = t[1].cast<int64_t>();
    window_list[w].block_ids = t[2].cast<std::vector<std::vector<int64_t>>>();
    window_list[w].first_block = t[3].cast<std::vector<int64_t>>();
  }
  lmcache_npu::host::ChunkMoves moves;
  moves.index = index.data();
  moves.first_token = first_token.data();
  moves.end_token = end_token.data();
  moves.store = store.data();
  moves.bare = bare.data();
  moves.count = count;
  moves.transfer = true;
  lmcache_npu::host::MoveRuns runs;
  try {
    runs = lmcache_npu::host::PlanMoveRuns(group_ptrs, window_list, moves, zero_runs, unique);
  } catch (const std::invalid_argument& error) {
    throw py::value_error(error.what());
  }
  py::array_t<bool> refused(static_cast<py::ssize_t>(count));
  std::memcpy(refused.mutable_data(), runs.refused.data(), count);
  py::list per_group;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (group_ptrs[g] == nullptr) {
      per_group.append(py::none());
      continue;
    }
    const lmcache_npu::host::GroupRuns& group = runs.groups[g];
    const py::ssize_t rows = std::max<int64_t>(group_list[g].slots.rows_per_chunk, 0);
    py::array_t<int64_t> slots({static_cast<py::ssize_t>(runs.kept), rows});
    if (!group.slots.empty()) std::memcpy(slots.mutable_data(), group.slots.data(), group.slots.size() * 8);
    per_group.append(py::make_tuple(slots, Bytes(group.runs.runs), static_cast<uint32_t>(group.runs.problem),
                                    group.runs.at, group.runs.again));
  }
  return py::make_tuple(refused, per_group);
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "KV-cache transfer contract with memcpy over host memory";
  m.def("transfer", &TransferBinding, "Move every work item of a batch; returns the counts", py::arg("planes"),
        py::arg("groups"), py::arg("runs"), py::arg("objects"), py::arg("total_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("object_bytes"),
        py::arg("direction"), py::arg("threads") = 1);
  m.def("sliced_load_order", &SlicedLoadOrderBinding,
        "A sliced load's work order to inspect (csrc/host/sliced_order.h): run and group table bytes, items, "
        "per-slice item counts and copy pieces (sliced_load_tables plans the same order with its copies)",
        py::arg("planes"), py::arg("groups"), py::arg("runs"), py::arg("plane_slice"), py::arg("num_slices"),
        py::arg("num_chunks"), py::arg("piece_bytes"), py::arg("object_bytes"));
  m.def("sliced_load_tables", &SlicedLoadTablesBinding,
        "A sliced load's work order packed into `out` for the CUDA backend's native call (csrc/host/sliced_order.h): "
        "part offsets (None: `out` too small), table bytes, item, run and group counts, per-slice item counts, copies",
        py::arg("planes"), py::arg("groups"), py::arg("runs"), py::arg("plane_slice"), py::arg("num_slices"),
        py::arg("num_chunks"), py::arg("piece_bytes"), py::arg("object_bytes"), py::arg("object_addresses"),
        py::arg("object_storages"), py::arg("staging_address"), py::arg("status_bytes"), py::arg("out"));
  m.def("move_runs", &MoveRunsBinding,
        "A transfer's slots and checked runs from its moves and block windows (csrc/host/move_runs.h): the refused "
        "moves, and per group None or (kept moves' slots, run bytes, problem, at, again)",
        py::arg("groups"), py::arg("windows"), py::arg("index"), py::arg("first_token"), py::arg("end_token"),
        py::arg("store"), py::arg("bare"), py::arg("zero_runs"), py::arg("unique"));
  m.def("slot_runs", &SlotRunsBinding,
        "A group's slot matrix checked and cut into runs (csrc/host/slot_runs.h): run table bytes, the problem "
        "found (0 none, 1 a slot out of range, 2 a slot a load writes twice) and its row-major positions",
        py::arg("slots"), py::arg("rows_per_block"), py::arg("limit"), py::arg("zero_runs"), py::arg("unique"));
  m.def("block_slots", &BlockSlotsBinding,
        "Chunk rows to page slots (csrc/host/block_slots.h): the (chunks, rows) slot matrix and, for a transfer "
        "(first_token given), which stores are refused",
        py::arg("chunk_tokens"), py::arg("stored_tokens"), py::arg("tokens_per_block"), py::arg("compress_ratio"),
        py::arg("rows_per_block"), py::arg("rows_per_chunk"), py::arg("recurrent"), py::arg("block_ids"),
        py::arg("first_block"), py::arg("null_block"), py::arg("index"), py::arg("first_token") = py::none(),
        py::arg("end_token") = py::none(), py::arg("store") = py::none(), py::arg("bare") = py::none());
  m.attr("MAX_THREADS") = kMaxThreads;
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
  m.attr("PLANE_DESC_BYTES") = sizeof(lmcache_npu::PlaneDesc);
  m.attr("GROUP_DESC_BYTES") = sizeof(lmcache_npu::GroupDesc);
  m.attr("RUN_DESC_BYTES") = sizeof(lmcache_npu::RunDesc);
}
